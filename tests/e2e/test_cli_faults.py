"""The CLI's paper cuts that need a real process: `plan`'s account of `auto`, an unwritable `paths.root`, and
SIGTERM during a build (reported as SIGINT is)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import cli_env, run_cli


def test_plan_says_what_auto_resolved_to_also_as_the_default(tmp_path, capsys):
    from pipeline import cli

    for args in ([], ["target=auto", "runtime=auto"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(["plan", "model=tiny-qwen3", *args, f"paths.root={tmp_path}"])
            raise SystemExit(0)
        out = capsys.readouterr()
        assert exc.value.code in (0, None), out.err
        assert "target=auto -> cpu (NVML reports no NVIDIA GPU" in out.out, out.out
        assert "runtime=auto -> reference (a cpu target" in out.out, out.out
    with pytest.raises(SystemExit):  # negative control: a named target and runtime resolve nothing
        cli.main(["plan", "model=tiny-qwen3", "target=cpu", "runtime=reference", f"paths.root={tmp_path}"])
        raise SystemExit(0)
    assert "auto ->" not in capsys.readouterr().out


def test_an_unwritable_root_is_one_line_naming_paths_root_and_no_log_in_tmp(tmp_path):
    """/sys refuses every write, root included. The default model's GGUF digest used to be memoised under the root
    before the root was checked: PermissionError, exit 1, a traceback log in TMPDIR."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run([sys.executable, "-m", "pipeline", "build", "paths.root=/sys/pipeline-root"], cwd=tmp_path,
                          env=cli_env(tmp_path, TMPDIR=str(tmp)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: paths.root=/sys/pipeline-root: cannot write there (Permission denied); give a writable "
        "directory (paths.root=DIR)"]
    assert list(tmp.iterdir()) == []


def test_sigterm_on_build_is_reported_as_sigint_is(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "build", "model=tiny-qwen3", "quant.gate=warn",
                             f"paths.root={root}"], cwd=root, env=cli_env(root), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list(root.glob(".store/.*tmp*")) and time.monotonic() < deadline:  # a stage is running
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err[-2000:]
    assert err.strip().splitlines()[-1] == "interrupted (SIGTERM)", err[-2000:]
    assert "Traceback" not in err


def test_plan_parses_python_in_the_main_thread_only(tmp_path, monkeypatch, capsys):
    """CPython 3.11's ``ast.parse`` is not safe beside another thread's (python/cpython#106905): `plan` failed 1 run
    in 2 of the fast tier with "SystemError: AST constructor recursion depth mismatch" while a thread hashed the
    stages' code and the main thread parsed too. Every parse is now the main thread's (the thread failed this)."""
    import ast
    import threading

    from pipeline import cli
    from pipeline.runner import fingerprint

    threads: list[str] = []
    parse = ast.parse

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return parse(*args, **kwargs)

    monkeypatch.setattr(ast, "parse", spy)
    fingerprint._scan.cache_clear()  # parsed again, not read from an earlier test's cache
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", "model=tiny-qwen3", f"paths.root={tmp_path}"])
        raise SystemExit(0)
    assert exc.value.code in (0, None), capsys.readouterr().err
    assert threads, "plan parsed no code: the spy is not where the fingerprints parse"
    assert set(threads) == {threading.main_thread().name}, sorted(set(threads))
