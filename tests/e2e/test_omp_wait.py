"""``python -m pipeline`` makes torch's OpenMP threads sleep when they wait (``OMP_WAIT_POLICY=PASSIVE``, set by
``pipeline.cli`` before torch is imported), unless the user set a policy. Measured the way it matters: the CPU a
process burns while its torch worker threads have nothing to do. A planted ``ACTIVE`` (threads that spin) is the
negative control."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import json, os, resource, time
import pipeline.cli  # what `python -m pipeline` and the `pipeline` script import first
import torch
torch.set_num_threads(2)
x = torch.randn(256, 256)
for _ in range(50):
    x @ x  # parallel regions: the worker thread then waits for the next one
before = resource.getrusage(resource.RUSAGE_SELF)
time.sleep(1.0)
after = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"policy": os.environ.get("OMP_WAIT_POLICY"),
                  "idle_cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime}))
"""


def _probe(**env: str) -> dict:
    full = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    full.update(PYTHONPATH=str(REPO), **env)
    out = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_torch_threads_sleep_while_waiting_unless_the_user_says_otherwise():
    mine = _probe()
    assert mine["policy"] == "PASSIVE"
    assert mine["idle_cpu_s"] < 0.1, mine  # nothing spins while the process sleeps for 1 s
    spinning = _probe(OMP_WAIT_POLICY="ACTIVE")  # the user's value wins; and the control: it spins
    assert spinning["policy"] == "ACTIVE"
    # a spinning thread burns whatever share of a core it gets (on a shared 2-core machine, not all of it)
    assert spinning["idle_cpu_s"] > max(0.2, 3 * mine["idle_cpu_s"]), (spinning, mine)
