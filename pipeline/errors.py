"""One failure path for every verb: a :class:`PipelineError` (a :class:`UserError`, :class:`StageFailed`,
:class:`ServerError` or :class:`InternalError`) becomes one line on stderr and its ``exit_code``; a full disk becomes
one :class:`StageFailed` line naming the output (:func:`disk_full`); anything else becomes one :class:`InternalError`
line whose traceback goes to the run log (:func:`internal`). :func:`known` is that mapping; ``pipeline.cli.main``
applies it to every verb."""
from __future__ import annotations

import datetime as _dt
import errno
import logging
import os
import sys
import traceback
from pathlib import Path


class PipelineError(Exception):
    """Base of every error the pipeline reports as one line; ``exit_code`` is the process's exit status."""

    exit_code = 1
    prefix = "failed"  # how the CLI's line starts


class UserError(PipelineError):
    """A problem the user can fix (bad config, missing file, incompatible combination). Exit code 2."""

    prefix = "error"

    exit_code = 2

    def __init__(self, message: str, *, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or []


class StageFailed(PipelineError):
    """A stage ran and its check or gate failed (e.g. bench answers wrong). Exit code 1, report written."""

    exit_code = 1


class ServerError(StageFailed):
    """The Triton server failed to start or died; carries the log tail, and in ``reason`` the server's own one-line
    account of why (a model that failed to load), when its log has one. Exit code 1."""

    def __init__(self, message: str = "", reason: str | None = None, log_path=None):
        super().__init__(message)
        self.reason = reason
        self.log_path = log_path


class InternalError(PipelineError):
    """An unexpected error, named in one line; its traceback is in the run log. Exit code 1."""

    exit_code = 1


_DISK_FULL = {errno.ENOSPC: "no space left on the device", errno.EFBIG: "the file size limit was reached",
              errno.EDQUOT: "the disk quota is exhausted"}


def disk_full(exc: BaseException | None) -> int | None:
    """errno of a full disk / file-size limit / quota anywhere in the exception chain (libraries word it their own
    way: safetensors says "os error 28"), else None."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            return exc.errno
        text = str(exc)
        for code in _DISK_FULL:
            if f"os error {code})" in text or os.strerror(code) in text:
                return code
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def disk_full_error(code: int, filename: str | None) -> StageFailed:
    """The one line for a full disk while writing ``filename``."""
    return StageFailed(f"{_DISK_FULL[code]} writing {filename or 'an output'}; nothing was published (free space or "
                       f"move paths.root)")


def known(exc: BaseException) -> PipelineError:
    """``exc`` as the error the user is shown: a :class:`PipelineError` as it is, a full disk as one
    :class:`StageFailed` line, anything else through :func:`internal` (traceback to the run log)."""
    if isinstance(exc, PipelineError):
        return exc
    formats = sys.modules.get("pipeline.formats._base")  # self-contained: its error is no PipelineError
    if formats is not None and isinstance(exc, formats.FormatError):
        return UserError(str(exc))  # a format module that stops the registry, named with the fix
    code = disk_full(exc)
    if code:
        return disk_full_error(code, getattr(exc, "filename", None))
    return internal(exc)


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
    # a logging.config.dictConfig earlier in this process (Hydra configures logging for a multirun job) disables
    # every logger that existed then: their records would never reach the run log
    for logger in logging.root.manager.loggerDict.values():
        if isinstance(logger, logging.Logger):
            logger.disabled = False


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
