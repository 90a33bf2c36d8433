"""``python -m pipeline.serving REPO GRPC_URL [OVERRIDE ...]``: the OpenAI front end alone, in front of a Triton
server that already runs at ``GRPC_URL`` (``serve.openai.*`` overrides apply). Prints ``OpenAI http://HOST:PORT/v1``
once it listens and serves until SIGINT or SIGTERM. The bench starts it this way, in a process of its own."""
from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from pipeline.config import compose
    from pipeline.errors import UserError
    from pipeline.serving import run

    if len(argv) < 2:
        print("usage: python -m pipeline.serving REPO GRPC_URL [serve.openai.*=...]", file=sys.stderr)
        return 2
    try:
        cfg = compose(argv[2:])
        oa = cfg.serve.openai
        app, served = run.build_app(Path(argv[0]), argv[1], oa)
        sock = run.bind(str(oa.host), int(oa.port))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"OpenAI {run.url_of(sock)}  (model '{served.name}')", flush=True)
    try:
        run.serve_forever(app, sock)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
