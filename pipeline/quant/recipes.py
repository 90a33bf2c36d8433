"""ModelOpt's PTQ recipes by name: ``quant.recipe=general/ptq/<name>``.

A recipe is one of the YAML files ModelOpt 0.47 ships under ``modelopt_recipes/general/ptq/`` (24 of them; the
``.yaml`` suffix is optional). The quantize stage loads it with ModelOpt's own loader
(``modelopt.recipe.load_recipe``, which resolves the recipe's ``$import`` units) and calibrates with the
``quantize`` section it yields (``mtq.quantize``), in place of the format module's preset.

What the export will carry is derived here, before any download or calibration, with ModelOpt's own code: the
recipe's config is applied to a small stand-in of the model's architecture (a few-layer random model built from
``transformers.AutoConfig.for_model(model_type)``) by the insertion step of ``mtq.quantize`` (``apply_mode(...,
"quantize")``, no calibration), and ``modelopt.torch.export.quant_utils.get_quant_config`` -- the function
``export_hf_checkpoint`` writes ``hf_quant_config.json`` from -- reads the quantizers back: the weight
``quant_algo``, the ``kv_cache_quant_algo``, the ``group_size`` and the ``exclude_modules``. Whether the KV
quantizers use a constant amax (ModelOpt's ``_cast`` KV units) is read from the same quantizers.

That result is then mapped onto the format registry (``pipeline/formats/``): the weight format whose module
declares that ``quant_algo`` (and block size), and the KV format with that ``kv_cache_quant_algo`` and amax mode. The
target's GPU, runtime and TensorRT-LLM line are checked with those modules' support matrices
(``pipeline.compat.problems``). A recipe whose export no format module describes is refused with the reason.

``tests/e2e/test_recipes_modelopt.py`` holds every shipped recipe's derivation against ModelOpt's real export
(``mtq.quantize`` with calibration, then ``export_hf_checkpoint``) of a tiny model.

Every ``modelopt``/``torch``/``transformers`` import is inside a function: the name checks
(:func:`name_problem`) read the recipe library's files only.
"""
from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import io
from dataclasses import dataclass, field
from typing import Any

from pipeline import compat
from pipeline.errors import UserError
from pipeline.formats import BY_ALGO, FORMATS, KV_FORMATS

PREFIX = "general/ptq/"
LIBRARY = "modelopt_recipes"  # the package ModelOpt ships its recipe library in
SUFFIXES = (".yaml", ".yml")
DOCS = "docs/formats.md#modelopt-recipes-quantrecipe"
# The stand-in architecture when the model's model_type is known only after fetch (an hf:// model without
# model.shape.model_type): a dense Qwen3, the project's synthetic models' architecture.
DEFAULT_PROBE = "qwen3"

# Calibration algorithms of shipped recipes that do not run on a CPU (seen with ModelOpt 0.47.0, torch 2.13 CPU; the
# unit test runs each shipped recipe on CPU and holds this table to what happens):
CUDA_ONLY = {
    "gptq": "its layerwise GPTQ runs the NVFP4 fake quant during calibration, which asserts 'amax must be a CUDA "
            "tensor for dynamic block quantization' on a CPU",
    "mse": "its MSE search over FP8 block scales runs static_blockwise_fp4_fake_quant, which needs triton (CUDA)",
}


# ------------------------------------------------------------------------------------------------------- names
def normalize(value: Any) -> str:
    """``general/ptq/<name>`` as given, without a ``.yaml`` / ``.yml`` suffix or surrounding slashes."""
    v = str(value).strip().strip("/")
    for s in SUFFIXES:
        if v.endswith(s):
            return v[: -len(s)]
    return v


def _library():
    """The recipe library's root (``modelopt_recipes``, a data package: no torch imported), or None."""
    import importlib.resources as resources

    try:
        return resources.files(LIBRARY)
    except ModuleNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def shipped() -> tuple[str, ...]:
    """The names of the PTQ recipes ModelOpt ships under ``general/ptq/`` (``<name>``, sorted)."""
    root = _library()
    if root is None:
        return ()
    d = root.joinpath(*PREFIX.strip("/").split("/"))
    if not d.is_dir():
        return ()
    return tuple(sorted(p.name.rsplit(".", 1)[0] for p in d.iterdir() if p.name.endswith(SUFFIXES)))


