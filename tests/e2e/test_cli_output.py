"""Where the CLI's output goes: results on stdout (so ``plan > plan.txt`` keeps them), progress and errors on stderr,
and a stdout whose reader goes away (``| head``, a ``| tee`` stopped by Ctrl-C) ends the command quietly: no
traceback, no crash log in the temporary directory."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cli_env, run_cli

pytestmark = pytest.mark.e2e


def test_the_plan_goes_to_stdout_and_a_refusal_to_stderr(tmp_path):
    proc = run_cli("plan", "model=tiny-qwen3", root=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "plan: tiny-qwen3 fp8 (KV fp8) on cpu / reference" in proc.stdout and proc.stderr == ""
    bad = run_cli("plan", "model=tiny-qwen3", "quant=nvfp4", "target=h100", root=tmp_path)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.startswith("error: nvfp4 needs Blackwell")


def _closed_early(cmd: list[str], tmp: Path) -> tuple[int, str]:
    """Run ``cmd`` with stdout a pipe that is closed after its first line (what ``| head -1`` does) ->
    (exit status, stderr)."""
    import fcntl

    proc = subprocess.Popen(cmd, cwd=tmp, env=cli_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    fcntl.fcntl(proc.stdout.fileno(), fcntl.F_SETPIPE_SZ, 4096)  # the smallest pipe: the output cannot all fit
    proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err.decode()


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    # four plans (about 11 KB) do not fit in the pipe once the reader has gone
    cmd = [sys.executable, "-m", "pipeline", "plan", "-m", "target=h100,h200,b200,gb200", "model=qwen32b",
           f"paths.root={tmp_path}"]
    code, err = _closed_early(cmd, tmp_path)
    assert code == 141, err  # as a command killed by SIGPIPE
    assert "Traceback" not in err and "BrokenPipe" not in err and "failed" not in err, err
    assert not list(tmp_path.glob("*.log")), "a crash log was left in TMPDIR"


def test_the_check_sees_a_broken_pipe_where_python_reports_one(tmp_path):
    """Negative control: a plain Python program writing past a closed pipe fails loudly, as the CLI did before it
    handled the closed pipe, and the check above would see it."""
    code, err = _closed_early([sys.executable, "-c", "print('first'); print('x' * 1_000_000)"], tmp_path)
    assert code != 0 and "BrokenPipeError" in err


def test_a_python_without_the_projects_dependencies_gets_one_line(tmp_path):
    """``python -m pipeline`` from the checkout with a Python that is not the project's venv (the README's commands
    before ``source .venv/bin/activate``): one line naming the fix, exit 2, no traceback. Control: the venv's Python
    runs the same command."""
    repo = Path(__file__).resolve().parents[2]
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    proc = subprocess.run([str(bare / "bin" / "python"), "-m", "pipeline", "plan"], cwd=repo, capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "is not installed for" in line and "source .venv/bin/activate" in line
    ok = run_cli("plan", "model=tiny-qwen3", root=tmp_path / "root", cwd=repo)
    assert ok.returncode == 0, ok.stderr
