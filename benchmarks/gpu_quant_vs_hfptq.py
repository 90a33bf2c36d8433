"""The pipeline's quantize stage against ModelOpt's own example flow (``examples/hf_ptq/hf_ptq.py``), side by side.

    python benchmarks/gpu_quant_vs_hfptq.py --root /data/q32 --hf-ptq DIR --step prepare   # checkpoint, rows, build
    python benchmarks/gpu_quant_vs_hfptq.py --root /data/q32 --hf-ptq DIR --step ours      # the quantize stage
    python benchmarks/gpu_quant_vs_hfptq.py --root /data/q32 --hf-ptq DIR --step hfptq     # hf_ptq.py, unchanged
    python benchmarks/gpu_quant_vs_hfptq.py --root /data/q32 --step render --out-dir DIR   # JSON + docs section
    (--step all runs the four in order; every step skips what an earlier run under the same --root completed)

Same model, same calibration rows, same format, same GPU:

- ``prepare``: the pipeline's fetch stage generates the synthetic checkpoint (``--shape 32b``: Qwen3-32B's shape,
  ``benchmarks/gpu_e2e.py`` SHAPES; ``tiny``: the tiny-qwen3 test model), the stage's own calibration rows are
  decoded to text, one row per line of a ``{"text": ...}`` JSONL file (hf_ptq's ``--dataset`` accepts a local
  ``.jsonl``, read without network by ``modelopt.torch.utils.dataset_utils.get_dataset_samples``), and how many of them
  re-tokenize to the identical row is recorded. Then ModelOpt's CUDA extensions are compiled once
  (``modelopt.torch.quantization.extensions.precompile``), timed on their own: both runs below load them compiled.
- ``ours``: ``python -m pipeline build ... until=quantize force=[quantize]`` (fp8 weights, fp8 KV cache), one
  process; its steps from accuracy.json's ``timings_s``.
- ``hfptq``: ``hf_ptq.py --pyt_ckpt_path CKPT --qformat fp8 --kv_cache_qformat fp8 --dataset ROWS.jsonl
  --calib_size N --calib_seq L --export_path DIR`` run from ``--hf-ptq DIR`` unchanged: a wrapper imports it as a
  module, times its step functions (load_model, get_max_batch_size, make_calib_dataloader, pre_quantize,
  mono_quantize, post_quantize, export_quantized) by wrapping them in its namespace, then runs its ``__main__``
  block. Its default flow is kept (batch size probed, preview generation before and after quantization: its
  evaluation); ``--hfptq-arg`` adds flags.
- For both: wall time; torch ``max_memory_allocated`` at exit; nvidia-smi's peak (sampled every 250 ms, all
  processes); the process tree's peak RSS, and its peak anonymous RSS (without the memory-mapped checkpoint pages,
  which are the kernel's page cache).
- ``render``: the raw JSON to ``--out-dir`` and a section in docs/benchmarks.md: stage time / hf_ptq time (the
  extension build in neither) and peaks / bf16 weight bytes.

Each step writes ``ROOT/<step>.json``; exports are deleted after they are measured (``--keep-exports`` keeps them),
so that the bf16 checkpoint and one export fit on disk at a time.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docfile import prepend  # noqa: E402
from gpu_e2e import SHAPES, WRAPPER, SmiSampler, commit, gpu_info, overrides  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30
STEPS = ("prepare", "ours", "hfptq", "render")
FORMAT, KV, TARGET = "fp8", "fp8", "h200"
# hf_ptq.py functions timed, in call order; post_quantize contains export_quantized
HFPTQ_STEPS = ("load_model", "get_max_batch_size", "make_calib_dataloader", "pre_quantize", "mono_quantize",
               "post_quantize", "export_quantized")

# Runs hf_ptq.py unchanged: imports it as a module (its __main__ block does not run on import), wraps the step
# functions in its namespace (its own calls look them up there), runs its __main__ block, and records each call's
# start and end (perf_counter, relative to process start) and the torch CUDA peak at exit.
HFPTQ_WRAPPER = r"""
import ast, atexit, functools, json, os, sys, time
T0 = time.perf_counter()
events = []
def _dump():
    out = {"events": events, "exit_s": time.perf_counter() - T0, "max_memory_allocated": 0, "max_memory_reserved": 0}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        out["max_memory_reserved"] = torch.cuda.max_memory_reserved()
    with open(os.environ["HFPTQ_EVENTS"], "w") as f:
        json.dump(out, f)