def _builtin_file(path: str) -> bool:
    root = _library()
    return root is not None and any(root.joinpath(*(path + s).split("/")).is_file() for s in SUFFIXES)


def name_problem(value: Any) -> str | None:
    """Why ``quant.recipe=value`` names no shipped PTQ recipe (None: it names one). Reads the library's files only;
    a recipe file outside ``general/ptq/`` is loaded to say what kind of recipe it is."""
    v = normalize(value)
    names = shipped()
    if not names:
        return (f"quant.recipe={value}: ModelOpt's recipe library ({LIBRARY}) is not installed; install "
                f"nvidia-modelopt 0.47 or newer, or leave quant.recipe unset")
    if v.startswith(PREFIX) and v[len(PREFIX):] in names:
        return None
    if _builtin_file(v):
        kind = _recipe_kind(v)
        if kind != "ptq":
            return (f"quant.recipe={value} is a ModelOpt {kind} recipe, not a PTQ recipe; quant.recipe takes the "
                    f"PTQ recipes of {PREFIX} (e.g. {PREFIX}{names[0]}; all {len(names)}: {DOCS})")
        return (f"quant.recipe={value} is a PTQ recipe outside {PREFIX} (a QAD or model-specific one), which this "
                f"pipeline has not checked; quant.recipe takes the {len(names)} recipes of {PREFIX} ({DOCS})")
    tail = v.rsplit("/", 1)[-1]
    close = difflib.get_close_matches(tail, names, n=3, cutoff=0.5)
    hint = (f"close: {', '.join(PREFIX + c for c in close)}" if close
            else f"e.g. {PREFIX}fp8_default-kv_fp8_cast")
    where = "" if v.startswith(PREFIX) else f" (recipes are named {PREFIX}<name>)"
    return (f"quant.recipe={value}: ModelOpt ships no PTQ recipe of that name{where}; {hint} (all {len(names)}: "
            f"{DOCS})")


def _recipe_kind(path: str) -> str:
    """``metadata.recipe_type`` of a recipe file of the library, as ModelOpt's loader reads it."""
    try:
        recipe = _load(path)
    except Exception as exc:  # a recipe ModelOpt itself cannot load here (its speculative-decoding extras)
        return f"non-loadable ({type(exc).__name__})"
    return str(getattr(recipe.recipe_type, "value", recipe.recipe_type))


@contextlib.contextmanager
def _quiet():
    """ModelOpt's import warnings (untested transformers version, optional plugins) and its prints stay out of the
    plan's output; the quantize stage's run log keeps them when it imports ModelOpt itself."""
    import warnings

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def _load(path: str):
    with _quiet():  # load_recipe prints "[load_recipe] loading: ..."
        from modelopt.recipe import load_recipe

        return load_recipe(path)


@functools.lru_cache(maxsize=None)
def load(value: str):
    """ModelOpt's ``ModelOptPTQRecipe`` for ``quant.recipe=value`` (its loader, ``$import`` units resolved); a
    name that is no shipped PTQ recipe raises :class:`UserError`."""
    problem = name_problem(value)
    if problem:
        raise UserError(problem)
    return _load(normalize(value))


def quant_config(value: str, scratch: str | None = None) -> dict[str, Any]:
    """The recipe's ``quantize`` section as the config ``mtq.quantize`` takes (``quant_cfg`` and ``algorithm``).
    ``scratch``: a directory for the layerwise checkpoints a recipe's algorithm writes (ModelOpt's recipes name a
    relative ``output/layerwise_ckpts/``, which would land in the current directory)."""
    cfg = copy.deepcopy(load(value).quantize.model_dump())
    algo = cfg.get("algorithm")
    layerwise = algo.get("layerwise") if isinstance(algo, dict) else None
    if scratch is not None and isinstance(layerwise, dict) and layerwise.get("checkpoint_dir"):
        layerwise["checkpoint_dir"] = scratch
    return cfg


def algorithm(value: str) -> str:
    """The recipe's calibration method (``max``, ``mse``, ``gptq``, ``nvfp4_act_headroom``; ``none``)."""
    algo = load(value).quantize.model_dump().get("algorithm")
    if isinstance(algo, dict):
        return str(algo.get("method") or "max")
    return str(algo) if algo else "none"


