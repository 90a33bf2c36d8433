"""SIGTERM and SIGINT are never lost in a finalizer (pipeline.interrupts). The signal is sent from inside a
``__del__`` and the handler is made to run there, as it did when a build was sent SIGTERM while ``regex`` freed a
pattern: Python printed "Exception ignored in ..." and the build ran to the end, exit 0."""
from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = """
import os, signal, sys, time
from pipeline import interrupts

class FreedMidRun:
    def __del__(self):
        os.kill(os.getpid(), signal.{sig})
        for _ in range(100_000):  # the handler runs at one of these bytecodes, inside the finalizer
            pass

context = interrupts.sigterm_as_interrupt() if sys.argv[1] == "hooked" else interrupts.contextlib.nullcontext()
if sys.argv[1] != "hooked":
    signal.signal(signal.SIGTERM, interrupts._terminated)
with context:
    try:
        FreedMidRun()
        t0 = time.monotonic()  # hooked: the interrupt ends this wait; bare: nothing will, 0.3 s shows it ran on
        while time.monotonic() - t0 < (10.0 if sys.argv[1] == "hooked" else 0.3):
            time.sleep(0.01)
        print("ran on")
    except interrupts.Terminated:
        print("Terminated")
    except KeyboardInterrupt:
        print("KeyboardInterrupt")
"""


def _child(sig: str, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD.format(sig=sig), mode], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("sig,raised", [("SIGTERM", "Terminated"), ("SIGINT", "KeyboardInterrupt")])
def test_an_interrupt_raised_in_a_finalizer_is_raised_again_after_it(sig, raised):
    proc = _child(sig, "hooked")
    assert proc.stdout.strip() == raised, proc.stdout + proc.stderr
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_without_the_hook_the_interrupt_is_lost():
    """Negative control: the same child with only the handler (the CLI before the hook) runs on."""
    proc = _child("SIGTERM", "bare")
    assert proc.stdout.strip() == "ran on", proc.stdout + proc.stderr
    assert "Exception ignored in" in proc.stderr


def test_the_handler_and_the_hook_are_restored():
    import signal

    from pipeline import interrupts

    before = signal.getsignal(signal.SIGTERM), sys.unraisablehook
    with interrupts.sigterm_as_interrupt():
        assert signal.getsignal(signal.SIGTERM) is interrupts._terminated
        assert sys.unraisablehook is not before[1]
    assert (signal.getsignal(signal.SIGTERM), sys.unraisablehook) == before
