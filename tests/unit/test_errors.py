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


# ------------------------------------------------------------------------------------- the CLI's one error path
def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    from pipeline.cli import main

    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.mark.parametrize("verb,target,argv", [
    ("verify", "verify", ("verify", "BUNDLE")),
    ("diff", "diff", ("diff", "OLD", "NEW")),
])
def test_an_unexpected_error_in_any_verb_is_one_line_with_the_traceback_in_the_run_log(
        tmp_path, monkeypatch, capsys, no_log, verb, target, argv):
    from pipeline import bundle

    monkeypatch.setenv("TMPDIR", str(tmp_path))

    def planted(*a, **k):
        raise KeyError("planted [internal] error")

    monkeypatch.setattr(bundle, target, planted)
    code, out, err = _cli(capsys, *argv)
    logs = list(tmp_path.glob("*.log"))
    assert code == 1 and len(logs) == 1
    assert err.strip().splitlines() == [f"failed: KeyError: 'planted [internal] error' (traceback in {logs[0]})"]
    assert "Traceback" not in err and "Traceback (most recent call last)" in logs[0].read_text()
    assert "raise KeyError" in logs[0].read_text()


def test_known_errors_keep_their_line_and_exit_code(tmp_path, monkeypatch, capsys, no_log):
    from pipeline import bundle

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(bundle, "diff", lambda *a: (_ for _ in ()).throw(errors.UserError("no bundle at OLD")))
    assert _cli(capsys, "diff", "OLD", "NEW")[::2] == (2, "error: no bundle at OLD\n")

    def full(*a, **k):
        raise OSError(28, "No space left on device", "/out/bundle.json")

    monkeypatch.setattr(bundle, "verify", full)
    code, _, err = _cli(capsys, "verify", "B")
    assert code == 1 and err.startswith("failed: no space left on the device writing /out/bundle.json")
    assert not list(tmp_path.glob("*.log"))  # a known error writes no traceback


def test_server_error_is_in_the_hierarchy():
    from pipeline.triton import server

    assert server.ServerError is errors.ServerError and issubclass(errors.ServerError, errors.StageFailed)
    assert errors.known(errors.ServerError("died")).exit_code == 1
    wrapped = RuntimeError("safetensors: No space left on device (os error 28)")
    assert errors.disk_full(wrapped) == 28 and errors.disk_full(ValueError("x")) is None


def test_the_run_log_gets_the_records_of_loggers_an_earlier_dict_config_disabled(tmp_path):
    """Hydra configures logging for a multirun job with ``logging.config.dictConfig``, which disables every logger
    that exists then; the run log set up afterwards still gets their records. Negative control: a logger disabled
    after the set-up writes nothing."""
    import logging
    import logging.config

    from pipeline import errors

    early = logging.getLogger("pipeline.test_early_logger")
    logging.config.dictConfig({"version": 1})  # disable_existing_loggers defaults to true
    assert early.disabled
    log = tmp_path / "run.log"
    errors.setup_logging(log)
    early.info("reached the run log")
    late = logging.getLogger("pipeline.test_late_logger")
    late.disabled = True
    late.info("never written")
    for h in logging.getLogger().handlers:
        h.flush()
    text = log.read_text()
    assert "reached the run log" in text and "never written" not in text
