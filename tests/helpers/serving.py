"""``python -m pipeline serve TARGET ARGS`` in a child process, as a user starts it: the addresses it prints."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import cli_env


class Serve:
    """Started on construction; ready once it has printed its ``stop with`` line (else AssertionError with its
    output). ``http``, ``grpc`` and ``url`` (the OpenAI base URL) are the printed addresses; ``stop()`` sends SIGINT
    and returns the exit status (killing it after 60 s)."""

    def __init__(self, target: Path | str, *args: str, cwd: Path, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", str(target), *args], cwd=cwd,
                                     env=env or cli_env(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: list[str] = []
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("stop with"):
                break
        if not self.lines or not self.lines[-1].startswith("stop with"):
            self.proc.kill()
            raise AssertionError(f"pipeline serve did not start: {self.lines}\n{self.proc.stderr.read()[-3000:]}")
        self.url = self._address("OpenAI")
        self.http = self._address("HTTP")
        self.grpc = self._address("gRPC")

    def _address(self, label: str) -> str | None:
        return next((x.split()[1] for x in self.lines if x.startswith(label)), None)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def __enter__(self) -> "Serve":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
