"""Typed stage results: what each stage's ``run`` returns and its manifest holds under ``result``.

A result's JSON dump (``model_dump(mode="json")``) holds exactly the keys the stage gave, in field order: a field
left out (e.g. the keys of another model source) stays out of the manifest, and reads as its default (None).
:func:`load` turns a manifest's ``result`` back into the stage's model.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer

Number = Union[int, float]  # kept as given: an int stays an int in the JSON


class StageResult(BaseModel):
    """A result whose dump holds the fields that were given, no defaults added."""

    model_config = ConfigDict(extra="forbid")

    @model_serializer(mode="wrap")
    def _given_fields(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        return {k: v for k, v in data.items() if k in self.model_fields_set}


# --------------------------------------------------------------------------------------------------------- fetch
class FetchResult(StageResult):
    """Where the checkpoint came from (the keys of its ``kind``) and what it is."""

    kind: Literal["hf", "local", "gguf", "synthetic"]
    repo: Optional[str] = None  # hf
    revision: Optional[str] = None  # hf: as asked
    resolved_sha: Optional[str] = None  # hf: the commit downloaded
    path: Optional[str] = None  # local
    gguf: Optional[str] = None  # gguf: the file read
    gguf_sha256: Optional[str] = None
    package: Optional[str] = None  # gguf shipped in a package: its distribution and version
    package_version: Optional[str] = None
    seed: Optional[int] = None  # synthetic
    params: Optional[int] = None  # gguf, synthetic
    generated_on: Optional[str] = None  # synthetic: cpu | cuda
    architectures: Optional[list[str]] = None
    model_type: Optional[str] = None


# ------------------------------------------------------------------------------------------------------ quantize
class Calibration(StageResult):
    dataset: str
    sha256: str
    rows: int
    requested_rows: int
    short: bool
    seq_len: int
    tokens: int
    tokens_per_s: Number
    basis: Optional[str] = None  # where the size comes from: ModelOpt's recipe, the model's config, quant.calib
    short_reasons: Optional[list[str]] = None  # why it is short of ModelOpt's recipe (or of the rows asked for)
    recipe: Optional[dict[str, Any]] = None  # ModelOpt hf_ptq.py's dataset, rows and tokens, and where they come from


class Accuracy(StageResult):
    """The accuracy gate and the export proof (``accuracy.json``); the comparisons stay as ``pipeline.quality``
    writes them."""

    gate_measures: str
    quantized_vs_unquantized: dict[str, Any]
    fake_quant_vs_unquantized: dict[str, Any]
    exported_vs_fake_quant: dict[str, Any]
    unquantized_vs_fake_quant: dict[str, Any]
    export_proof: dict[str, Any]
    export_check: Literal["pass", "fail"]
    thresholds: dict[str, Any]
    gate: Literal["pass", "warn", "fail"]
    breaches: list[str]


class RecipeRecord(StageResult):
    """``quant.recipe``: the ModelOpt recipe the quantize stage calibrated with, and what plan derived its export
    carries (``pipeline.quant.recipes``: ModelOpt's ``get_quant_config`` on a stand-in of the model's architecture)
    with the formats it maps to. The quantize result and ``bundle.json``'s ``quant.recipe`` hold it."""

    name: str = Field(description="general/ptq/<name>: the recipe ModelOpt's load_recipe loaded")
    description: str = Field(description="the recipe's own description")
    algorithm: str = Field(description="its calibration method: max, mse, gptq, nvfp4_act_headroom, none")
    probe: str = Field(description="the model_type of the stand-in the export was derived on")
    quant_algo: Optional[str] = Field(description="the derived export's weight quant_algo")
    kv_cache_quant_algo: Optional[str] = Field(description="the derived export's kv_cache_quant_algo")
    group_size: Optional[int] = Field(description="the derived export's block size")
    exclude_modules: list[str] = Field(description="the derived export's exclude_modules (on the stand-in)")
    kv_constant_amax: bool = Field(description="the KV quantizers use a constant amax (no k_scale/v_scale exported)")
    format: str = Field(description="the format module the export maps to (quant=...)")
    kv_cache: str = Field(description="the KV format it maps to (quant.kv_cache=...)")
    partial: list[str] = Field(description="layers it leaves unquantized beyond the format's own preset (layers.* "
                                           "stands for every decoder layer)")


