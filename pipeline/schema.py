"""Typed schemas for every config group, registered in Hydra's ConfigStore.

Each group under ``conf/`` merges into one of these dataclasses, so a misspelt key or a value of the wrong type fails
at compose time. Numeric ranges live in field metadata (``rng(lo, hi)``) and are checked by
:func:`pipeline.config.validate`, which reports every problem at once.

The quant formats come from their modules (``pipeline/formats/``): the ``QuantFormat`` and ``KVFormat`` enums list
the registry's formats, and a format's numbers are the defaults of the fields that hold them (``quant.thresholds``,
``quant.eval.export_*``: ``format_default``, read through the OmegaConf resolver ``pipeline.format`` registered here;
``eval.max_drop``), so the composed config, manifests and fingerprints show the values and an override still wins.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from pipeline import catalog, formats


def rng(default: Any, lo: float | None = None, hi: float | None = None, **kw: Any) -> Any:
    """A dataclass field with an inclusive numeric range checked by ``pipeline.config.validate``."""
    return field(default=default, metadata={"min": lo, "max": hi, **kw})


class DType(str, Enum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


# quant.format / quant.kv_cache values: one member per format module (pipeline/formats/<name>.py), registry order
QuantFormat = Enum("QuantFormat", [(n, n) for n in formats.FORMATS], type=str, module=__name__)
KVFormat = Enum("KVFormat", [(n, n) for n in formats.KV_FORMATS], type=str, module=__name__)
# ModelOpt 0.47's KV presets (modelopt.recipe.presets.KV_QUANT_CFG_CHOICES) that no TensorRT-LLM release serves as
# calibrated, so they are no quant.kv_cache value; the config's error for one says why.
UNSERVED_KV_PRESETS = {
    "fp8_affine": "ModelOpt exports its per-channel shift as k_proj.k_bias / v_proj.v_bias beside kv_cache_quant_algo "
                  "FP8 (modelopt/torch/export/quant_utils.py _KV_CACHE_REPLACEMENTS), and TensorRT-LLM's checkpoint "
                  "loaders read k_scale / v_scale only (tensorrt_llm/_torch/modules/linear.py @ 00bbf71 "
                  "load_kv_scales), so the served cache would drop the shift calibration relied on",
    "nvfp4_affine": "its export records kv_cache_quant_algo NVFP4_AFFINE, which TensorRT-LLM's QuantAlgo lacks (KV "
                    "algos: FP8, INT8, NVFP4)",
    "nvfp4_rotate": "it rotates keys before NVFP4 quantization, and ModelOpt's export records no rotation "
                    "(kv_cache_quant_algo NVFP4), so TensorRT-LLM would quantize unrotated keys: not the calibrated "
                    "model",
}


def unserved_kv_preset(value: str) -> str | None:
    """The reason a ModelOpt KV preset is no ``quant.kv_cache`` value, with what to use instead (None: not one)."""
    why = UNSERVED_KV_PRESETS.get(str(value))
    if why is None:
        return None
    base = "nvfp4_cast or nvfp4" if str(value).startswith("nvfp4") else "fp8_cast or fp8"
    return (f"quant.kv_cache={value} is a ModelOpt KV preset no TensorRT-LLM release serves: {why}; use "
            f"quant.kv_cache={base}")

FORMAT_RESOLVER = "pipeline.format"


def format_fact(name: Any, path: str) -> Any:
    """``${pipeline.format:NAME,PATH}``: the attribute ``PATH`` (dotted, e.g. ``tolerances.kl_max``) of weight format
    ``NAME``'s record (its module in ``pipeline/formats/``)."""
    name = str(getattr(name, "value", name))
    value: Any = formats.FORMATS.get(name)
    if value is None:
        raise ValueError(f"quant.format={name}: no format module pipeline/formats/{name}.py declares it")
    for part in str(path).split("."):
        if not hasattr(value, part):
            raise ValueError(f"format {name}: its record ({formats.MODULES[name].__name__}) has no {path!r}")
        value = getattr(value, part)
    return value


if not OmegaConf.has_resolver(FORMAT_RESOLVER):
    OmegaConf.register_new_resolver(FORMAT_RESOLVER, format_fact)


