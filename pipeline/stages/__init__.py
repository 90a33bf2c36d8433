"""The stage registry, in execution order. Each stage is one module with one ``STAGE`` record (runner.Stage).

    fetch ──► quantize ──► build ──► package ──► bench ──► evaluate ──► publish
      └─────────────────────────────► eval_baseline ──┘  (the unquantized model: shared by every format and target)
"""
from pipeline.catalog import STAGE_NAMES
from pipeline.stages import bench, build, evaluate, fetch, package, publish, quantize

STAGES = (fetch.STAGE, quantize.STAGE, build.STAGE, package.STAGE, bench.STAGE, evaluate.BASELINE, evaluate.STAGE,
          publish.STAGE)
if tuple(s.name for s in STAGES) != STAGE_NAMES:  # the catalog names them for the floors below (until=, force=)
    raise RuntimeError(f"the stage registry {[s.name for s in STAGES]} and pipeline.catalog.STAGE_NAMES disagree")
