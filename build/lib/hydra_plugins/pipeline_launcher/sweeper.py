"""The sweeper class (see the package docstring)."""
from __future__ import annotations

from typing import Any, Iterable, List, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.types import Override


class PipelineSweeper(BasicSweeper):
    def __init__(self, max_batch_size: Optional[int] = None, params: Any = None, skip: Iterable[int] = ()) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.skip = {int(i) for i in skip}

    def split_arguments(self, overrides: List[Override],  # type: ignore[override]
                        max_batch_size: Optional[int]) -> List[List[List[str]]]:
        """BasicSweeper's batches of the cartesian product, without the jobs at the positions in ``skip``."""
        jobs = [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]
        kept = [job for i, job in enumerate(jobs) if i not in self.skip]
        return list(BasicSweeper.split_overrides_to_chunks(kept, max_batch_size)) if kept else []
