"""One failure path: a :class:`UserError` becomes one actionable line on stderr and exit code 2; anything unexpected
becomes one :class:`InternalError` line whose traceback goes to the run log."""
from __future__ import annotations

import datetime as _dt
import logging
import os
import traceback
from pathlib import Path


class UserError(Exception):
    """A problem the user can fix (bad config, missing file, incompatible combination). Exit code 2."""

    exit_code = 2

    def __init__(self, message: str, *, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or []


class StageFailed(Exception):
    """A stage ran and its check or gate failed (e.g. bench answers wrong). Exit code 1, report written."""

    exit_code = 1


class InternalError(Exception):
    """An unexpected error, named in one line; its traceback is in the run log. Exit code 1."""

    exit_code = 1


def log_path(log_dir: Path | None = None) -> Path:
    """A new run log in ``log_dir`` (``$TMPDIR`` or ``/tmp`` without one), named by the time and the process id."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = log_dir if log_dir is not None else Path(os.environ.get("TMPDIR", "/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    return base / f"{stamp}-{os.getpid()}.log"


def setup_logging(path: Path) -> None:
    """The run log becomes the root logger's only handler."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def current_log() -> Path | None:
    """The run log the root logger writes to, if any."""
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler):
            return Path(h.baseFilename)
    return None


def internal(exc: BaseException) -> InternalError:
    """The traceback of ``exc`` appended to the run log (a new one if none is open); one line naming it returned."""
    path = current_log() or log_path()
    with open(path, "a") as f:
        traceback.print_exception(exc, file=f)
    return InternalError(f"{type(exc).__name__}: {exc} (traceback in {path})")