# --------------------------------------------------------------------------------------------------- derivation
@dataclass(frozen=True)
class Derived:
    """What ModelOpt's unified export of the recipe writes into ``hf_quant_config.json`` for one architecture."""

    recipe: str
    description: str
    algorithm: str
    probe: str  # the model_type of the stand-in the recipe was applied to
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    group_size: int | None
    exclude_modules: tuple[str, ...] = ()
    kv_constant_amax: bool = False
    quantized_layers: dict[str, Any] = field(default_factory=dict)  # MIXED_PRECISION: per layer

    def to_json(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "description": self.description, "algorithm": self.algorithm,
                "probe": self.probe, "quant_algo": self.quant_algo, "kv_cache_quant_algo": self.kv_cache_quant_algo,
                "group_size": self.group_size, "exclude_modules": list(self.exclude_modules),
                "kv_constant_amax": self.kv_constant_amax}


PROBE_SIZES = {  # the stand-in's sizes: every linear input a multiple of 128 (INT4 blocks), a few experts
    "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 128,
    "num_experts": 2, "num_local_experts": 2, "n_routed_experts": 2, "num_experts_per_tok": 1,
    "decoder_sparse_step": 1, "first_k_dense_replace": 0, "max_position_embeddings": 256,
}


def probe_model(model_type: str):
    """A one-layer random model of ``model_type`` (transformers' config class for it, shrunk to PROBE_SIZES): the
    module names and types ModelOpt's patterns and export see on the real model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    default = AutoConfig.for_model(model_type)
    cfg = AutoConfig.for_model(model_type, **{k: v for k, v in PROBE_SIZES.items() if hasattr(default, k)})
    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()):
        model = AutoModelForCausalLM.from_config(cfg).eval()
    model.config.architectures = [type(model).__name__]  # ModelOpt's export reads it (None fails there)
    return model


def exported_fields(model) -> dict[str, Any]:
    """``hf_quant_config.json``'s ``quantization`` as ModelOpt's export writes it for ``model`` (its
    ``get_quant_config``), plus whether the enabled K/V quantizers use a constant amax."""
    from modelopt.torch.export.quant_utils import get_quant_config

    with contextlib.redirect_stdout(io.StringIO()):
        q = dict(get_quant_config(model)["quantization"])
    kv = [getattr(m, f"{w}_bmm_quantizer") for m in model.modules() for w in ("k", "v")
          if getattr(getattr(m, f"{w}_bmm_quantizer", None), "is_enabled", False)]
    q["kv_constant_amax"] = bool(kv) and all(getattr(t, "_use_constant_amax", False) for t in kv)
    return q


def insert_quantizers(model, config: dict[str, Any]):
    """The first step of ``mtq.quantize`` (``apply_mode(model, [("quantize", config)])``): the quantizers the config
    names, inserted and configured, not calibrated."""
    from modelopt.torch.opt import apply_mode
    from modelopt.torch.quantization.mode import QuantizeModeRegistry

    with contextlib.redirect_stdout(io.StringIO()):
        return apply_mode(model, mode=[("quantize", dict(config))], registry=QuantizeModeRegistry)


@functools.lru_cache(maxsize=None)
def derive(value: str, model_type: str | None = None) -> Derived:
    """What the export of recipe ``value`` on a ``model_type`` model carries (see the module docstring)."""
    recipe = load(value)
    probe = model_type or DEFAULT_PROBE
    try:
        with _quiet():
            model = probe_model(probe)
    except Exception as exc:
        raise UserError(f"quant.recipe={value}: cannot build a stand-in of model_type {probe} to derive what the "
                        f"recipe exports ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); set "
                        f"model.shape.model_type to a transformers model type") from exc
    with _quiet():
        q = exported_fields(insert_quantizers(model, quant_config(value)))
    return Derived(recipe=f"{PREFIX}{normalize(value)[len(PREFIX):]}", description=" ".join(recipe.description.split()),
                   algorithm=algorithm(value), probe=probe, quant_algo=q.get("quant_algo"),
                   kv_cache_quant_algo=q.get("kv_cache_quant_algo"), group_size=q.get("group_size"),
                   exclude_modules=tuple(q.get("exclude_modules") or ()), kv_constant_amax=q["kv_constant_amax"],
                   quantized_layers=dict(q.get("quantized_layers") or {}))


@functools.lru_cache(maxsize=None)
def preset_excludes(fmt: str, model_type: str) -> tuple[str, ...]:
    """``exclude_modules`` of the format's own preset (``quant=<fmt>``) on the same stand-in: what every export of
    that format leaves unquantized (embeddings, ``lm_head``, MoE routers)."""
    from pipeline.quant import modelopt

    with _quiet():
        q = exported_fields(insert_quantizers(probe_model(model_type), modelopt.quant_config(fmt, "none")))
    return tuple(q.get("exclude_modules") or ())


# ------------------------------------------------------------------------------------------------------ mapping
@dataclass(frozen=True)
class Mapped:
    """A recipe's export as the format registry names it."""

    format: str | None  # quant=... (None: no format module describes the export)
    kv_cache: str | None  # quant.kv_cache=...
    problems: tuple[str, ...] = ()  # why the export maps to no format, or is not known to load
    partial: tuple[str, ...] = ()  # patterns the recipe leaves unquantized beyond the format's own preset


