"""The stage registry, in execution order. Each stage is one module with one ``STAGE`` record (runner.Stage).

    fetch ──► quantize ──► build ──► package ──► bench ──► publish
"""
from pipeline.stages import bench, build, fetch, package, publish, quantize

STAGES = (fetch.STAGE, quantize.STAGE, build.STAGE, package.STAGE, bench.STAGE, publish.STAGE)
STAGE_NAMES = tuple(s.name for s in STAGES)
