"""``python -m pipeline.serving REPO GRPC_URL [--openai-config FILE | OVERRIDE ...]``: the OpenAI front end alone, in
front of a Triton server that already runs at ``GRPC_URL``, with the shipped ``serve.openai`` settings and the
overrides given (``serve.openai.*=...``), or with the ``serve.openai`` settings in FILE (JSON or YAML, as
``pipeline.serving.run.write_settings`` writes a build's own: how the bench starts it, in a process of its own).
Prints ``OpenAI http://HOST:PORT/v1`` once it listens and serves until SIGINT or SIGTERM. The errors it answers
(logger ``pipeline.serving``: 5xx as ERROR, refused requests as INFO) go to stderr, one timestamped line each, the
lines the task evaluation's ``frontend.log`` holds."""
from __future__ import annotations

import sys
from pathlib import Path

USAGE = "usage: python -m pipeline.serving REPO GRPC_URL [--openai-config FILE | serve.openai.*=...]"


def _log_answers() -> None:
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger = logging.getLogger("pipeline.serving")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def main(argv: list[str]) -> int:
    from pipeline.errors import UserError
    from pipeline.serving import run
    from pipeline.serving.frontend import FrontEnd

    if len(argv) < 2 or (len(argv) > 2 and argv[2] == "--openai-config" and len(argv) != 4):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        if len(argv) > 2 and argv[2] == "--openai-config":
            oa = run.read_settings(Path(argv[3]))
        else:
            from pipeline.config import compose

            oa = compose(argv[2:]).serve.openai
        fe = FrontEnd.from_config(oa, Path(argv[0]), argv[1])
        sock = run.bind(str(oa.host), int(oa.port))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"OpenAI {run.url_of(sock)}  (model '{fe.served.name}')", flush=True)
    _log_answers()
    try:
        run.serve_forever(fe.app(), sock)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
