"""``diff``: what changed between two bundles, as a Markdown table, and the recipe settings it (and the CI matrix)
compares."""
from __future__ import annotations

from typing import Any

from pipeline.bundle.remote import open_manifest, store_errors


def _get(d: dict[str, Any], *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


UNCOMPARED = ("paths.", "publish.dest", "publish.link", "publish.sign", "publish.move_latest")  # where, not what


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{"a.b.c": value}``."""
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def recipe_settings(doc: dict[str, Any]) -> dict[str, Any]:
    """A bundle's recorded recipe (``recipe``: each stage's resolved config) as one flat ``key -> value`` map
    (every stage reads one config: a key has one value); paths and the destination are left out. Empty for a
    bundle that records no recipe."""
    out: dict[str, Any] = {}
    for cfg in (doc.get("recipe") or {}).values():
        out.update(flatten(cfg))
    return {k: v for k, v in out.items() if not k.startswith(UNCOMPARED)}


ABSOLUTE = ("baseline", "quantized", "difference", "ci_low", "ci_high")  # task fields compared by difference

# A recipe key whose recorded value may be ``null``/``auto`` (resolved at run time) -> where the bundle records the
# value the build used
EFFECTIVE = {"quant.calib.num_samples": ("quant", "calibration", "rows"),
             "quant.calib.seq_len": ("quant", "calibration", "seq_len"),
             "quant.calib.dataset": ("quant", "calibration", "dataset")}


class _Resolved:
    """A value the build resolved (``auto``/unset in its recipe): shown as ``24 (resolved)``, compared by value."""

    def __init__(self, value: Any):
        self.value = value

    def __str__(self) -> str:
        return f"{self.value} (resolved)"


def _plain(v: Any) -> Any:
    return v.value if isinstance(v, _Resolved) else v


def effective_settings(doc: dict[str, Any]) -> dict[str, Any]:
    """:func:`recipe_settings` with each ``auto``/unset key that the bundle records a resolved value for replaced by
    that value (``quant.calib.num_samples`` unset -> the calibration rows it used), so two builds compare by what
    they ran with."""
    out = recipe_settings(doc)
    for key, path in EFFECTIVE.items():
        if key in out and out[key] in (None, "auto"):
            used = _get(doc, *path)
            if used is not None:
                out[key] = _Resolved(used)
    return out


def serving_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``pipeline diff``'s rows for the serving plan each bundle records (``capacity.serving``,
    pipeline/serving_plan.py): every serving setting, the profile's TP and batch, and the predicted figures of the
    typical request at the chosen KV dtype with the tables' TensorRT-LLM version and the model's version."""
    sa, sb = _get(a, "capacity", "serving") or {}, _get(b, "capacity", "serving") or {}
    rows: list[tuple[str, Any, Any]] = []
    names = list(dict.fromkeys([*(sa.get("settings") or {}), *(sb.get("settings") or {})]))
    for n in names:
        rows.append((f"serving {n}", _get(sa, "settings", n, "value"), _get(sb, "settings", n, "value")))
    for key in ("tp", "batch"):
        rows.append((f"profile {key}", _get(sa, "profile", "chosen", key), _get(sb, "profile", "chosen", key)))

    def typical(s: dict[str, Any]) -> dict[str, Any]:
        w = _get(s, "predictions", "workloads", "typical") or {}
        return next((v for k, v in w.items() if k.startswith("kv_")), {}) or {}

    ta, tb = typical(sa), typical(sb)
    for key, label in (("ttft_ms", "ttft_ms"), ("tpot_ms", "tpot_ms"), ("tokens_per_s_per_gpu", "tokens_per_s_per_gpu"),
                       ("memory_gb_at_request", "memory_gb (at the request's length)"),
                       ("memory_gb", "memory_gb (at the full max_seq_len)")):
        rows.append((f"predicted {label}", ta.get(key), tb.get(key)))
    rows.append(("predicted from TensorRT-LLM tables", _get(sa, "predictions", "trtllm_tables"),
                 _get(sb, "predictions", "trtllm_tables")))
    rows.append(("performance model", sa.get("model"), sb.get("model")))
    return rows


BENCH_FIGURES = ("ttft_p50_ms", "latency_p95_ms", "output_tokens_per_s")  # the bench rows diff compares


def within_noise(a: Any, b: Any) -> bool | None:
    """Whether two recorded intervals ``[low, high]`` overlap (the change between the figures may be chance);
    ``None`` when either side recorded none."""
    def ok(x: Any) -> bool:
        return (isinstance(x, (list, tuple)) and len(x) == 2
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in x))

    if not (ok(a) and ok(b)):
        return None
    return a[0] <= b[1] and b[0] <= a[1]


def _noise_notes(compared: bool, confidences: set[Any], methods: set[str], unrecorded: dict[str, int]) -> list[str]:
    """The lines under the table that say what the bench rows' mark means, and which side recorded no noise."""
    out = []
    if compared:
        conf = "/".join(f"{100 * c:g}%" for c in sorted(confidences))
        how = " ".join(x for x in (" and ".join(sorted(methods)) or "bootstrap", conf) if x)
        out.append(f"(within noise): the two bundles' {how} intervals of the figure, each over the level's "
                   "recorded requests, overlap, so the change may be chance; an unmarked bench change lies outside "
                   "the noise (the intervals do not overlap).")
    if unrecorded:
        sides = " and the ".join(side for side in ("old", "new") if side in unrecorded)
        n = unrecorded["rows"]
        out.append(f"{n} bench change{'s' if n > 1 else ''} left unmarked: no noise recorded for "
                   f"{'them' if n > 1 else 'it'} in the {sides} bundle (benched before intervals were recorded, or a "
                   "level of one request); such a change may be chance.")
    return out


