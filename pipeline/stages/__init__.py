"""The stage registry, in execution order. Each stage is one module with one ``STAGE`` record (runner.Stage).

    fetch ──► quantize ──► build ──► package ──► bench ──► evaluate ──► publish
      └─────────────────────────────► eval_baseline ──┘  (the unquantized model: shared by every format and target)
"""
from pipeline.stages import bench, build, evaluate, fetch, package, publish, quantize

STAGES = (fetch.STAGE, quantize.STAGE, build.STAGE, package.STAGE, bench.STAGE, evaluate.BASELINE, evaluate.STAGE,
          publish.STAGE)
STAGE_NAMES = tuple(s.name for s in STAGES)
