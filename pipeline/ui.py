"""Console output: rich progress for long steps, everything on stderr so ``--json`` stdout stays clean."""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

console = Console(stderr=True, highlight=False)


@contextlib.contextmanager
def status(text: str) -> Iterator[None]:
    """A spinner with elapsed time for a step whose length is unknown (download, conversion, server start)."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True, disable=not console.is_terminal) as prog:
        prog.add_task(text, total=None)
        yield
    if not console.is_terminal:
        print(f"  {text}: done", file=sys.stderr)


@contextlib.contextmanager
def progress(text: str, total: int) -> Iterator["Progress"]:
    """A bar over ``total`` units; call ``advance()`` on the yielded object."""
    prog = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal)
    with prog:
        task = prog.add_task(text, total=total)

        class _Bar:
            def advance(self, n: int = 1) -> None:
                prog.advance(task, n)

        yield _Bar()  # type: ignore[misc]
    if not console.is_terminal:
        print(f"  {text}: {total} done", file=sys.stderr)
