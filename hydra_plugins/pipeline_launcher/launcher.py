"""The launcher class (see the package docstring)."""
from __future__ import annotations

from typing import Any, Sequence

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher


def job_resources(overrides: Sequence[str]) -> dict[str, Any]:
    """Slurm partition, constraint and GPU count for one job, from its composed config."""
    from pipeline import planning
    from pipeline.config import compose

    cfg = compose(list(overrides))
    t = cfg.target
    gpus = planning.effective_tp(cfg) * int(cfg.build.pp_size) if t.device.value == "cuda" else 0
    return {"partition": t.slurm.partition or None, "constraint": t.slurm.constraint or None,
            "gpus_per_node": gpus or None, "target": t.name}


class PipelineSlurmLauncher(SlurmLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
        groups: dict[tuple, list[int]] = {}
        res = [job_resources(o) for o in job_overrides]
        for i, r in enumerate(res):
            groups.setdefault((r["partition"], r["constraint"], r["gpus_per_node"]), []).append(i)
        results: list[Any] = [None] * len(job_overrides)
        base = dict(self.params)
        offset = initial_job_idx
        try:
            for (partition, constraint, gpus), idxs in groups.items():
                self.params = {**base, **{k: v for k, v in (("partition", partition), ("constraint", constraint),
                                                            ("gpus_per_node", gpus)) if v is not None}}
                for i, r in zip(idxs, super().launch([job_overrides[i] for i in idxs], offset)):
                    results[i] = r
                offset += len(idxs)
        finally:
            self.params = base
        return results
