"""Registers ``hydra/launcher=pipeline_slurm`` and ``hydra/sweeper=pipeline`` in Hydra's ConfigStore."""
from dataclasses import dataclass, field
from typing import List

from hydra._internal.core_plugins.basic_sweeper import BasicSweeperConf
from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf


@dataclass
class PipelineSlurmConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.pipeline_launcher.launcher.PipelineSlurmLauncher"
    # while the counts of queued, running, done and failed jobs stay the same, a progress line at least this often
    heartbeat_s: int = 120


@dataclass
class PipelineSweeperConf(BasicSweeperConf):
    _target_: str = "hydra_plugins.pipeline_launcher.sweeper.PipelineSweeper"
    skip: List[int] = field(default_factory=list)  # positions, in the cartesian job order, of jobs to leave out


ConfigStore.instance().store(group="hydra/launcher", name="pipeline_slurm", node=PipelineSlurmConf,
                             provider="llm-pipeline")
ConfigStore.instance().store(group="hydra/sweeper", name="pipeline", node=PipelineSweeperConf,
                             provider="llm-pipeline")