atexit.register(_dump)
here = os.environ["HFPTQ_DIR"]
sys.path.insert(0, here)
sys.argv = [os.path.join(here, "hf_ptq.py"), *sys.argv[1:]]
import hf_ptq
events.append({"name": "import", "start": 0.0, "end": time.perf_counter() - T0})
def _timed(name, fn):
    @functools.wraps(fn)
    def inner(*a, **k):
        start = time.perf_counter() - T0
        try:
            return fn(*a, **k)
        finally:
            events.append({"name": name, "start": start, "end": time.perf_counter() - T0})
    return inner
for name in os.environ["HFPTQ_STEPS"].split(","):
    if hasattr(hf_ptq, name):
        setattr(hf_ptq, name, _timed(name, getattr(hf_ptq, name)))
src = open(hf_ptq.__file__).read()
tree = ast.parse(src)
main = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
if len(main) != 1:
    raise SystemExit("hf_ptq.py: no single `if __name__ == '__main__':` block")
exec(compile(ast.Module(body=main[0].body, type_ignores=[]), hf_ptq.__file__, "exec"), hf_ptq.__dict__)
"""


# ----------------------------------------------------------------------------------------------------- measuring
class HostSampler:
    """Peak RSS and peak anonymous RSS (bytes) of a process and its children, sampled from /proc every 250 ms."""

    def __init__(self, pid: int, interval: float = 0.25):
        self.pid, self.interval = pid, interval
        self.peak_rss = self.peak_anon = 0
        self._stop = threading.Event()

    @staticmethod
    def _status(pid: int) -> tuple[int, int]:
        rss = anon = 0
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss = int(line.split()[1]) * 1024
                    elif line.startswith("RssAnon:"):
                        anon = int(line.split()[1]) * 1024
        except OSError:
            pass
        return rss, anon

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                pids = [self.pid] + [c.pid for c in psutil.Process(self.pid).children(recursive=True)]
            except psutil.Error:
                pids = [self.pid]
            vals = [self._status(p) for p in pids]
            self.peak_rss = max(self.peak_rss, sum(v[0] for v in vals))
            self.peak_anon = max(self.peak_anon, sum(v[1] for v in vals))
            self._stop.wait(self.interval)

    def __enter__(self) -> "HostSampler":
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(5)


class _NoSmi:
    peak_mib, baseline_mib, samples = None, None, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def measure(cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> dict[str, Any]:
    """Run ``cmd``, sampling nvidia-smi (when there is one) and the host memory of its process tree."""
    smi = SmiSampler() if shutil.which("nvidia-smi") else _NoSmi()
    t0 = time.perf_counter()
    with smi, open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=out, text=True)
        with HostSampler(proc.pid) as host:
            stdout, _ = proc.communicate()
    wall = time.perf_counter() - t0
    return {"returncode": proc.returncode, "process_s": round(wall, 2), "stdout": stdout,
            "nvidia_smi_peak_gib": None if smi.peak_mib is None else round(smi.peak_mib / 1024, 2),
            "nvidia_smi_before_gib": None if smi.baseline_mib is None else round(smi.baseline_mib / 1024, 2),
            "nvidia_smi_samples": smi.samples, "host_peak_rss_gib": round(host.peak_rss / GIB, 2),
            "host_peak_anon_rss_gib": round(host.peak_anon / GIB, 2)}


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **extra,
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}


# ------------------------------------------------------------------------------------------------------- the runs
def pipeline_overrides(shape: str) -> list[str]:
    if shape == "tiny":
        return ["model=tiny-qwen3", f"quant={FORMAT}", f"quant.kv_cache={KV}", "quant.gate=warn",
                "runtime=reference", "target=cpu"]
    return overrides(shape, FORMAT, TARGET)


def fetch_dir(root: Path) -> Path:
    found = [p for p in (root / ".store").glob("*-fetch-*") if p.is_dir() and (p / "config.json").is_file()]
    if len(found) != 1:
        raise SystemExit(f"expected one fetched checkpoint under {root}/.store, found {len(found)}")
    return found[0]


def quantize_dir(root: Path) -> Path:
    found = sorted((p for p in (root / ".store").glob("*quantize-*") if (p / "accuracy.json").is_file()),
                   key=lambda p: (p / "accuracy.json").stat().st_mtime)
    if not found:
        raise SystemExit(f"no quantize output with accuracy.json under {root}/.store")
    return found[-1]


def weight_bytes(ckpt: Path) -> int:
    """Bytes of the checkpoint's tensors (its safetensors shards)."""
    return sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))