def format_default(key: str, lo: float | None = None, hi: float | None = None) -> Any:
    """A ``quant`` field (one level below ``quant``) whose default is ``quant.format``'s tolerance ``key`` (its module's
    ``Tolerances``), with an inclusive range like :func:`rng`."""
    return rng(f"${{{FORMAT_RESOLVER}:${{..format}},tolerances.{key}}}", lo, hi)


class ComputeDType(str, Enum):
    """The reference runtime's compute dtype. ``auto``: bfloat16 on a GPU and on a CPU with native bfloat16 (AVX512-BF16
    or AMX), float32 on any other CPU, where bfloat16 matrix products are emulated several times slower than float32
    ones; decided where the model is loaded (``pipeline.runtime.reference.compute_dtype``)."""

    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class GateMode(str, Enum):
    fail = "fail"
    warn = "warn"


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


# runtime.name: reference (PyTorch, anywhere), trtllm_engine (TensorRT engines, TRT-LLM <= 1.2.x, Triton's
# `tensorrtllm` backend), trtllm_llmapi (TRT-LLM >= 1.2 PyTorch backend, Triton's python `llmapi` model)
RuntimeName = Enum("RuntimeName", [(r, r) for r in catalog.RUNTIMES], type=str, module=__name__,
                   qualname="RuntimeName")


# The Triton layouts: ``auto`` and every layout folder (pipeline/triton/layouts/<name>/, pipeline.catalog), sorted.
# auto: trtllm_engine and reference -> inflight_batcher_llm (ensemble / BLS over preprocessing -> tensorrt_llm ->
# postprocessing), trtllm_llmapi -> llmapi (one python `tensorrt_llm` model driven by 1/model.yaml).
Layout = Enum("Layout", [("auto", "auto"), *((n, n) for n in catalog.layout_names())], type=str, module=__name__,
              qualname="Layout")


class Launcher(str, Enum):
    local = "local"  # a tritonserver binary started here
    docker = "docker"  # an NGC Triton image, GPUs and the repository mounted
    external = "external"  # an already running server at serve.url


# ----------------------------------------------------------------------------------------------------------- model
@dataclass
class AnswerCheck:
    prompt: str = MISSING
    expect: List[str] = field(default_factory=list)  # any of these substrings (case-insensitive) must appear


@dataclass
class SyntheticSpec:
    """Random weights from a transformers config: for tests (tiny) and scale runs (real shapes)."""

    seed: int = 0
    model_type: str = "qwen3"
    architecture: str = "Qwen3ForCausalLM"
    config: Dict[str, Any] = field(default_factory=dict)  # passed to transformers.AutoConfig.for_model
    tokenizer_vocab: int = rng(512, 260, 65536)  # byte-level BPE trained on the shipped corpus


@dataclass
class ModelShape:
    """Architecture facts known before download (used by plan for memory estimates)."""

    params_b: float = rng(0.0, 0.0, None)
    num_layers: int = rng(0, 0, None)
    hidden_size: int = rng(0, 0, None)
    intermediate_size: int = rng(0, 0, None)
    num_heads: int = rng(0, 0, None)
    num_kv_heads: int = rng(0, 0, None)
    head_dim: int = rng(0, 0, None)
    vocab_size: int = rng(0, 0, None)
    tie_word_embeddings: bool = False
    model_type: str = ""  # config.json's model_type (qwen3, llama, qwen3_moe, ...); "" when known only at fetch
    max_position_embeddings: int = rng(0, 0, None)  # the model's context (config.json); 0: not known at plan time


@dataclass
class ModelCalib:
    """A model's own calibration default (tiny and embedded models: a small set for the CPU); unset fields, and
    models without one, take ModelOpt's recipe (``pipeline.calib.RECIPE``) or, for synthetic and GGUF models, the
    shipped corpus's small set."""

    dataset: Optional[str] = None
    num_samples: Optional[int] = rng(None, 1, 100_000)
    seq_len: Optional[int] = rng(None, 8, 131_072)