class QuantizeResult(StageResult):
    format: str
    kv_cache: str
    recipe: Optional[RecipeRecord] = None  # quant.recipe: the ModelOpt recipe that ran (None: the format's preset)
    quant_algo: Optional[str] = None
    kv_cache_quant_algo: Optional[str] = None
    note: Optional[str] = None  # unquantized: why there is nothing else
    group_size: Optional[int] = None
    exclude_modules: Optional[list[str]] = None
    block_size: Optional[int] = None
    modelopt_version: Optional[str] = None
    device: Optional[str] = None
    cpu_nvfp4_fallback_quantizers: Optional[int] = None
    fp8_layers_rounded_as_exported: Optional[int] = None
    batch_size: Optional[int] = None
    bytes_per_param: Optional[Number] = None
    notes: Optional[list[str]] = None
    calibration: Optional[Calibration] = None
    heldout: Optional[dict[str, Any]] = None
    accuracy: Optional[Accuracy] = None
    timings_s: Optional[dict[str, Number]] = None


# --------------------------------------------------------------------------------------------------------- build
class BuildRecord(StageResult):
    """What the build made and its load-and-generate check (``build.json`` holds the full record)."""

    engine_dir: str
    check: dict[str, Any]
    versions: Optional[dict[str, Optional[str]]] = None  # the runtime's library versions
    capacity: Optional[dict[str, Any]] = None  # the resolved capacity plan's summary the build used


# ------------------------------------------------------------------------------------------------------- package
class PackageResult(StageResult):
    layout: str
    entry_points: list[str]
    models: list[str]
    engine_dir: str
    runtime: str
    trtllm_line: Optional[str]
    max_batch_size: int
    decoupled: bool


# --------------------------------------------------------------------------------------------------------- bench
class BenchNoise(StageResult):
    """How much a level's headline figures move by chance (``pipeline.stages.bench.noise``): each figure's bootstrap
    interval ``[low, high]`` over the level's requests, ``None`` with fewer than two."""

    method: str
    confidence: Number
    resamples: int
    seed: int
    requests: int
    ttft_p50_ms: Optional[list[Number]]
    latency_p95_ms: Optional[list[Number]]
    output_tokens_per_s: Optional[list[Number]]


class BenchRow(StageResult):
    """One measured concurrency level of a workload (ms; tokens and requests per second); ``noise``: its figures'
    intervals (absent from bundles benched before it was recorded)."""

    concurrency: int
    request_count: int
    error_count: int
    ttft_p50_ms: Optional[Number]
    ttft_p95_ms: Optional[Number]
    itl_p50_ms: Optional[Number]
    itl_p95_ms: Optional[Number]
    latency_p95_ms: Optional[Number]
    latency_p99_ms: Optional[Number]
    output_tokens_per_s: Number
    requests_per_s: Number
    noise: Optional[BenchNoise] = None


class Baseline(StageResult):
    """The regression baseline: ``found``, ``none``, ``unreachable``, ``corrupt`` or ``disabled``."""

    status: str
    source: Optional[str] = None
    version: Optional[str] = None
    detail: Optional[str] = None


