"""The quant-format registry: one module per format in this package, each owning its facts and its behaviour.

**Discovery.** Every module of this package's directory whose name does not start with ``_`` is imported, in sorted
name order (``pkgutil.iter_modules(__path__)``, so the same files give the same registry on every machine). A module
declares ``FORMAT`` (a :class:`QuantFormat`: a ``quant.format`` value), ``KV_FORMAT`` (a :class:`KVFormat`: a
``quant.kv_cache`` value) or both, each named after the module; ``_base.py`` holds the record types and the kernels
several formats share. A module that cannot be imported, declares neither record, names a record after another module
or repeats another format's ``quant_algo`` (a KV format may, as a ``variant_of`` the one it shares it with: ModelOpt's
``fp8_cast`` exports what ``fp8`` does, without calibration) stops the registry with a :class:`FormatError` naming
the file.

:data:`FORMATS` and :data:`KV_FORMATS` list the unquantized format first, then the others by ``preference``, then by
name: the order the schema's enums (``pipeline.schema.QuantFormat`` / ``KVFormat``) and their messages use.

A format module owns, as keyword arguments of its record: ModelOpt's preset and the ``quant_algo`` its unified export
writes; the export's tensors (:class:`ExportLayout`, read by the export proof); bytes per parameter (the capacity
planner); the GPU architectures and runtimes that serve it (``compat``); AWQ / NVFP4 block sizes; the TensorRT-LLM
facts (FP8 context FMHA; the rules of ``pipeline/upstream/rules.yaml`` that refuse it); its tolerances (the accuracy
gate, the export-proof bounds, the task-eval ``max_drop``: the config's defaults read them); the calibration-time
factor; and its behaviour: ``dequantize`` and ``quantize_input`` (the reference runtime's linear layers),
``quantize_kv`` (its attention hook), ``cpu_fallback`` and ``round_as_exported`` (the quantize stage's hooks on
ModelOpt's calibrated model).

Self-contained, like the reference runtime: the package stage copies this package into Triton model repositories
(``1/reference_formats/``), where ``pipeline`` is not importable. The modules import nothing from ``pipeline`` (only
relatively, within this package), and torch and modelopt inside functions only: ``pipeline.schema`` and the CLI
read the registry at plan time without loading torch.
"""
from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from ._base import (ALL_GPUS, ALL_RUNTIMES, AWQ_GROUP, BLACKWELL, FLOAT_DTYPES, RUNTIMES, TRTLLM_LINES, ExportLayout,
                    FormatError, KVFormat, QuantFormat, Tolerances)

__all__ = ["ALL_GPUS", "ALL_RUNTIMES", "AWQ_GROUP", "BLACKWELL", "FLOAT_DTYPES", "RUNTIMES", "TRTLLM_LINES",
           "ExportLayout",
           "FormatError", "KVFormat", "QuantFormat", "Tolerances", "FORMATS", "KV_FORMATS", "MODULES", "AWQ_FORMATS",
           "BY_ALGO", "KV_BY_ALGO", "PREFERENCE", "dequantize", "discover"]


def _order(rec: QuantFormat | KVFormat) -> tuple:
    pref = getattr(rec, "preference", None)
    return rec.quant_algo is not None, pref if pref is not None else float("inf"), rec.name


def discover(package: str, path) -> tuple[dict[str, QuantFormat], dict[str, KVFormat], dict[str, ModuleType]]:
    """Import the format modules of ``package`` (its directories ``path``) -> (formats, KV formats, modules)."""
    formats: dict[str, QuantFormat] = {}
    kvs: dict[str, KVFormat] = {}
    modules: dict[str, ModuleType] = {}
    for info in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        where = f"{package.replace('.', '/')}/{info.name}.py"
        try:
            mod = importlib.import_module(f"{package}.{info.name}")
        except FormatError as exc:
            raise FormatError(f"{where}: {exc}") from exc
        except Exception as exc:
            raise FormatError(f"{where} cannot be imported ({type(exc).__name__}: {exc}); fix it, or remove the "
                              f"file to drop the format") from exc
        found = False
        for attr, kind, into in (("FORMAT", QuantFormat, formats), ("KV_FORMAT", KVFormat, kvs)):
            rec = getattr(mod, attr, None)
            if rec is None:
                continue
            found = True
            if not isinstance(rec, kind):
                raise FormatError(f"{where}: {attr} is a {type(rec).__name__}, not a {kind.__name__}")
            if rec.name != info.name:
                raise FormatError(f"{where}: {attr}.name is {rec.name!r}; a format is named after its module "
                                  f"({info.name!r}), which names its conf/quant preset too")
            other = next((o for o in into.values() if rec.quant_algo and o.quant_algo == rec.quant_algo), None)
            if other is not None and getattr(rec, "variant_of", None) is None \
                    and getattr(other, "variant_of", None) is None:
                raise FormatError(f"{where}: {attr}.quant_algo {rec.quant_algo!r} is {other.name}'s already; an "
                                  f"export's quant_algo must name one format")
            into[rec.name] = rec
        if not found:
            raise FormatError(f"{where} declares neither FORMAT (a QuantFormat) nor KV_FORMAT (a KVFormat); declare "
                              f"one, or name the file with a leading '_' if it is a helper")
        modules[info.name] = mod
    if "none" not in formats or "none" not in kvs:
        raise FormatError(f"{package.replace('.', '/')}/none.py must declare the unquantized FORMAT and KV_FORMAT "
                          f"(quant.format=none, quant.kv_cache=none)")
    for rec in kvs.values():
        base = kvs.get(rec.variant_of) if rec.variant_of else None
        if rec.variant_of and (base is None or base.quant_algo != rec.quant_algo or base.variant_of):
            raise FormatError(f"{package.replace('.', '/')}/{rec.name}.py: KV_FORMAT.variant_of={rec.variant_of!r} "
                              f"must name a KV format module exporting the same kv_cache_quant_algo "
                              f"({rec.quant_algo!r}) that is no variant itself")
    return (dict(sorted(formats.items(), key=lambda kv: _order(kv[1]))),
            dict(sorted(kvs.items(), key=lambda kv: _order(kv[1]))), modules)


FORMATS, KV_FORMATS, MODULES = discover(__name__, __path__)

# Derived views, for the modules that look a format up by one fact.
AWQ_FORMATS = tuple(n for n, f in FORMATS.items() if f.awq)
BY_ALGO: dict[str, QuantFormat] = {f.quant_algo: f for f in FORMATS.values() if f.quant_algo}
KV_BY_ALGO: dict[str, KVFormat] = {k.quant_algo: k for k in KV_FORMATS.values() if k.quant_algo and not k.variant_of}
PREFERENCE = tuple(sorted((n for n, f in FORMATS.items() if f.preference is not None),
                          key=lambda n: FORMATS[n].preference))


def dequantize(algo: str | None, tensors: dict, group_size: int | None):
    """The fp32 weight an exported quantized linear layer of ``quant_algo`` ``algo`` represents (its format's
    ``dequantize``)."""
    fmt = BY_ALGO.get(algo)
    if fmt is None:
        raise ValueError(f"no dequantizer for quant_algo={algo!r} (no format module declares it)")
    return fmt.dequantize(tensors, group_size)
