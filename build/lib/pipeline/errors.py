"""One failure path: a :class:`UserError` becomes one actionable line on stderr and exit code 2."""
from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix (bad config, missing file, incompatible combination). Exit code 2."""

    exit_code = 2

    def __init__(self, message: str, *, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or []


class StageFailed(Exception):
    """A stage ran and its check or gate failed (e.g. bench answers wrong). Exit code 1, report written."""

    exit_code = 1