def kv_format(algo: str | None, constant_amax: bool) -> str | None:
    """The KV format module with this ``kv_cache_quant_algo`` and amax mode (``fp8`` / ``fp8_cast``, ...)."""
    if algo is None:
        return "none"
    return next((n for n, k in KV_FORMATS.items() if k.quant_algo == algo and k.constant_amax == constant_amax),
                None)


def to_formats(d: Derived) -> Mapped:
    """Map a derivation onto the registry: the format whose module declares its ``quant_algo`` (and block size) and
    the KV format with its ``kv_cache_quant_algo`` and amax mode; what no module describes is a problem."""
    who = f"quant.recipe={d.recipe}"
    problems: list[str] = []
    fmt: str | None = None
    if d.quant_algo is None:
        problems.append(f"{who} quantizes no weight of a {d.probe} model: its weight patterns match no layer of that "
                        f"architecture (the experts_only recipes need an MoE model); pick one that quantizes this "
                        f"model, e.g. {PREFIX}nvfp4_mlp_only-kv_fp8_cast or {PREFIX}fp8_default-kv_fp8_cast")
    elif d.quant_algo == "MIXED_PRECISION":
        algos = sorted({str(v.get("quant_algo")) for v in d.quantized_layers.values()})
        problems.append(f"{who} exports quant_algo MIXED_PRECISION (per-layer {', '.join(algos)}); the format "
                        f"registry, the export proof and the reference runtime hold one quant_algo per export, so "
                        f"no format module describes it")
    else:
        spec = BY_ALGO.get(d.quant_algo)
        if spec is None:
            problems.append(f"{who} exports quant_algo {d.quant_algo!r}, which no format module declares (no "
                            f"TensorRT-LLM QuantAlgo loads it: {DOCS})")
        elif spec.group_size is not None and d.group_size != spec.export_group(None):
            problems.append(f"{who} exports {d.quant_algo} in blocks of {d.group_size}; the {spec.name} format, and "
                            f"the TensorRT-LLM loaders its module records, take blocks of {spec.export_group(None)}, "
                            f"so it is not known to load")
        else:
            fmt = spec.name
    kv = kv_format(d.kv_cache_quant_algo, d.kv_constant_amax)
    if kv is None:
        problems.append(f"{who} exports kv_cache_quant_algo {d.kv_cache_quant_algo!r}"
                        f"{' with a constant amax' if d.kv_constant_amax else ''}, which no KV format module declares")
    partial: tuple[str, ...] = ()
    if fmt is not None and fmt != "none":
        own = preset_excludes(fmt, d.probe)
        # the stand-in has one decoder layer: its layer 0 stands for every layer of the model
        partial = tuple(dict.fromkeys(p.replace(".layers.0.", ".layers.*.") for p in d.exclude_modules
                                      if p not in own))
    return Mapped(fmt, kv, tuple(problems), partial)


