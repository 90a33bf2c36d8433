"""The console: one live display per stage in a terminal, one line per step elsewhere, third-party bars switched off
and library log records routed to the run log."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from rich.console import Console

from pipeline import ui
from tests.helpers.console import console_problems

TQDM_LOOP = "from tqdm.auto import tqdm\nfor _ in tqdm(range(3), desc='Converting and de-quantizing GGUF tensors...'): pass\n"


@pytest.fixture
def terminal(monkeypatch) -> io.StringIO:
    buf = io.StringIO()
    monkeypatch.setattr(ui, "console", Console(file=buf, force_terminal=True, width=100, highlight=False))
    return buf


@pytest.fixture
def pipe(monkeypatch) -> io.StringIO:
    buf = io.StringIO()
    monkeypatch.setattr(ui, "console", Console(file=buf, force_terminal=False, width=100, highlight=False))
    return buf


@pytest.fixture
def displays(monkeypatch) -> list:
    """Every live display ``pipeline.ui`` starts, in order."""
    started: list = []

    class Counted(ui.Progress):
        def start(self) -> None:
            started.append(self)
            super().start()

    monkeypatch.setattr(ui, "Progress", Counted)
    return started


def _quantize_steps() -> None:
    with ui.status("loading tiny-qwen3"):
        with ui.progress("calibrating fp8", 3) as bar:
            for _ in range(3):
                bar.advance()
    with ui.progress("held-out logits", 2) as bar:
        bar.advance(2)


def test_a_stage_in_a_terminal_is_one_display_with_its_steps_inside(terminal, displays):
    with ui.stage("quantize"):
        _quantize_steps()
    assert len(displays) == 1
    assert "quantize" in terminal.getvalue()
    assert ui._stage is None  # the display is closed with the stage


def test_steps_outside_a_stage_are_one_display_each(terminal, displays):
    """The control of the test above: the same steps without the stage's display start one display each."""
    _quantize_steps()
    assert len(displays) == 3


def test_non_interactive_steps_print_one_line_each_and_no_frames(pipe, capsys):
    with ui.stage("fetch"):
        with ui.status("converting model.gguf to bfloat16 safetensors"):
            pass
        with ui.progress("bench chat: concurrency 4", 8) as bar:
            bar.advance(8)
    err = capsys.readouterr().err
    assert err.splitlines() == ["  converting model.gguf to bfloat16 safetensors: done",
                                "  bench chat: concurrency 4: 8 done"]
    assert console_problems(err + pipe.getvalue()) == []


def _python(code: str) -> subprocess.CompletedProcess:
    """``python -c code`` without the switches in its environment; output as written (carriage returns kept)."""
    env = {k: v for k, v in os.environ.items() if k not in ui.PROGRESS_ENV}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=60)
    proc.stderr = proc.stderr.decode()
    return proc


def test_third_party_tqdm_bars_are_switched_off():
    """The switch set before tqdm is imported silences a library's bar (transformers' GGUF conversion uses
    ``tqdm.auto`` directly); without it, the same loop draws carriage-return frames (the control)."""
    quiet = _python("from pipeline.ui import quiet_third_party_progress\nquiet_third_party_progress()\n" + TQDM_LOOP)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    loud = _python(TQDM_LOOP)
    assert loud.returncode == 0 and "\r" in loud.stderr
    assert any("carriage-return" in p for p in console_problems(loud.stderr))


ROUTING = """
import logging, sys
from transformers.utils import logging as tlog
from pipeline import ui
handler = logging.FileHandler(sys.argv[1])
logging.getLogger().handlers[:] = [handler]
deprecation = "`torch_dtype` is deprecated! Use `dtype` instead!"
tlog.get_logger("transformers.modeling_utils").warning(deprecation)  # before: transformers' own stderr handler
handler.flush()
before = open(sys.argv[1]).read().count(deprecation)
ui.route_library_logs()
tlog.get_logger("transformers.modeling_utils").warning(deprecation)
handler.flush()
print(before, open(sys.argv[1]).read().count(deprecation))
"""


def test_transformers_records_go_to_the_run_log_not_stderr(tmp_path):
    """After ``route_library_logs`` a transformers warning reaches the root logger (the run log) instead of
    transformers' own stderr handler; before it, the record never reaches the run log and goes to stderr (the
    control). In a process of its own: logging's state is process-wide, and a test run leaves it as its earlier
    tests did. Without ``CI``: with ``CI=1`` transformers' own default is to propagate (``_configure_library_root_logger``
    in ``transformers/utils/logging.py``), which would make the control pass for the wrong reason."""
    log = tmp_path / "run.log"
    env = {k: v for k, v in os.environ.items() if k not in ui.PROGRESS_ENV and k != "CI"}
    proc = subprocess.run([sys.executable, "-c", ROUTING, str(log)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["0", "1"], proc.stdout  # not in the run log before, once after
    assert proc.stderr.count("`torch_dtype` is deprecated!") == 1, proc.stderr[-2000:]  # only the one before


def test_console_check_flags_planted_noise():
    """The check the end-to-end console tests rely on: clean output passes, each kind of noise is named."""
    clean = "build tiny-qwen3 · fp8 (KV fp8) · cpu · reference\n▶ fetch (no output yet)\n  ✓ fetch 3.1s\n"
    assert console_problems(clean) == []
    frames = "Loading weights:  10%|█         | 1/10 [00:00<00:01, 9.1it/s]\rLoading weights:  20%|██        | 2/10"
    assert console_problems(frames)[0] == "1 carriage-return progress frames"
    assert console_problems("`torch_dtype` is deprecated! Use `dtype` instead!\n")[0].startswith("a deprecation")
    assert console_problems("/x/y.py:12: FutureWarning: something\n")[0].startswith("a Python warning")
    assert console_problems("Writing model shards: 100%|██████████| 1/1 [00:00<00:00]\n")[0].startswith("a tqdm")
    assert console_problems("line one\r\nline two\r\n") == []  # CRLF line ends are not frames