class BenchVerdict(StageResult):
    """The bench gate's verdict: the bench stage's result (``bench.json`` ``gates`` without the per-check list), and
    what the bundle records of it (``bundle.json`` ``gates.bench_detail``)."""

    verdict: Literal["pass", "fail", "no-baseline", "incomplete"] = Field(
        description="fail: a limit or gated regression breached; no-baseline: the regression baseline could not be "
                    "read or shares no level with the run (nothing compared); incomplete: no level measured, or a "
                    "gated regression measure missing (see missing)")
    breaches: list[str] = Field(description="every absolute limit or gated regression breached")
    regressions: list[str] = Field(description="regressions against the previous published bundle, gated or not")
    missing: list[str] = Field(default_factory=list, description="measures that could not be compared")
    regressions_gated: bool = Field(description="whether the regressions fail the gate (CPU targets only report)")
    compared_with_previous_levels: int = Field(0, description="concurrency levels compared with the baseline")
    baseline: Optional[Baseline] = Field(None, description="the bundle the regressions were measured against")


class BenchResult(StageResult):
    model: str  # the entry point the load went through
    layout: str
    workloads: dict[str, list[BenchRow]]
    answers_passed: int
    answers: int
    gates: BenchVerdict


# ---------------------------------------------------------------------------------------------------------- eval
class EvalResult(StageResult):
    """Task evaluation (``eval.json``): the baseline's scores (eval_baseline), or the paired gate per task
    (evaluate): baseline and quantized scores, the difference and its interval, items, verdict."""

    verdict: Literal["pass", "fail", "inconclusive", "n/a"]
    note: Optional[str] = None  # why nothing was evaluated
    strict: Optional[bool] = None
    lm_eval: Optional[str] = None  # lm-eval's version
    wall_s: Optional[Number] = None
    baseline_wall_s: Optional[Number] = None
    endpoint: Optional[str] = None  # the OpenAI base URL evaluated
    baseline: Optional[str] = None  # the eval_baseline output compared with
    task_files: Optional[dict[str, str]] = None  # the project's task files: name -> sha256
    tasks: Optional[dict[str, dict[str, Any]]] = None  # evaluate: the gate of each task
    scores: Optional[dict[str, dict[str, Any]]] = None  # eval_baseline: each task's score


# ------------------------------------------------------------------------------------------------------- publish
class Gates(BaseModel):  # bundle.json's gates (its schema, docs/bundle.schema.json, is generated from this)
    model_config = ConfigDict(extra="forbid")
    accuracy: str = Field(description="pass | warn | fail | missing | n/a (n/a: an unquantized bundle only)")
    export_check: str = Field(description="pass | fail | missing | n/a (n/a: an unquantized bundle only)")
    bench: Literal["pass", "fail", "no-baseline", "incomplete"] = Field(
        description="the bench stage's verdict; no-baseline: the regression baseline could not be read or shares no "
                    "level with the run; incomplete: a measure is missing")
    bench_detail: BenchVerdict
    eval: Literal["pass", "fail", "inconclusive", "n/a"] = Field(
        "n/a", description="the task gate (evaluate): inconclusive fails only under eval.strict; n/a: no tasks")


class PublishResult(StageResult):
    signed: bool
    files: int
    bytes: int
    version: str
    gates: Gates


RESULTS: dict[str, type[StageResult]] = {
    "fetch": FetchResult, "quantize": QuantizeResult, "build": BuildRecord, "package": PackageResult,
    "bench": BenchResult, "eval_baseline": EvalResult, "evaluate": EvalResult, "publish": PublishResult,
}


def load(stage: str, result: dict[str, Any]) -> StageResult:
    """The typed result of ``stage`` from its manifest's ``result``."""
    return RESULTS[stage].model_validate(result)


def read(stage: str, result: Any) -> StageResult:
    """:func:`load` for a stage that consumes ``stage``'s output: a result this version cannot read is one
    :class:`~pipeline.errors.StageFailed` line saying to re-run that stage."""
    from pydantic import ValidationError

    from pipeline.errors import StageFailed

    try:
        return load(stage, result if isinstance(result, dict) else {})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "result"
        raise StageFailed(f"the {stage} stage's recorded result is unreadable ({where}: {first.get('msg')}); "
                          f"re-run {stage} (force=[{stage}])") from None