def calib_rows_jsonl(shape: str, root: Path, out: Path) -> dict[str, Any]:
    """The quantize stage's own calibration rows, decoded to text one row per line; and how many re-tokenize (as
    hf_ptq's data loader tokenizes: padding, truncation at the row length) to the identical row."""
    from transformers import AutoTokenizer

    from pipeline import calib, config

    cfg = config.compose(pipeline_overrides(shape))
    q = cfg.quant
    tok = AutoTokenizer.from_pretrained(fetch_dir(root))
    rows = calib.rows(tok, calib.resolve(q.calib.dataset, cfg.model.source), seq_len=q.calib.seq_len,
                      num_samples=q.calib.num_samples, chat_template=bool(q.calib.chat_template),
                      allow_short=bool(q.calib.allow_short), eval_seq_len=q.eval.seq_len,
                      eval_num_samples=q.eval.num_samples).calib
    texts = [tok.decode(r.tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False) for r in rows]
    out.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    seq = int(rows.shape[1])
    enc = tok(texts, truncation=True, max_length=seq)["input_ids"]
    same = sum(list(e) == r.tolist() for e, r in zip(enc, rows))
    return {"rows": len(texts), "seq_len": seq, "jsonl": str(out), "identical_after_retokenizing": same,
            "retokenized_lengths": sorted({len(e) for e in enc})}


def step_prepare(a, root: Path) -> dict[str, Any]:
    log_dir = root / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pipeline", "build", "--json", *pipeline_overrides(a.shape), "until=fetch",
           f"paths.root={root}"]
    print(f"[quant_vs_hfptq] fetch ({a.shape}) ...", flush=True)
    r = measure(cmd, _env(), root, log_dir / "fetch.stderr.log")
    if r["returncode"]:
        raise SystemExit(f"fetch failed (rc {r['returncode']}); see {log_dir / 'fetch.stderr.log'}")
    summary = _summary(r)
    row = next(s for s in summary["stages"] if s["stage"] == "fetch")
    ckpt = fetch_dir(root)
    out = {"shape": a.shape, "fetch": {**r, "stage_s": row["stage_wall_s"], "status": row["status"],
                                       "generated_on": (row.get("result") or {}).get("generated_on")},
           "checkpoint": str(ckpt), "weight_bytes": weight_bytes(ckpt)}
    print("[quant_vs_hfptq] calibration rows ...", flush=True)
    out["calibration"] = calib_rows_jsonl(a.shape, root, root / "calib_rows.jsonl")
    print("[quant_vs_hfptq] ModelOpt CUDA extensions (compiled once, outside both runs) ...", flush=True)
    r = measure([sys.executable, "-c", "from modelopt.torch.quantization.extensions import precompile; precompile()"],
                _env(), root, log_dir / "extensions.log")
    r.pop("stdout")
    out["extension_build"] = r
    return out


def _summary(r: dict[str, Any]) -> dict[str, Any]:
    stdout = r.pop("stdout")
    return json.loads(stdout[stdout.index("{"):])