# ---------------------------------------------------------------------------------------------------- plan check
# Runtimes known to load an export whose exclude_modules leave more than the format's own preset unquantized:
# the LLM API gives every Linear matched by exclude_modules an unquantized QuantConfig (keeping the KV algo;
# tensorrt_llm/_torch/models/modeling_utils.py apply_quant_config_exclude_modules), and the reference runtime
# loads excluded layers as stored. The engine path builds from ModelOpt's separate TRT-LLM checkpoint export, whose
# partial exclusions have not been checked here.
PARTIAL_RUNTIMES = frozenset({"reference", "trtllm_llmapi"})


def problems(cfg, model_type: str | None, trtllm_line: str | None, *,
             compat_checked: bool) -> tuple[list[str], Derived | None, Mapped | None]:
    """Every reason ``cfg``'s ``quant.recipe`` cannot run or be served (empty when it can), with the derivation and
    its mapping. ``compat_checked``: the build stage's own compatibility check will run on ``quant.format`` /
    ``quant.kv_cache`` (so a consistent config is not refused twice for the target)."""
    q = cfg.quant
    value = str(q.recipe)
    problem = name_problem(value)
    if problem:
        return [problem], None, None
    d = derive(value, model_type)
    m = to_formats(d)
    out = list(m.problems)
    who = f"quant.recipe={d.recipe}"
    if m.format is None or m.kv_cache is None:
        return out, d, m
    t, runtime = cfg.target, cfg.runtime.name.value
    makes = f"{who} exports {d.quant_algo} (quant={m.format}) with {d.kv_cache_quant_algo or 'no'} KV " \
            f"(quant.kv_cache={m.kv_cache})"
    consistent = (m.format, m.kv_cache) == (q.format.value, q.kv_cache.value)
    if not consistent or not compat_checked:
        out += [f"{makes}: {p}" for p in compat.problems(m.format, m.kv_cache, t.name, int(t.sm), t.device.value,
                                                          runtime, trtllm_line)]
    if m.partial and runtime not in PARTIAL_RUNTIMES:
        out.append(f"{who} leaves {', '.join(m.partial)} unquantized beyond what quant={m.format} leaves, and "
                   f"runtime {runtime} is not known to load such a partly quantized export (its checkpoint export "
                   f"has not been checked); use runtime=trtllm_llmapi, or a recipe that quantizes every layer "
                   f"(e.g. {PREFIX}{'nvfp4_default' if m.format == 'nvfp4' else 'fp8_default'}-kv_fp8)")
    why = CUDA_ONLY.get(d.algorithm)
    if why and t.device.value != "cuda":
        out.append(f"{who} calibrates with {d.algorithm}, which runs on a CUDA GPU only ({why}); use a GPU target, "
                   f"or a max-calibrated recipe on target cpu")
    if q.get("block_size") is not None:
        out.append(f"quant.block_size={q.block_size} does not apply to {who}: the recipe fixes its own blocks "
                   f"({d.group_size}); leave quant.block_size unset")
    if not out and not consistent:
        out.append(f"{makes}, but the config says quant={q.format.value} quant.kv_cache={q.kv_cache.value}; set "
                   f"quant={m.format} quant.kv_cache={m.kv_cache} with it, so that plan, the export proof, the "
                   f"accuracy gate and the bundle's name all describe what the recipe makes")
    return out, d, m


def summary(d: Derived, m: Mapped) -> dict[str, Any]:
    """The plan's record of a recipe."""
    return {**d.to_json(), "format": m.format, "kv_format": m.kv_cache, "partial": list(m.partial),
            "problems": list(m.problems)}


def record(d: Derived, m: Mapped) -> dict[str, Any]:
    """What the quantize result and ``bundle.json`` record of the recipe that ran (``pipeline.results.RecipeRecord``):
    its name, description and calibration, the derived export and the formats it maps to."""
    return {"name": d.recipe, "description": d.description, "algorithm": d.algorithm, "probe": d.probe,
            "quant_algo": d.quant_algo, "kv_cache_quant_algo": d.kv_cache_quant_algo, "group_size": d.group_size,
            "exclude_modules": list(d.exclude_modules), "kv_constant_amax": d.kv_constant_amax, "format": m.format,
            "kv_cache": m.kv_cache, "partial": list(m.partial)}