def diff(old: str, new: str) -> str:
    """A Markdown table of what changed between two bundles: the config first (the recipe of every stage), then
    the server benched on, size, accuracy, bench, versions. A bench change whose two recorded intervals overlap
    (each row's ``noise``, pipeline/stages/bench/noise.py) is marked ``(within noise)``; lines under the table say
    what the mark means and which bundle recorded no noise."""
    with store_errors(old, "reading the bundle"):
        _, _, a = open_manifest(old)
    with store_errors(new, "reading the bundle"):
        _, _, b = open_manifest(new)
    rows: list[tuple[str, Any, Any]] = [("version", a.get("version"), b.get("version"))]
    noise: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {}  # bench row -> each side's recorded noise
    ca, cb = effective_settings(a), effective_settings(b)
    for key in sorted(set(ca) | set(cb)):  # first: why two versions differ
        rows.append((f"config {key}", ca.get(key), cb.get(key)))
    sa, sb = a.get("served_by") or {}, b.get("served_by") or {}
    for key in ("launcher", "binary", "image", "version"):
        rows.append((f"server {key}", sa.get(key), sb.get(key)))
    rows += serving_rows(a, b)
    rows += [
        ("bytes", sum(f["size"] for f in a.get("files", [])), sum(f["size"] for f in b.get("files", []))),
        ("quant_algo", _get(a, "quant", "quant_algo"), _get(b, "quant", "quant_algo")),
        ("kv_cache_quant_algo", _get(a, "quant", "kv_cache_quant_algo"), _get(b, "quant", "kv_cache_quant_algo")),
    ]
    # quant.recipe (bundle.json's quant.recipe; "-": the format's own preset): which ModelOpt recipe, its
    # calibration and what it leaves unquantized beyond the format's preset
    for key, field in (("name", "quant recipe"), ("algorithm", "quant recipe calibration"),
                       ("partial", "quant recipe leaves unquantized")):
        va, vb = (_get(d, "quant", "recipe", key) for d in (a, b))
        rows.append((field, *((", ".join(v) or None) if isinstance(v, list) else v for v in (va, vb))))
    for key in ("kl_mean", "top1_agreement", "ppl_ratio"):
        rows.append((f"accuracy {key}", _get(a, "accuracy", "quantized_vs_unquantized", key),
                     _get(b, "accuracy", "quantized_vs_unquantized", key)))
    for w in sorted(set(_get(a, "bench", "workloads") or {}) | set(_get(b, "bench", "workloads") or {})):
        old_rows = {r["concurrency"]: r for r in _get(a, "bench", "workloads", w) or []}
        new_rows = {r["concurrency"]: r for r in _get(b, "bench", "workloads", w) or []}
        for c in sorted(set(old_rows) | set(new_rows)):
            ro, rn = old_rows.get(c) or {}, new_rows.get(c) or {}
            for key in BENCH_FIGURES:
                rows.append((f"{w} c={c} {key}", ro.get(key), rn.get(key)))
                noise[f"{w} c={c} {key}"] = (ro.get("noise") or {}, rn.get("noise") or {}, key)
    for task in sorted(set(_get(a, "eval", "tasks") or {}) | set(_get(b, "eval", "tasks") or {})):
        for key in ("baseline", "quantized", "difference", "ci_low", "items", "verdict"):
            rows.append((f"task {task} {key}", _get(a, "eval", "tasks", task, key), _get(b, "eval", "tasks", task, key)))
    rows.append(("lm-eval version", _get(a, "eval", "lm_eval"), _get(b, "eval", "lm_eval")))
    for key in ("tensorrt_llm", "tensorrt", "cuda", "driver", "torch", "transformers", "container"):
        rows.append((f"{key} version", _get(a, "runtime_versions", key), _get(b, "runtime_versions", key)))
    rows.append(("pipeline", _get(a, "provenance", "pipeline"), _get(b, "provenance", "pipeline")))
    lines = ["| field | old | new | change |", "|---|---|---|---|"]
    compared, confidences, methods = False, set(), set()  # bench changes held against the noise, and its kind
    unrecorded: dict[str, int] = {}  # rows: bench changes left unmarked; old/new: a side lacking noise
    for name, o, n in rows:
        if _plain(o) == _plain(n):
            continue
        change = ""
        numbers = isinstance(o, (int, float)) and isinstance(n, (int, float)) and not isinstance(o, bool)
        if numbers and name.startswith("task ") and name.rsplit(" ", 1)[-1] in ABSOLUTE:
            change = f"{n - o:+.4g}"  # a score, a difference or an interval bound: the change is absolute
        elif numbers and o and not name.startswith("config "):
            change = f"{100 * (n / o - 1):+.1f}%"
            if name in noise:  # a bench figure: within or outside the noise the two benches measured
                no, nn, key = noise[name]
                within = within_noise(no.get(key), nn.get(key))
                if within is None:
                    unrecorded["rows"] = unrecorded.get("rows", 0) + 1
                    for side, rec in (("old", no), ("new", nn)):
                        if within_noise(rec.get(key), rec.get(key)) is None:
                            unrecorded[side] = 1
                else:
                    compared = True
                    confidences |= {x["confidence"] for x in (no, nn) if isinstance(x.get("confidence"), (int, float))}
                    methods |= {x["method"] for x in (no, nn) if isinstance(x.get("method"), str)}
                    if within:
                        change += " (within noise)"
        fmt = lambda v: "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
        lines.append(f"| {name} | {fmt(o)} | {fmt(n)} | {change} |")
    if len(lines) == 2:
        lines.append("| (no differences) | | | |")
    notes = _noise_notes(compared, confidences, methods, unrecorded)
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"