@dataclass
class ModelConfig:
    name: str = MISSING
    # hf://org/name@revision | gguf://package/file.gguf | gguf:///abs/file.gguf | /local/hf/dir | synthetic
    source: str = MISSING
    synthetic: Optional[SyntheticSpec] = None
    dtype: DType = DType.bfloat16
    trust_remote_code: bool = False
    chat_template: bool = True  # prompts in bench/answer checks are rendered with the tokenizer's chat template
    checks: List[AnswerCheck] = field(default_factory=list)
    shape: ModelShape = field(default_factory=ModelShape)
    calib: Optional[ModelCalib] = None


# ----------------------------------------------------------------------------------------------------------- quant
@dataclass
class CalibConfig:
    # "auto": the model's own default (model.calib), else for real models (hf:// and local checkpoints) ModelOpt's
    # recipe dataset (cnn_nemotron_v2_mix: cnn_dailymail + nemotron-post-training-dataset-v2, from the Hub, needs
    # `pip install llm-pipeline[hub]`; a local checkpoint without it or offline calibrates on the shipped corpus,
    # recorded as short), and the shipped corpus for synthetic and packaged GGUF models. Or "builtin" (the corpus
    # shipped in pipeline/data), a local .jsonl ({"text": ...} per line) or .txt (paragraphs) file, a dataset name
    # ModelOpt knows (cnn_dailymail, nemotron-post-training-dataset-v2, cnn_nemotron_v2_mix, ...) or a Hub dataset
    # "org/name" with a "text" column.
    dataset: str = "auto"
    # null: the model's own default (model.calib), else ModelOpt hf_ptq.py's recipe (1024 rows x 512 tokens) for
    # real models and 24 x 128 for synthetic and GGUF ones. A smaller setting is recorded as a short calibration.
    num_samples: Optional[int] = rng(None, 1, 100_000)
    seq_len: Optional[int] = rng(None, 8, 131_072)
    batch_size: str = "auto"  # a positive integer, or "auto": sized to the free GPU memory (GPU), 8 on CPU
    chat_template: bool = False  # wrap each calibration document in the tokenizer's chat template
    allow_short: bool = False  # accept fewer calibration rows than num_samples (otherwise the stage fails)


@dataclass
class EvalConfig:
    """Held-out comparison of the quantized model against the unquantized one."""

    # 5 rows of 128 tokens: what the shipped corpus's held-out documents pack into with the default model's tokenizer
    # (SmolLM2's), so the default build is not short of held-out text
    num_samples: int = rng(5, 1, 10_000)
    seq_len: int = rng(128, 8, 131_072)
    # The export proof (pipeline/quant/proof.py), numbers part: the exported checkpoint reloaded by the reference
    # dequantizer vs ModelOpt's fake-quant model on held-out text,
    #   KL(fake-quant ‖ export) <= export_kl_abs + export_kl_frac × KL(unquantized ‖ fake-quant),
    # and each quantized layer's exported weight within export_weight_ratio × its quantization error of the
    # fake-quant weight. Both are set per format (its module's tolerances, pipeline/formats/<format>.py) so that the
    # unquantized weights fail (benchmarks/export_proof_bounds.py measures the margins).
    export_kl_abs: float = format_default("export_kl_abs", 0.0, 100.0)
    export_kl_frac: float = format_default("export_kl_frac", 0.0, 1.0)
    export_weight_ratio: float = format_default("export_weight_ratio", 0.0, 1.0)


@dataclass
class GateThresholds:
    """Quantized vs unquantized on held-out text; a breach fails the quantize stage unless quant.gate=warn. The
    defaults are the format's (its module's tolerances)."""

    kl_max: float = format_default("kl_max", 0.0, 100.0)
    top1_min: float = format_default("top1_min", 0.0, 1.0)
    ppl_ratio_max: float = format_default("ppl_ratio_max", 1.0, 100.0)