def step_ours(a, root: Path) -> dict[str, Any]:
    log_dir = root / "logs"
    peak_file = root / ".torch-peak-ours.json"
    peak_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-c", WRAPPER, "build", "--json", *pipeline_overrides(a.shape), "until=quantize",
           "force=[quantize]", f"paths.root={root}"]
    print("[quant_vs_hfptq] the pipeline's quantize stage ...", flush=True)
    r = measure(cmd, _env(GPU_E2E_TORCH_PEAK=str(peak_file)), root, log_dir / "ours.stderr.log")
    out: dict[str, Any] = {"command": cmd[3:]}
    if peak_file.is_file():
        peak = json.loads(peak_file.read_text())
        out["torch_peak_gib"] = round(peak["max_memory_allocated"] / GIB, 2)
        out["torch_reserved_gib"] = round(peak["max_memory_reserved"] / GIB, 2)
    if r["returncode"]:
        r.pop("stdout")
        out.update(r, error=(log_dir / "ours.stderr.log").read_text()[-3000:])
        return out
    summary = _summary(r)
    row = next(s for s in summary["stages"] if s["stage"] == "quantize")
    qdir = quantize_dir(root)
    acc = json.loads((qdir / "accuracy.json").read_text())
    stage_peak = (acc.get("gpu_memory") or {}).get("torch_peak_bytes")
    if stage_peak is not None:  # the stage resets torch's peak counter per step and keeps the process's peak itself
        out["torch_peak_gib"] = max(out.get("torch_peak_gib") or 0, round(stage_peak / GIB, 2))
    out.update(r, stage_s=row["stage_wall_s"], status=row["status"], pipeline_peak_rss_gib=round(
        (row["peak_rss_mb"] or 0) / 1024, 2), steps_s=acc.get("timings_s"),
        export_check_parts_s=acc.get("export_check_parts_s"), gpu_memory=acc.get("gpu_memory"),
        batch_size=acc.get("batch_size"), calibration=acc.get("calibration"),
        export_check=(acc.get("accuracy") or {}).get("export_check"), gate=(acc.get("accuracy") or {}).get("gate"),
        export_bytes=weight_bytes(qdir / "checkpoint"), quant_algo=acc.get("quant_algo"),
        kv_cache_quant_algo=acc.get("kv_cache_quant_algo"))
    if not a.keep_exports:
        for p in (qdir / "checkpoint").glob("*.safetensors"):
            p.unlink()
    return out


def hfptq_steps(events: list[dict[str, float]], exit_s: float) -> dict[str, float]:
    """Seconds per step of hf_ptq.py from its wrapped calls: each call's own time (nested calls subtracted);
    ``other`` is the rest of the process (argument parsing, distributed setup, the memory monitor, atexit)."""
    own: dict[str, float] = {}
    for e in events:
        inner = sum(f["end"] - f["start"] for f in events if f is not e and f["start"] >= e["start"]
                    and f["end"] <= e["end"] and not any(g is not e and g is not f and g["start"] >= e["start"]
                                                         and g["end"] <= e["end"] and g["start"] <= f["start"]
                                                         and f["end"] <= g["end"] for g in events))
        own[e["name"]] = own.get(e["name"], 0.0) + (e["end"] - e["start"]) - inner
    tops = [e for e in events if not any(f is not e and f["start"] <= e["start"] and e["end"] <= f["end"]
                                         for f in events)]
    own["other"] = exit_s - sum(e["end"] - e["start"] for e in tops)
    return {k: round(v, 3) for k, v in own.items()}


# hf_ptq's steps by the names the pipeline's stage uses
HFPTQ_LABELS = {"import": "imports", "load_model": "load", "get_max_batch_size": "batch-size probe",
                "make_calib_dataloader": "calibration data", "pre_quantize": "evaluation (preview before)",
                "mono_quantize": "calibrate", "post_quantize": "evaluation (quant summary, preview after)",
                "export_quantized": "export", "other": "other"}


