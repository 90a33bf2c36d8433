"""``python -m pipeline VERB [options] [hydra overrides...]``: one argparse subcommand per verb.

Each verb family lives in its own module (``build``: build/plan/validate, ``render``, ``serve``, ``lint``, ``bundle``:
verify/diff, ``fleet``: matrix/outdated/gc, ``sweep``: ``-m``/``--multirun``) and registers its subcommands here.
Hydra overrides (``key=value``, ``+key=value``, ``~key``, ``hydra/launcher=X``) pass through untouched.

Exit codes: 0 ok, 1 a stage or gate failed (report written), 2 bad input (one line on stderr, nothing written),
130 interrupted (SIGINT), 143 interrupted by SIGTERM, 129 a Slurm sweep's submitter hung up (SIGHUP; its jobs run on).
Every verb fails the same way (:func:`pipeline.errors.known`): a known error is one line and its exit
code, a full disk one line naming the output, anything else one line with its traceback in the run log.
"""
from __future__ import annotations

import os
import sys

# Before torch is imported (its OpenMP runtime reads this once): threads that wait for work sleep instead of
# spinning. On a 2-core machine the pipeline's own processes (the server, the load generators, lm-eval) and anything
# else running share the cores, and a spinning thread burns its core while it has nothing to do
# (tests/unit/test_omp_wait.py measures the idle CPU of both policies). The thread count, and so every result, is
# unchanged; a value set by the user wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pipeline.cli import build, bundle, fleet, lint, render, serve  # noqa: E402
from pipeline.cli.common import PROG, Formatter, Parser, stdout_gone  # noqa: E402
from pipeline import errors, interrupts  # noqa: E402
from pipeline.interrupts import Terminated  # noqa: E402
from pipeline.errors import UserError  # noqa: E402

DESCRIPTION = ("Quantize, build, package, benchmark and publish an LLM for Triton. Each verb takes its options and, "
               "where it composes a config, Hydra overrides (key=value, +key=value, ~key, hydra/launcher=NAME), passed "
               "through untouched.")
EPILOG = ("Run `python -m pipeline VERB --help` for a verb's options. Exit codes: 0 ok, 1 a stage or gate failed "
          "(report written), 2 bad input (one line on stderr, nothing written), 130 interrupted (SIGINT), 143 "
          "interrupted by SIGTERM, 129 a Slurm sweep's submitter hung up (SIGHUP; its jobs run on).")


def parser() -> tuple[Parser, dict[str, Parser]]:
    """The top-level parser and the subcommand parsers by verb (the one list of verbs)."""
    top = Parser(prog=PROG, description=DESCRIPTION, epilog=EPILOG, formatter_class=Formatter, allow_abbrev=False)
    sub = top.add_subparsers(dest="verb", metavar="VERB", parser_class=Parser)
    for family in (build, render, lint, serve, bundle, fleet):
        family.register(sub)
    return top, dict(sub.choices)


def main(argv: list[str] | None = None) -> None:
    import signal

    if hasattr(signal, "SIGXFSZ"):  # a file-size limit becomes an EFBIG error (a clean failure), not a kill
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    from pipeline.ui import quiet_third_party_progress

    quiet_third_party_progress()  # before any library that draws progress bars is imported
    # SIGTERM (a job scheduler, `kill`, a container stop) ends a verb as Ctrl-C does: the same unwinding (temp outputs
    # removed, servers stopped), one line, exit 128 + 15. `serve` installs its own handlers (a drain).
    with interrupts.sigterm_as_interrupt():
        _main(argv)


def _main(argv: list[str] | None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    top, verbs = parser()
    if not argv or argv[0] in ("-h", "--help", "help"):
        top.print_help()
        sys.exit(0 if argv else 2)
    verb, rest = argv[0], argv[1:]
    try:
        if verb not in verbs:
            raise UserError(f"unknown verb '{verb}'; choose one of: {', '.join(verbs)}")
        args = verbs[verb].parse_intermixed_args(rest)
        code = args.func(args)
    except Terminated:
        print("interrupted (SIGTERM)", file=sys.stderr)
        sys.exit(143)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # stdout's reader went away (`| head`, a `| tee` stopped by Ctrl-C): end quietly, as a
        stdout_gone()       # command killed by SIGPIPE would
        sys.exit(141)
    except Exception as exc:  # every verb: one line and its exit code (errors.known)
        err = errors.known(exc)
        print(f"{err.prefix}: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    if code is not None:
        sys.exit(code)
