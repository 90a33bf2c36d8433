"""A Hydra callback for the Slurm tests: it holds a job inside its quantize stage until the test releases it.

    +hydra.callbacks.hold._target_=tests.helpers.slurm_hold.HoldQuantize +hydra.callbacks.hold.release=PATH
    [+hydra.callbacks.hold.quant=fp8]      # hold only the jobs of that quant format

Hydra runs a callback's ``on_job_start`` in the job, on the node, just before the job's body
(``hydra.core.utils.run_job``; the launcher pickles the callbacks with the job). There it makes the quantize stage,
once the stage has created its temp output and taken its lock, wait before it reads its calibration rows
(``pipeline.calib.rows_for``) until the file ``release`` exists. Each job it holds first writes
``RELEASE.held-<Slurm job>`` (``ARRAY_TASK``, as the sweep's summary names it). Then the stage runs unchanged.

What the tests check (the launcher's cancel, summary, hangup and waiting lines, the store's clean-up, Slurm's
scheduling) is not touched: the test only decides when the stage may go on, so that a job is still mid-stage when a
signal lands, however fast the jobs run. The sweep's processes import this module from the checkout
(``PYTHONPATH``), as the submitter instantiates the callback and the job unpickles it.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback


class HoldQuantize(Callback):
    def __init__(self, release: str, quant: str = "") -> None:
        self.release = Path(release)
        self.quant = quant

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        fmt = config.quant.format
        if self.quant and getattr(fmt, "value", fmt) != self.quant:
            return
        from pipeline import calib

        rows_for, release = calib.rows_for, self.release
        job = f"{os.environ.get('SLURM_ARRAY_JOB_ID')}_{os.environ.get('SLURM_ARRAY_TASK_ID')}"

        def held(*args: Any, **kw: Any) -> Any:
            release.with_name(f"{release.name}.held-{job}").touch()
            while not release.exists():  # Slurm's SIGTERM (scancel) interrupts the sleep
                time.sleep(0.2)
            return rows_for(*args, **kw)

        calib.rows_for = held