def step_hfptq(a, root: Path) -> dict[str, Any]:
    prep = json.loads((root / "prepare.json").read_text())
    hf_dir = Path(a.hf_ptq).resolve()
    if not (hf_dir / "hf_ptq.py").is_file():
        raise SystemExit(f"--hf-ptq {hf_dir}: no hf_ptq.py there")
    export = root / "hfptq_export"
    shutil.rmtree(export, ignore_errors=True)
    events_file = root / ".hfptq-events.json"
    events_file.unlink(missing_ok=True)
    c = prep["calibration"]
    args = ["--pyt_ckpt_path", prep["checkpoint"], "--qformat", FORMAT, "--kv_cache_qformat", KV,
            "--dataset", c["jsonl"], "--calib_size", str(c["rows"]), "--calib_seq", str(c["seq_len"]),
            "--export_path", str(export), *a.hfptq_arg]
    cmd = [sys.executable, "-c", HFPTQ_WRAPPER, *args]
    print(f"[quant_vs_hfptq] hf_ptq.py {' '.join(args)} ...", flush=True)
    r = measure(cmd, _env(HFPTQ_DIR=str(hf_dir), HFPTQ_EVENTS=str(events_file), HFPTQ_STEPS=",".join(HFPTQ_STEPS)),
                root, root / "logs" / "hfptq.log")
    stdout = r.pop("stdout")
    (root / "logs" / "hfptq.stdout.log").write_text(stdout)
    out: dict[str, Any] = {"args": args, "hf_ptq_dir": str(hf_dir), **r,
                           "upstream_commit": _read(hf_dir / "UPSTREAM_COMMIT")}
    batch = [ln for ln in stdout.splitlines() if ln.startswith("Use calib batch_size")]
    out["batch_size"] = int(batch[-1].split()[-1]) if batch else None
    if events_file.is_file():
        ev = json.loads(events_file.read_text())
        out["steps_s"] = hfptq_steps(ev["events"], ev["exit_s"])
        out["torch_peak_gib"] = round(ev["max_memory_allocated"] / GIB, 2)
        out["torch_reserved_gib"] = round(ev["max_memory_reserved"] / GIB, 2)
    if r["returncode"]:
        out["error"] = (root / "logs" / "hfptq.log").read_text()[-3000:]
        return out
    cfg = export / "hf_quant_config.json"
    if cfg.is_file():
        q = json.loads(cfg.read_text()).get("quantization", {})
        out.update(quant_algo=q.get("quant_algo"), kv_cache_quant_algo=q.get("kv_cache_quant_algo"))
    out["export_bytes"] = weight_bytes(export)
    if not a.keep_exports:
        for p in export.glob("*.safetensors"):
            p.unlink()
    return out


def _read(p: Path) -> str | None:
    return p.read_text().strip() if p.is_file() else None


