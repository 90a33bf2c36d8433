"""What every verb module shares: the parser class (argument errors are one ``error:`` line) and its helpers."""
from __future__ import annotations

import argparse
import os
import sys
import textwrap

from pipeline.errors import UserError

PROG = "python -m pipeline"


class Parser(argparse.ArgumentParser):
    """An argument error is a :class:`UserError` (one ``error:`` line, exit 2) instead of argparse's usage dump."""

    def error(self, message: str):  # type: ignore[override]
        raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")


class Formatter(argparse.HelpFormatter):
    """Descriptions and epilogs wrapped paragraph by paragraph; an indented line (an example) is kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in text.split("\n\n"):
            if para.startswith("  "):
                out.append("\n".join(indent + line for line in para.splitlines()))
            else:
                out.append(textwrap.fill(" ".join(para.split()), width, initial_indent=indent,
                                         subsequent_indent=indent))
        return "\n\n".join(out)


def subcommand(sub, name: str, *, help: str, description: str, usage: str | None = None) -> Parser:
    """One verb's parser, as every family module adds it."""
    return sub.add_parser(name, help=help, description=description, usage=usage, allow_abbrev=False,
                          formatter_class=Formatter)


def add_overrides(p: argparse.ArgumentParser, metavar: str = "OVERRIDE", help: str | None = None) -> None:
    p.add_argument("args", nargs="*", metavar=metavar,
                   help=help or "Hydra overrides, passed through untouched: key=value, +key=value, ~key, "
                                "hydra/launcher=NAME")


def stdout_gone() -> None:
    """Point stdout at /dev/null once its reader has gone (a ``BrokenPipeError``), so that nothing more, the
    interpreter's last flush included, fails on the closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