@dataclass
class QuantConfig:
    format: QuantFormat = MISSING
    kv_cache: KVFormat = KVFormat.fp8
    block_size: Optional[int] = rng(None, 8, 4096)  # AWQ group size; null = ModelOpt's preset (128)
    calib: CalibConfig = field(default_factory=CalibConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    gate: GateMode = GateMode.fail
    thresholds: GateThresholds = field(default_factory=GateThresholds)
    # One of the PTQ recipes ModelOpt ships, by name: general/ptq/<name> (modelopt_recipes/general/ptq/*.yaml; the
    # .yaml suffix is optional). The quantize stage then calibrates with the recipe's config (ModelOpt's
    # load_recipe) instead of the format's preset; plan derives the quant_algo and KV algo its export carries and
    # refuses a recipe the target cannot serve, or one that disagrees with quant / quant.kv_cache; the artifact's
    # label and bundle path name the recipe (pipeline/identity.py). pipeline/quant/recipes.py, docs/formats.md. null:
    # the format's preset.
    recipe: Optional[str] = None


# ---------------------------------------------------------------------------------------------------------- target
@dataclass
class SlurmSpec:
    partition: str = ""
    constraint: str = ""


@dataclass
class TargetConfig:
    name: str = MISSING
    device: Device = Device.cpu
    sm: int = rng(0, 0, 200)  # compute capability x10 (90 = sm90); 0 for CPU
    gpu_name: str = ""
    memory_gb: float = rng(0.0, 0.0, None)
    gpus_per_node: int = rng(0, 0, 64)
    slurm: SlurmSpec = field(default_factory=SlurmSpec)


# --------------------------------------------------------------------------------------------------------- runtime
@dataclass
class RuntimeConfig:
    name: RuntimeName = MISSING
    dtype: ComputeDType = ComputeDType.auto  # compute dtype of the reference runtime (ComputeDType)
    check_prompt: str = "The capital of France is"
    check_tokens: int = rng(8, 1, 512)
    # TRT-LLM runtimes: the version the serving container has (e.g. "1.2.1"); the build refuses another one
    trtllm_version: Optional[str] = None
    container: str = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"  # intended serving image (recorded)


# ----------------------------------------------------------------------------------------------------------- build
@dataclass
class BuildSettings:
    # 0 (and cuda_graph_batch_sizes []): derived per target by the serving plan (pipeline/serving_plan.py) from the
    # model's context, the workloads, the KV pool and serve.slo; a value set here wins
    max_batch_size: int = rng(0, 1, 4096, zero_derives=True)
    max_input_len: int = rng(0, 1, 1_048_576, zero_derives=True)
    max_seq_len: int = rng(0, 2, 1_048_576, zero_derives=True)
    max_num_tokens: int = rng(0, 1, 1_048_576, zero_derives=True)
    max_beam_width: int = rng(1, 1, 64)
    tp_size: int = rng(0, 1, 64, zero_derives=True)  # 0: the smallest TP whose weights + KV pool fit (capacity planner)
    pp_size: int = rng(1, 1, 64)
    kv_cache_free_gpu_mem_fraction: float = rng(0.0, 0.05, 0.99, zero_derives=True)  # 0: derived (serving plan)
    # Planner workload: the input/output lengths a typical request has
    expected_input_len: int = rng(1024, 1, 1_048_576)
    expected_output_len: int = rng(256, 1, 1_048_576)
    # Engine path (trtllm-build / BuildConfig)
    gemm_plugin: str = "auto"
    use_paged_context_fmha: bool = True
    use_fp8_context_fmha: bool = True  # applied only where TRT-LLM allows it (FP8, W4A8_AWQ, NVFP4)
    multiple_profiles: bool = False
    strip_plan: bool = False
    workers: int = rng(1, 1, 64)
    # LLM-API path
    cuda_graph_batch_sizes: List[int] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------------- serve
@dataclass
class OpenAILimits:
    max_body_bytes: int = rng(8 << 20, 1024, 1 << 30)  # larger bodies get a 413
    max_tokens: int = rng(4096, 1, 10_000_000)  # the default max_tokens: the remaining context, capped here
    request_timeout_s: float = rng(600.0, 1.0, 86_400.0)  # one generation's limit on the Triton side
    # a stream's status line waits this long for Triton's verdict on the request, then the headers go out while the
    # first token is made (a refusal after it arrives as an error event)
    stream_status_wait_ms: float = rng(5.0, 0.0, 600_000.0)


@dataclass
class AccessLogConfig:
    """One JSON line per request of the OpenAI API (pipeline.serving.observe): request id, model, endpoint, status,
    tokens, TTFT, duration, client address; never the prompt or a key."""

    path: Optional[str] = None  # a file the lines are appended to (null: none)
    stderr: bool = False  # the same lines on stderr


@dataclass
class OpenAIConfig:
    """The OpenAI-compatible front end that ``pipeline serve`` starts beside Triton (``pipeline.serving``)."""

    enabled: bool = True
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = rng(9000, 0, 65535)  # 0: any free port
    api_key_env: Optional[str] = None  # an environment variable holding the key clients must send (Bearer)
    model_name: Optional[str] = None  # the model id clients name; default the bundle's model name
    # auto: the layout's first entry point (ensemble for inflight_batcher_llm, tensorrt_llm for llmapi), or one of
    # the served layout's entry points by name (checked against the layout where the front end starts)
    entry_point: str = "auto"
    limits: OpenAILimits = field(default_factory=OpenAILimits)
    access_log: AccessLogConfig = field(default_factory=AccessLogConfig)


class Objective(str, Enum):
    throughput = "throughput"  # the most output tokens/s per GPU within the limits
    latency = "latency"  # the shortest request latency within the limits


@dataclass
class ServiceLimits:
    """The service-level limits that choose TP, batch and token budget among the configurations the performance model
    sweeps (pipeline/serving_plan.py). Defaults: aiconfigurator's own CLI defaults (--ttft 2000, --tpot 30)."""

    ttft_ms: float = rng(2000.0, 1.0, 3_600_000.0)
    tpot_ms: float = rng(30.0, 0.1, 60_000.0)
    objective: Objective = Objective.throughput
    # the concurrent requests the bundle must hold (the profile chooses among batches at least this large); 0: the
    # bench's highest concurrency level
    concurrency: int = rng(0, 1, 65536, zero_derives=True)


@dataclass
class ServeConfig:
    launcher: Launcher = Launcher.local
    slo: ServiceLimits = field(default_factory=ServiceLimits)
    layout: Layout = Layout.auto  # the Triton repository layout; the reference runtime can take either
    server_bin: Optional[str] = None  # else `tritonserver` on PATH, else the one bundled in nvidia-pytriton
    host: str = "127.0.0.1"
    startup_timeout_s: float = rng(180.0, 1.0, 3600.0)
    decoupled: bool = True
    preprocessing_instance_count: int = rng(1, 1, 64)
    postprocessing_instance_count: int = rng(1, 1, 64)
    llm_instance_count: int = rng(1, 1, 64)
    bls_instance_count: int = rng(1, 1, 64)
    max_queue_delay_microseconds: int = rng(0, 0, 10_000_000)
    max_queue_size: int = rng(0, 0, 1_000_000)
    enable_kv_cache_reuse: bool = True
    enable_chunked_context: bool = True
    repo_mount: str = "/models"  # where ops mount the model repository in the serving container (engine_dir)
    image: str = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"  # serve.launcher=docker (TRT-LLM 1.2.1)
    url: Optional[str] = None  # serve.launcher=external: host:grpc_port of a running server
    torch_threads: int = rng(0, 0, 1024)  # 0: torch's default
    # `pipeline serve` when Triton dies: "no" (exit 1, naming how it ended) or "on-failure" (start it again, up to
    # restart_max times in a row, waiting restart_backoff_s, doubled each time)
    restart: str = "no"
    restart_max: int = rng(3, 0, 100)
    restart_backoff_s: float = rng(1.0, 0.0, 600.0)
    # SIGTERM/SIGINT: in-flight requests may finish for this long before their streams are ended
    drain_s: float = rng(30.0, 0.0, 3600.0)
    # `pipeline serve`: Triton's Prometheus metrics on a port of its own, served again by the front end's /metrics
    metrics: bool = True
    openai: OpenAIConfig = field(default_factory=OpenAIConfig)


# ----------------------------------------------------------------------------------------------------------- bench
@dataclass
class WorkloadSize:
    """A workload's sizes on one target device (``bench.workloads.<name>.by_device.<device>``)."""

    prompt_words: Optional[int] = rng(None, 1, 100_000)
    max_tokens: Optional[int] = rng(None, 1, 65_536)


@dataclass
class Workload:
    """One bench workload (``bench.workloads.<name>``): prompts of about ``prompt_words`` words, ``max_tokens`` output
    tokens each. By default both come from ``by_device.<target.device>``; a value set directly wins."""

    by_device: Dict[str, WorkloadSize] = field(default_factory=dict)
    prompt_words: int = rng("${.by_device.${target.device}.prompt_words}", 1, 100_000)
    max_tokens: int = rng("${.by_device.${target.device}.max_tokens}", 1, 65_536)


@dataclass
class BenchGates:
    """Absolute limits (null: no limit), and the regression allowed against the previous published bundle."""

    max_error_rate: float = rng(0.0, 0.0, 1.0)
    ttft_p95_ms: Optional[float] = None
    itl_p95_ms: Optional[float] = None
    request_latency_p95_ms: Optional[float] = None
    min_output_tokens_per_s: Optional[float] = None
    regression_pct: Optional[float] = rng(25.0, 0.0, 1000.0)
    regression_on_cpu: bool = False  # CPU targets share cores with the load generator: report, do not fail


class AiperfLevels(str, Enum):
    all = "all"  # aiperf profiles every level of the sweep
    one = "one"  # the first workload's highest concurrency alone (each aiperf run starts its own services)


@dataclass
class BenchSweep:
    """The default sweep of one target device (``bench.sweep.cpu`` / ``bench.sweep.cuda``)."""

    concurrency: List[int] = field(default_factory=lambda: [1, 8, 32])
    requests_per_level: int = rng(8, 1, 100_000)
    warmup_requests: int = rng(2, 0, 10_000)
    aiperf_levels: AiperfLevels = AiperfLevels.all


@dataclass
class BenchConfig:
    # conf/bench/default.yaml sets concurrency, requests_per_level and warmup_requests from
    # bench.sweep.<target.device>, and each workload's sizes from its by_device.<target.device>; a value set directly
    # wins
    sweep: Dict[str, BenchSweep] = field(default_factory=dict)
    concurrency: List[int] = field(default_factory=lambda: [1, 8, 32])
    requests_per_level: int = rng(8, 1, 100_000)  # at least the concurrency of the level
    warmup_requests: int = rng(2, 0, 10_000)
    workloads: Dict[str, Workload] = field(default_factory=dict)  # name -> workload (conf/bench/default.yaml)
    only: Optional[List[str]] = None  # the workloads to run, in order; null: every one of bench.workloads
    seed: int = 0
    request_timeout_s: float = rng(120.0, 1.0, 3600.0)
    answer_max_tokens: int = rng(24, 1, 4096)
    # which entry point the load goes through: auto (the layout's first: ensemble for inflight_batcher_llm,
    # tensorrt_llm for llmapi) or one of the packaged layout's entry points by name (checked in plan)
    model: str = "auto"
    gates: BenchGates = field(default_factory=BenchGates)
    plot: bool = True
    openai: bool = True  # every level also through the OpenAI front end (pipeline.serving), beside the gRPC rows
    aiperf: bool = True  # with openai: aiperf profiles natively against the front end (the aiperf export)
    aiperf_levels: AiperfLevels = AiperfLevels.all  # which levels aiperf profiles (bench.sweep.<device>: one on CPU)


# ------------------------------------------------------------------------------------------------------------ eval
@dataclass
class TaskEvalConfig:
    """Task accuracy through the served OpenAI endpoint (lm-evaluation-harness), quantized vs unquantized, gated on
    the paired difference's confidence interval (pipeline/eval)."""

    # lm-eval task or group names; the project's own offline tasks live in pipeline/eval/tasks (pipeline_facts);
    # any task lm-eval ships runs where its dataset can be read (the `hub` extra and network). []: no evaluation
    tasks: List[str] = field(default_factory=lambda: ["pipeline_facts"])
    limit: Optional[int] = rng(None, 1, 10_000_000)  # items per task (null: all)
    num_fewshot: Optional[int] = rng(None, 0, 100)  # null: the task's own
    # the largest drop of the task score allowed per quant format (absolute: 0.05 = 5 accuracy points); the defaults
    # are the format modules' (tolerances.max_drop)
    max_drop: Dict[str, float] = field(default_factory=lambda: {
        n: f.tolerances.max_drop for n, f in formats.FORMATS.items()})
    confidence: float = rng(0.95, 0.5, 0.999)
    resamples: int = rng(2000, 100, 1_000_000)  # paired bootstrap resamples
    seed: int = 0
    strict: bool = False  # an inconclusive verdict fails the stage too
    # requests in flight (lm-eval num_concurrent); the reference runtime prefills the prompts that arrive together in
    # one pass, so the engine's batch (build.max_batch_size, 8) is the fastest on CPU
    concurrency: int = rng(8, 1, 256)
    max_length: int = rng(2048, 16, 1_048_576)  # lm-eval's context window (prompt + continuation tokens)
    request_timeout_s: float = rng(300.0, 1.0, 7200.0)
    timeout_s: float = rng(3600.0, 10.0, 86_400.0)  # the whole lm-eval run of one model


# --------------------------------------------------------------------------------------------------------- publish
class SignMethod(str, Enum):
    none = "none"
    key = "key"  # an elliptic-curve private key (PEM)
    certificate = "certificate"  # a private key with its signing certificate and chain (PEM)
    sigstore = "sigstore"  # keyless: Sigstore's public instance, ambient OIDC credentials (needs network)


@dataclass
class SignConfig:
    """OpenSSF model_signing over bundle.json (which holds every file's sha256); the signature is bundle.sig."""

    method: SignMethod = SignMethod.none
    private_key: Optional[str] = None  # PEM file (method key or certificate)
    password_env: Optional[str] = None  # name of the environment variable holding the key's password, if any
    signing_certificate: Optional[str] = None  # PEM file (method certificate)
    certificate_chain: List[str] = field(default_factory=list)  # PEM files (method certificate)


@dataclass
class PublishConfig:
    dest: str = "${paths.root}/published"  # any fsspec URL: a local path, s3://bucket/prefix, gs://..., memory://
    link: bool = True  # hard-link files into the local bundle when on the same filesystem
    sign: SignConfig = field(default_factory=SignConfig)
    # null: `latest` moves when every gate passed and the config is its matrix entry's (conf/matrix); true: an ad-hoc
    # config moves it too (gates still apply); false: it never moves (the version is published either way)
    move_latest: Optional[bool] = None


@dataclass
class GcConfig:
    max_age_days: float = rng(14.0, 0.0, None)  # stage outputs no published bundle references, older than this


# ----------------------------------------------------------------------------------------------------------- paths
@dataclass
class PathsConfig:
    root: str = "."
    store: str = "${paths.root}/.store"
    engines: str = "${paths.root}/engines"
    triton_repo: str = "${paths.root}/triton_repo"
    bundles: str = "${paths.root}/bundles"
    reports: str = "${paths.root}/reports"


# ------------------------------------------------------------------------------------------------------------ root
@dataclass
class PipelineConfig:
    model: ModelConfig = MISSING
    quant: QuantConfig = MISSING
    target: TargetConfig = MISSING
    runtime: RuntimeConfig = MISSING
    build: BuildSettings = MISSING
    serve: ServeConfig = MISSING
    bench: BenchConfig = MISSING
    publish: PublishConfig = MISSING
    paths: PathsConfig = MISSING
    eval: TaskEvalConfig = MISSING
    gc: GcConfig = field(default_factory=GcConfig)
    until: Optional[str] = None  # stop after this stage
    force: List[str] = field(default_factory=list)  # re-run these stages even when cached


GROUPS: Dict[str, type] = {
    "model": ModelConfig,
    "quant": QuantConfig,
    "target": TargetConfig,
    "runtime": RuntimeConfig,
    "build": BuildSettings,
    "serve": ServeConfig,
    "bench": BenchConfig,
    "publish": PublishConfig,
    "paths": PathsConfig,
    "eval": TaskEvalConfig,
}


def register() -> None:
    """Store the root schema and one schema per group (``<group>/schema``) in Hydra's ConfigStore, once per process
    (storing converts every dataclass into a structured config, ~25 ms; every compose asks for it). A store that lost
    an entry gets them all again."""
    cs = ConfigStore.instance()
    if "pipeline_schema.yaml" in cs.repo and all("schema.yaml" in (cs.repo.get(g) or {}) for g in GROUPS):
        return
    cs.store(name="pipeline_schema", node=PipelineConfig)
    for group, node in GROUPS.items():
        cs.store(group=group, name="schema", node=node)