# ------------------------------------------------------------------------------------------------------- results
def compare(prep: dict[str, Any], ours: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """The verdicts: stage time / hf_ptq time (the extension build is in neither: it was compiled before both),
    and each run's peaks over the bf16 weight bytes."""
    w = prep["weight_bytes"]

    def peaks(r: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key in ("torch_peak_gib", "nvidia_smi_peak_gib"):
            if r.get(key) is not None:
                out[key.replace("_gib", "_over_weights")] = round(r[key] * GIB / w, 3)
        for key in ("host_peak_rss_gib", "host_peak_anon_rss_gib"):
            if r.get(key) is not None:
                out[key.replace("_gib", "_over_weights")] = round(r[key] * GIB / w, 3)
        return out

    ours_s = ours.get("stage_s")
    hf_s = hf.get("process_s")
    ok = not ours.get("returncode") and not hf.get("returncode") and ours_s and hf_s
    out = {"weights_gib": round(w / GIB, 2), "ours_stage_s": ours_s, "ours_process_s": ours.get("process_s"),
           "hfptq_process_s": hf_s, "time_ratio": round(ours_s / hf_s, 3) if ok else None,
           "time_ratio_process": round(ours["process_s"] / hf_s, 3) if ok else None,
           "ours": peaks(ours), "hfptq": peaks(hf)}
    out["time_within_1_2x"] = out["time_ratio"] is not None and out["time_ratio"] <= 1.2
    o = out["ours"]
    out["memory_within_1_1x"] = (o.get("torch_peak_over_weights") is not None and o["torch_peak_over_weights"] <= 1.1
                                 and o.get("nvidia_smi_peak_over_weights") is not None
                                 and o["nvidia_smi_peak_over_weights"] <= 1.1)
    return out


def _short(arg: str) -> str:
    """A path argument by its last component (the runs' directories are the machine's)."""
    return f"…/{Path(arg).name}" if arg.startswith("/") else arg


def _cell(v: Any, fmt: str = "{:.1f}") -> str:
    return "—" if v is None else (fmt.format(v) if isinstance(v, (int, float)) else str(v))


def render(doc: dict[str, Any]) -> str:
    prep, ours, hf, cmp = doc["prepare"], doc["ours"], doc["hfptq"], doc["compare"]
    c = prep["calibration"]
    gpu = doc["gpu"].get("name")
    lines = [f"## The quantize stage vs ModelOpt's hf_ptq.py at the {prep['shape']} shape "
             f"(`benchmarks/gpu_quant_vs_hfptq.py`)", "",
             f"{doc['date'][:16]} UTC, commit {doc.get('commit') or '?'}, {gpu}; synthetic weights "
             f"({cmp['weights_gib']} GiB in bf16), fp8 weights + fp8 KV cache, {c['rows']} calibration rows × "
             f"{c['seq_len']} tokens, the same rows for both ({c['identical_after_retokenizing']} of {c['rows']} "
             f"re-tokenize to the identical row from the JSONL given to hf_ptq). hf_ptq.py at NVIDIA/Model-Optimizer "
             f"{(hf.get('upstream_commit') or '?')[:9]}, run unchanged with its default flow "
             f"(`hf_ptq.py {' '.join(_short(a) for a in hf.get('args', []))}`). ModelOpt's CUDA extensions "
             f"were compiled once before both runs ({_cell(prep['extension_build'].get('process_s'))} s), so "
             f"neither time includes the build.", "",
             "| | time s | torch peak GiB (× weights) | nvidia-smi peak GiB (× weights) | host peak RSS GiB | "
             "host peak anonymous RSS GiB | batch size |", "|---|---|---|---|---|---|---|"]
    for name, r, key, t in (("pipeline quantize stage", ours, "ours", ours.get("stage_s")),
                            ("hf_ptq.py", hf, "hfptq", hf.get("process_s"))):
        p = cmp[key]
        lines.append(f"| {name} | {_cell(t)} | {_cell(r.get('torch_peak_gib'), '{:.2f}')} "
                     f"({_cell(p.get('torch_peak_over_weights'), '{:.2f}')}×) | "
                     f"{_cell(r.get('nvidia_smi_peak_gib'), '{:.2f}')} "
                     f"({_cell(p.get('nvidia_smi_peak_over_weights'), '{:.2f}')}×) | "
                     f"{_cell(r.get('host_peak_rss_gib'), '{:.1f}')} | "
                     f"{_cell(r.get('host_peak_anon_rss_gib'), '{:.1f}')} | "
                     f"{_cell(r.get('batch_size'), '{}')} |")
    lines += ["", f"- **time: stage / hf_ptq = {_cell(cmp['time_ratio'], '{:.2f}')}×** (target ≤ 1.2×: "
                  f"{'met' if cmp['time_within_1_2x'] else 'not met'}); by process wall time "
                  f"{_cell(cmp['time_ratio_process'], '{:.2f}')}×.",
              f"- **GPU memory of the stage: {_cell(cmp['ours'].get('torch_peak_over_weights'), '{:.2f}')}× the "
              f"weights (torch), {_cell(cmp['ours'].get('nvidia_smi_peak_over_weights'), '{:.2f}')}× (nvidia-smi)** "
              f"(target ≤ 1.1× in both: {'met' if cmp['memory_within_1_1x'] else 'not met'}).",
              "- Host RSS counts the memory-mapped checkpoint pages (the kernel's page cache); the anonymous RSS "
              "is the memory the process owns.", ""]
    os_ = ours.get("steps_s") or {}
    lines += ["Steps (s). The stage: " + ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in os_.items())
              + (" (export check: " + ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in
                                                 (ours.get("export_check_parts_s") or {}).items()) + ")"
                 if ours.get("export_check_parts_s") else "") + ".",
              "hf_ptq.py: " + ", ".join(f"{HFPTQ_LABELS.get(k, k)} {v:.1f}" for k, v in
                                        (hf.get("steps_s") or {}).items()) + "."]
    for name, r in (("stage", ours), ("hf_ptq.py", hf)):
        if r.get("returncode"):
            last = ((r.get("error") or "").strip().splitlines() or ["(no output)"])[-1]
            lines.append(f"- {name} failed (rc {r['returncode']}): `{last}`")
    return "\n".join(lines) + "\n"


