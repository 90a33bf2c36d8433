"""The launcher class (see the package docstring)."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf

log = logging.getLogger(__name__)


def job_resources(overrides: Sequence[str]) -> dict[str, Any]:
    """Slurm partition, constraint and GPU count for one job, from its composed config."""
    from pipeline import planning
    from pipeline.config import compose

    cfg = compose(list(overrides))
    t = cfg.target
    gpus = planning.resolve(cfg).world if t.device.value == "cuda" else 0  # TP x PP
    return {"partition": t.slurm.partition or None, "constraint": t.slurm.constraint or None,
            "gpus_per_node": gpus or None, "target": t.name}


class PipelineSlurmLauncher(SlurmLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Submit one Slurm array per (partition, constraint, GPU count), every array before waiting on any. Job
        numbers (and so the jobs' sweep subdirectories) follow the sweep's order, whatever the grouping."""
        assert self.config is not None
        groups: dict[tuple, list[int]] = {}
        for i, overrides in enumerate(job_overrides):
            r = job_resources(overrides)
            groups.setdefault((r["partition"], r["constraint"], r["gpus_per_node"]), []).append(i)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        log.info(f"Submitit 'slurm' sweep output dir : {sweep_dir}")
        submitted: list[tuple[int, Any]] = []
        for (partition, constraint, gpus), idxs in groups.items():
            resources = {k: v for k, v in (("partition", partition), ("constraint", constraint),
                                           ("gpus_per_node", gpus)) if v is not None}
            executor = self._executor({**self.params, **resources})
            args = []
            for i in idxs:
                num = initial_job_idx + i
                log.info(f"\t#{num} : {' '.join(filter_overrides(job_overrides[i]))} ({resources})")
                args.append((list(job_overrides[i]), "hydra.sweep.dir", num, f"job_id_for_{num}",
                             Singleton.get_state()))
            submitted += zip(idxs, executor.map_array(self, *zip(*args)))
        results: list[Any] = [None] * len(job_overrides)
        for i, job in submitted:
            results[i] = job.results()[0]
        return results

    def _executor(self, params: dict[str, Any]) -> Any:
        """A submitit executor with ``params`` (this launcher's, with one group's resources), set up the way
        submitit's own launcher sets up its executor."""
        import submitit

        init_keys = {"submitit_folder", "max_num_timeout"}
        init = {f"{self._EXECUTOR}_max_num_timeout": params["max_num_timeout"]} if "max_num_timeout" in params else {}
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=params["submitit_folder"], **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in params.items()
                                      if k not in init_keys})
        return executor
