"""Debian's Prometheus (2.42, with ``promtool``) for the tests: installed with apt-get where missing (root only, as
``tools/slurm_cluster.py`` installs Slurm; the package's service is not started: a ``policy-rc.d`` that refuses is in
place during the install), started on loopback with a scrape config of the test's and a data directory of its own,
queried over its HTTP API (``/api/v1/query``) and stopped by its process id."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

PACKAGE = "prometheus"
POLICY = Path("/usr/sbin/policy-rc.d")  # invoke-rc.d asks it whether a package's service may start (101: no)


class Unavailable(RuntimeError):
    """Prometheus cannot be had here (not installed, and not root or no apt-get); the message says why."""


def ensure_installed() -> tuple[str, str]:
    """(prometheus, promtool), installed with ``apt-get install prometheus`` where missing."""
    found = shutil.which("prometheus"), shutil.which("promtool")
    if all(found):
        return found  # type: ignore[return-value]
    if os.geteuid() != 0:
        raise Unavailable(f"prometheus/promtool not installed, and installing them needs root (apt-get install "
                          f"{PACKAGE})")
    if shutil.which("apt-get") is None:
        raise Unavailable(f"prometheus/promtool not installed, and there is no apt-get to install {PACKAGE}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    planted = not POLICY.exists()
    if planted:  # the package must not start a Prometheus service of its own on :9090
        POLICY.write_text("#!/bin/sh\nexit 101\n")
        POLICY.chmod(0o755)
    try:
        for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends",
                                                  PACKAGE]):
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise Unavailable(f"{' '.join(cmd)} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    finally:
        if planted:
            POLICY.unlink()
    found = shutil.which("prometheus"), shutil.which("promtool")
    if not all(found):
        raise Unavailable(f"apt-get install {PACKAGE} ran, yet prometheus/promtool are not on PATH")
    return found  # type: ignore[return-value]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus server in ``root`` scraping ``targets`` (``HOST:PORT`` of a ``/metrics``) every
    ``interval_s``; a context manager (started on entry, stopped on exit)."""

    def __init__(self, binary: str, root: Path, targets: list[str], interval_s: float = 1.0, job: str = "serve"):
        self.binary, self.root, self.targets, self.interval_s, self.job = binary, root, targets, interval_s, job
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Prometheus":
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": f"{self.interval_s:g}s", "scrape_timeout": f"{self.interval_s:g}s"},
            "scrape_configs": [{"job_name": self.job, "metrics_path": "/metrics",
                                "static_configs": [{"targets": self.targets}]}]}))
        self.log = open(self.root / "prometheus.log", "wb")
        self.proc = subprocess.Popen([self.binary, f"--config.file={config}",
                                      f"--storage.tsdb.path={self.root / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise AssertionError(f"prometheus did not start: {(self.root / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query's result vector (``at``: evaluation time, Unix seconds; default now)."""
        params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}", timeout=10) as r:
            doc = json.loads(r.read())
        assert doc["status"] == "success", doc
        return doc["data"]["result"]

    def value(self, expr: str, at: float | None = None) -> float | None:
        """The value of a query that gives one series (None: it gives none)."""
        result = self.query(expr, at)
        assert len(result) <= 1, f"{expr}: {len(result)} series"
        return float(result[0]["value"][1]) if result else None

    def wait_scraped(self, after: float, timeout_s: float = 30.0) -> None:
        """Until every target was scraped successfully at or after ``after`` (Unix seconds)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10) as r:
                active = json.loads(r.read())["data"]["activeTargets"]
            if active and all(t["health"] == "up" and _unix(t["lastScrape"]) >= after for t in active):
                return
            time.sleep(self.interval_s / 4)
        raise AssertionError(f"prometheus did not scrape {self.targets} after {after}: {active}")


def _unix(stamp: str) -> float:
    """Prometheus' RFC 3339 time (up to nanoseconds, a zone) as Unix seconds."""
    import datetime as dt
    import re

    m = re.fullmatch(r"(.*?)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", stamp)
    assert m, stamp
    base = dt.datetime.fromisoformat(m.group(1) + ("+00:00" if m.group(3) == "Z" else m.group(3)))
    return base.timestamp() + (float(f"0.{m.group(2)}") if m.group(2) else 0.0)