def step_render(a, root: Path) -> dict[str, Any]:
    if a.from_json:  # a recorded run: its section again (into --doc)
        section = render(json.loads(Path(a.from_json).read_text()))
        if a.doc:
            prepend(section, Path(a.doc))
        print(section)
        return {"rendered": a.from_json}
    prep = json.loads((root / "prepare.json").read_text())
    ours = json.loads((root / "ours.json").read_text())
    hf = json.loads((root / "hfptq.json").read_text())
    doc = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
           "host": {"hostname": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count()},
           "gpu": gpu_info(), "prepare": prep, "ours": ours, "hfptq": hf, "compare": compare(prep, ours, hf)}
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = doc["date"][:10].replace("-", "")
    path = out_dir / f"gpu_quant_vs_hfptq-{stamp}-{prep['shape']}.json"
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    section = render(doc)
    (out_dir / f"gpu_quant_vs_hfptq-{stamp}-{prep['shape']}.md").write_text(section)
    if a.doc:
        prepend(section, Path(a.doc))
    print(section)
    return {"json": str(path), "compare": doc["compare"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step", choices=(*STEPS, "all"), default="all")
    ap.add_argument("--root", type=Path, required=True, help="working directory (kept between steps)")
    ap.add_argument("--shape", choices=(*sorted(SHAPES), "tiny"), default="32b")
    ap.add_argument("--hf-ptq", help="directory holding ModelOpt's examples/hf_ptq files (hf_ptq.py, example_utils.py)")
    ap.add_argument("--hfptq-arg", action="append", default=[], help="an extra hf_ptq.py argument (repeatable)")
    ap.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"), help="raw JSON and the section")
    ap.add_argument("--doc", help="also prepend the section to this markdown file (docs/benchmarks.md)")
    ap.add_argument("--from-json", help="render: the section of this recorded result file (no run, no GPU needed)")
    ap.add_argument("--keep-exports", action="store_true", help="keep both exports' safetensors")
    ap.add_argument("--redo", action="store_true", help="run the step even when ROOT/<step>.json says it ran")
    a = ap.parse_args()
    a.root = a.root.resolve()
    a.root.mkdir(parents=True, exist_ok=True)
    steps = STEPS if a.step == "all" else (a.step,)
    if "hfptq" in steps and not a.hf_ptq:
        ap.error("--hf-ptq DIR is needed for the hfptq step")
    rc = 0
    for step in steps:
        done = a.root / f"{step}.json"
        if step != "render" and done.is_file() and not a.redo and not json.loads(done.read_text()).get("returncode"):
            print(f"[quant_vs_hfptq] {step}: done earlier ({done})", flush=True)
            continue
        t0 = time.perf_counter()
        run = {"prepare": step_prepare, "ours": step_ours, "hfptq": step_hfptq, "render": step_render}[step]
        result = run(a, a.root)
        if step != "render":
            done.write_text(json.dumps(result, indent=2, default=str) + "\n")
        brief = {k: v for k, v in result.items() if k not in ("error", "calibration", "gpu_memory")}
        print(f"[quant_vs_hfptq] {step}: {time.perf_counter() - t0:.1f} s; {json.dumps(brief, default=str)[:1500]}",
              flush=True)
        if result.get("returncode"):
            print(result.get("error", ""), flush=True)
            rc = 1
            break
    sys.exit(rc)


if __name__ == "__main__":
    main()
