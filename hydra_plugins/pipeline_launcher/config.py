"""Registers ``hydra/launcher=pipeline_slurm`` in Hydra's ConfigStore."""
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf


@dataclass
class PipelineSlurmConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.pipeline_launcher.launcher.PipelineSlurmLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="pipeline_slurm", node=PipelineSlurmConf,
                             provider="llm-pipeline")
