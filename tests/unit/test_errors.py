"""The failure path: an unexpected error becomes one line, its traceback goes to the run log."""
from __future__ import annotations

import logging
import os

import pytest

from pipeline import errors


@pytest.fixture
def no_log():
    """No run log open (pytest's own file handler set aside); the root logger's handlers are put back afterwards."""
    saved = logging.getLogger().handlers[:]
    logging.getLogger().handlers[:] = []
    yield
    logging.getLogger().handlers[:] = saved


def _raised() -> ValueError:
    try:
        raise ValueError("bad shape (3, 4)")
    except ValueError as exc:
        return exc


def test_internal_writes_the_traceback_to_the_open_run_log(tmp_path, no_log):
    path = errors.log_path(tmp_path / "logs")
    assert path.parent == tmp_path / "logs" and path.name.endswith(f"-{os.getpid()}.log")
    errors.setup_logging(path)
    logging.getLogger("pipeline").info("resolved config")
    assert errors.current_log() == path
    err = errors.internal(_raised())
    assert isinstance(err, errors.InternalError) and err.exit_code == 1
    assert str(err) == f"ValueError: bad shape (3, 4) (traceback in {path})"
    text = path.read_text()
    assert "INFO pipeline: resolved config" in text
    assert "Traceback (most recent call last)" in text and 'raise ValueError("bad shape (3, 4)")' in text


def test_internal_without_a_run_log_opens_one_in_tmpdir(tmp_path, monkeypatch, no_log):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert errors.current_log() is None
    err = errors.internal(_raised())
    logs = list(tmp_path.glob("*.log"))
    assert len(logs) == 1 and str(err).endswith(f"(traceback in {logs[0]})")
    assert "ValueError: bad shape (3, 4)" in logs[0].read_text()


def test_user_error_keeps_every_problem():
    err = errors.UserError("a; b", problems=["a", "b"])
    assert (str(err), err.problems, err.exit_code) == ("a; b", ["a", "b"], 2)
    assert errors.UserError("one").problems == [] and errors.StageFailed.exit_code == 1
