"""Console output: progress on stderr (:data:`console`), results on stdout (:data:`out`).

While a build runs, its progress (one display per stage, one line per step) goes to stderr; what the command
produces for the user (the build summary, the plan, validate's findings) goes to stdout, so that
``python -m pipeline build > summary.txt`` keeps it. With ``--json`` stdout holds the JSON document alone and the
human summary goes to stderr (:func:`results`).

In a terminal, a running stage shows one live display: a spinner naming the current step (``status``) and a bar for
each counted step (``progress``). Anywhere else (CI logs, pipes) nothing is redrawn: each step prints one line when
it finishes. Third-party progress bars (tqdm: transformers, huggingface_hub, ModelOpt) are switched off by
:func:`quiet_third_party_progress`; the libraries' log records and Python warnings go to the run log instead.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

from rich.console import Console
from rich.progress import (BarColumn, Progress, SpinnerColumn, TaskID, TaskProgressColumn, TextColumn,
                           TimeElapsedColumn)

console = Console(stderr=True, highlight=False)
console.soft_wrap = not console.is_terminal  # a log keeps each line whole (paths included) instead of folding it
class _Stdout(Console):
    def on_broken_pipe(self) -> None:
        """stdout's reader went away: rich points stdout at /dev/null; end as a command killed by SIGPIPE would."""
        try:
            super().on_broken_pipe()
        except SystemExit:
            raise SystemExit(141) from None


out = _Stdout(highlight=False)  # stdout, looked up at each write (a test's capture, a pipe)
out.soft_wrap = not out.is_terminal


def results(as_json: bool = False) -> Console:
    """Where a command's human-readable result goes: stdout, or stderr when stdout carries ``--json``."""
    return console if as_json else out

# Read by tqdm (>= 4.66, TQDM_* environment overrides) and huggingface_hub at import time, and inherited by child
# processes (the Triton python models, the TRT-LLM child): set them before either library is imported.
PROGRESS_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}

_stage: tuple[Progress, TaskID, str] | None = None  # the display of the stage that is running, in a terminal


def quiet_third_party_progress() -> None:
    """Switch off the libraries' own progress bars (set before they are imported; a user's explicit value stays)."""
    for key, value in PROGRESS_ENV.items():
        os.environ.setdefault(key, value)


def route_library_logs() -> None:
    """transformers and huggingface_hub: no bars, and their log records (deprecations, load reports) propagate to the
    root logger, whose only handler is the run log, instead of their own stderr handlers."""
    with contextlib.suppress(ImportError):
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as tlog

        tlog.disable_progress_bar()
        tlog.disable_default_handler()
        tlog.enable_propagation()


def _live() -> dict:
    # stdout stays where the caller put it (while a stage runs: the run log) instead of being drawn above the display
    return {"console": console, "transient": True, "redirect_stdout": False}


def _columns(bar: bool) -> list:
    cols = [SpinnerColumn(), TextColumn("{task.description}")]
    if bar:
        cols += [BarColumn(), TaskProgressColumn(text_format="{task.completed:.0f}/{task.total:.0f}")]
    return [*cols, TimeElapsedColumn()]


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """The one live display of a running stage (a terminal only); ``status``/``progress`` inside it update it."""
    global _stage
    if not console.is_terminal or _stage is not None:
        yield
        return
    with Progress(*_columns(True), **_live()) as prog:
        _stage = (prog, prog.add_task(name, total=None), name)
        try:
            yield
        finally:
            _stage = None


@contextlib.contextmanager
def status(text: str) -> Iterator[None]:
    """A step whose length is unknown (download, conversion, server start): the stage's spinner names it."""
    if _stage is not None:
        prog, task, name = _stage
        prog.update(task, description=f"{name}: {text}")
        try:
            yield
        finally:
            prog.update(task, description=name)
        return
    if console.is_terminal:
        with Progress(*_columns(False), **_live()) as prog:
            prog.add_task(text, total=None)
            yield
        return
    yield
    print(f"  {text}: done", file=sys.stderr)


class _Bar:
    def __init__(self, prog: Progress | None, task: TaskID | None):
        self._prog, self._task = prog, task

    def advance(self, n: int = 1) -> None:
        if self._prog is not None and self._task is not None:
            self._prog.advance(self._task, n)


@contextlib.contextmanager
def progress(text: str, total: int) -> Iterator[_Bar]:
    """A bar over ``total`` units (a row of the stage's display); call ``advance()`` on the yielded object."""
    if _stage is not None:
        prog = _stage[0]
        task = prog.add_task(text, total=total)
        try:
            yield _Bar(prog, task)
        finally:
            prog.remove_task(task)
        return
    if console.is_terminal:
        with Progress(*_columns(True), **_live()) as prog:
            yield _Bar(prog, prog.add_task(text, total=total))
        return
    yield _Bar(None, None)
    print(f"  {text}: {total} done", file=sys.stderr)
