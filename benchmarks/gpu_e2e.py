"""The whole pipeline on one CUDA machine, stage by stage, at real model shapes (synthetic weights).

    python -m benchmarks gpu_e2e --shape 4b --run fp8:h200 --run nvfp4:b200 --root /data/e2e --out $OUT
    python -m benchmarks gpu_e2e render benchmarks/results/gpu_e2e-*.json   # the markdown rows of those records

Each run is ``python -m pipeline build`` for a seeded random Qwen3 model of the given shape (``--shape 4b`` is
Qwen3-4B's, ``32b`` Qwen3-32B's; the vocabulary is the synthetic tokenizer's), quantized to FORMAT for TARGET
(``nvfp4:b200`` calibrates NVFP4 here, on Hopper, for Blackwell), built with the reference runtime on CUDA, packaged,
benched on a real Triton server and published. Each stage runs in its own process (``until=STAGE``; earlier stages
are cached), so that every stage gets its own numbers:

- ``stage_s``: the stage's wall time as the pipeline records it (``stage_wall_s``), and the process's wall time;
- ``torch_peak_gib``: ``torch.cuda.max_memory_allocated()`` of the pipeline's process at its exit (the bench stage's
  model runs inside Triton's python stub, another process: nvidia-smi sees it, torch's counter does not);
- ``nvidia_smi_peak_gib``: the most GPU memory in use, sampled by ``nvidia-smi -lms 250`` while the stage ran (all
  processes, minus what was in use before);
- ``host_peak_rss_gib``: the pipeline's own peak RSS of the stage (process and children).

A run that does not reach ``--until`` is recorded with its error and the rest continue; the record then states an
``error`` (exit status 1) and is not the page's current figure. What ran so far is also kept in
``ROOT/gpu_e2e-partial.json`` after every stage (it survives a kill). ``--until quantize`` measures the quantize stage
alone. The page keeps one current record per set of shape × format→target runs.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks._instrument import REPO

TITLE = "The whole pipeline on one GPU"
STAGES = ["fetch", "quantize", "build", "package", "bench", "publish"]
GIB = 2**30

SHAPES = {  # Qwen3-4B / -14B / -32B config.json values (the vocabulary is the synthetic tokenizer's)
    "4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True, "params_b": 4.0},
    "14b": {"hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40, "num_attention_heads": 40,
            "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False, "params_b": 14.8},
    "32b": {"hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False, "params_b": 32.8},
}
BENCH = ["bench.concurrency=[1,4]", "bench.requests_per_level=8", "bench.warmup_requests=2",
         "bench.workloads.chat.max_tokens=32", "bench.workloads.rag.prompt_words=300",
         "bench.workloads.rag.max_tokens=8"]

# Runs the pipeline's CLI and, at exit, records the process's torch CUDA peak (to the file GPU_E2E_TORCH_PEAK names).
WRAPPER = """
import atexit, json, os, runpy, sys
def _dump():
    out = {"max_memory_allocated": 0, "max_memory_reserved": 0}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out = {"max_memory_allocated": torch.cuda.max_memory_allocated(),
               "max_memory_reserved": torch.cuda.max_memory_reserved()}
    with open(os.environ["GPU_E2E_TORCH_PEAK"], "w") as f:
        json.dump(out, f)
atexit.register(_dump)
sys.argv = ["pipeline", *sys.argv[1:]]
runpy.run_module("pipeline", run_name="__main__", alter_sys=True)
"""


def calib_overrides(rows: int | None = None, seq: int | None = None, text: str | None = None) -> list[str]:
    """The calibration size and text (the synthetic model's own default is the shipped corpus's 24 × 128)."""
    out = [f"quant.calib.num_samples={rows}"] if rows else []
    out += [f"quant.calib.seq_len={seq}"] if seq else []
    return out + ([f"quant.calib.dataset={Path(text).resolve()}"] if text else [])


def overrides(shape: str, fmt: str, target: str) -> list[str]:
    s = SHAPES[shape]
    cfg = {k: v for k, v in s.items() if k != "params_b"}
    out = ["model=tiny-qwen3", f"model.name=qwen3-{shape}-synthetic", "model.synthetic.tokenizer_vocab=65536",
           "model.synthetic.config.initializer_range=0.02", "model.synthetic.config.max_position_embeddings=40960"]
    out += [f"model.synthetic.config.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in cfg.items()]
    out += [f"model.shape.params_b={s['params_b']}", f"model.shape.num_layers={s['num_hidden_layers']}",
            f"model.shape.hidden_size={s['hidden_size']}", f"model.shape.intermediate_size={s['intermediate_size']}",
            f"model.shape.num_heads={s['num_attention_heads']}", f"model.shape.num_kv_heads={s['num_key_value_heads']}",
            f"model.shape.head_dim={s['head_dim']}", "model.shape.vocab_size=65536",
            f"model.shape.tie_word_embeddings={str(s['tie_word_embeddings']).lower()}"]
    # a random model's logits move more under quantization than real models' gates allow: report, do not fail
    # the synthetic tokenizer packs the shipped corpus into fewer rows than calib.num_samples asks for
    return out + [f"quant={fmt}", "quant.gate=warn", "quant.calib.allow_short=true", f"target={target}",
                  "runtime=reference", *BENCH]


class SmiSampler:
    """Peak GPU memory in use (MiB, summed over the visible GPUs) from ``nvidia-smi -lms``, while the block runs."""

    def __init__(self, interval_ms: int = 250):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        cmd = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits", f"-lms={interval_ms}"]
        if visible:
            cmd.insert(1, f"--id={visible}")
        self.cmd, self.peak_mib, self.samples, self.baseline_mib = cmd, 0.0, 0, None
        self.peak_by_gpu_mib: dict[str, float] = {}  # each GPU's own peak (a model split over several GPUs)

    def _read(self) -> None:
        current: dict[str, float] = {}
        for line in self.proc.stdout:
            try:
                idx, used = [x.strip() for x in line.split(",")]
                current[idx] = float(used)
            except ValueError:
                continue
            self.peak_by_gpu_mib[idx] = max(self.peak_by_gpu_mib.get(idx, 0.0), current[idx])
            total = sum(current.values())
            self.samples += 1
            if self.baseline_mib is None:
                self.baseline_mib = total
            self.peak_mib = max(self.peak_mib, total)

    def __enter__(self) -> "SmiSampler":
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()
        time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.5)
        self.proc.terminate()
        self.proc.wait(10)
        self.t.join(5)


def run_stage(args_: list[str], root: Path, stage: str, log_dir: Path) -> dict:
    peak_file = root / f".torch-peak-{stage}.json"
    peak_file.unlink(missing_ok=True)
    env = {**os.environ, "GPU_E2E_TORCH_PEAK": str(peak_file), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, "-c", WRAPPER, "build", "--json", *args_, f"until={stage}", f"paths.root={root}"]
    t0 = time.perf_counter()
    with SmiSampler() as smi:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (log_dir / f"{stage}.stderr.log").write_text(proc.stderr)
    out = {"stage": stage, "returncode": proc.returncode, "process_s": round(wall, 1),
           "nvidia_smi_peak_gib": round(smi.peak_mib / 1024, 2),
           "nvidia_smi_peak_by_gpu_gib": {k: round(v / 1024, 2) for k, v in smi.peak_by_gpu_mib.items()},
           "nvidia_smi_before_gib": round((smi.baseline_mib or 0) / 1024, 2),
           "nvidia_smi_samples": smi.samples}
    if peak_file.is_file():
        peak = json.loads(peak_file.read_text())
        out["torch_peak_gib"] = round(peak["max_memory_allocated"] / GIB, 2)
        out["torch_reserved_gib"] = round(peak["max_memory_reserved"] / GIB, 2)
    if proc.returncode != 0:
        out["error"] = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1][:2000]
        out["stderr_tail"] = proc.stderr[-4000:]
        return out
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    row = next(r for r in summary["stages"] if r["stage"] == stage)
    out.update(status=row["status"], stage_s=row["stage_wall_s"], host_peak_rss_gib=round(
        (row["peak_rss_mb"] or 0) / 1024, 2), bytes=row["bytes"])
    res = row.get("result") or {}
    if stage == "fetch":
        out["fetch"] = {k: res.get(k) for k in ("params", "generated_on")}
    elif stage == "quantize":
        out["quantize"] = {k: res.get(k) for k in ("device", "batch_size", "timings_s", "quant_algo",
                                                   "bytes_per_param")}
        acc_files = sorted(root.glob(".store/*quantize-*/accuracy.json"), key=lambda p: p.stat().st_mtime)
        if acc_files:  # the batch bound and per-step GPU peaks are in accuracy.json, not the stage's result
            mem = out["quantize"]["gpu_memory"] = json.loads(acc_files[-1].read_text()).get("gpu_memory") or {}
            if mem.get("torch_peak_bytes") is not None:  # the stage resets torch's peak counter per step
                out["torch_peak_gib"] = max(out.get("torch_peak_gib") or 0, round(mem["torch_peak_bytes"] / GIB, 2))
        acc = res.get("accuracy") or {}
        out["quantize"]["export_check"] = acc.get("export_check")
        out["quantize"]["gate"] = acc.get("gate")
    elif stage == "build":
        builds = sorted(root.glob("engines/**/build.json"), key=lambda p: p.stat().st_mtime)
        rec = json.loads(builds[-1].read_text()) if builds else {}  # the device is in build.json, not the result
        out["build"] = {k: rec.get(k, res.get(k)) for k in ("device", "gpu_name", "check")}
    elif stage == "bench":
        out["bench"] = _bench_summary(res, summary)
    elif stage == "publish":
        out["published"] = summary.get("published")
    return out


def _bench_summary(res: dict, summary: dict) -> dict:
    """Per level: requests, errors, latency percentiles and throughput (the bench stage's summary rows, by
    workload)."""
    levels = [{"workload": w, **row} for w, rows in (res.get("workloads") or {}).items() for row in rows]
    return {"requests": sum(lv.get("request_count", 0) for lv in levels),
            "errors": sum(lv.get("error_count", 0) for lv in levels), "gate": (res.get("gates") or {}).get("verdict"),
            "levels": levels}


def gpu_info() -> dict:
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            return {"name": p.name, "sm": p.major * 10 + p.minor, "memory_gib": round(p.total_memory / GIB, 1),
                    "count": torch.cuda.device_count(), "torch": torch.__version__, "cuda": torch.version.cuda}
    except Exception as exc:  # recorded, not fatal: the runs say what failed
        return {"error": str(exc)}
    return {"name": None}


def variant(record: dict) -> str:
    return ", ".join(f"{r['shape']} {r['format']}→{r['target']}" for r in record["runs"])


def render(record: dict) -> list[str]:
    """A row per run: each stage's time as the pipeline recorded it, the quantize stage's GPU peak, the host's."""
    doc = record
    commit = str(doc.get("commit_matched") or doc.get("commit") or "?")
    commit = commit if "+" in commit else commit[:7] + ("+dirty" if doc.get("dirty") and not doc.get("commit_matched")
                                                         else "")
    lines = [f"{doc['date'][:16]} UTC · {(doc.get('gpu') or {}).get('name')} · each stage in its own process, times as "
             f"the pipeline records them (s):", "",
             "| date (UTC) | commit | GPU | shape | format→target | fetch s | quantize s | build s | package s | "
             "bench s | publish s | quantize peak GiB (torch / nvidia-smi) | host peak RSS GiB | bench errors | "
             "extra overrides |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in doc["runs"]:
        st = {s["stage"]: s for s in run["stages"]}
        q = st.get("quantize", {})

        def cell(stage: str) -> str:
            s = st.get(stage)
            if s is None:
                return "—"
            if s.get("returncode"):
                return "failed"
            return f"{s.get('stage_s') or 0:.1f}"

        b = (st.get("bench") or {}).get("bench") or {}
        lines.append(f"| {doc['date'][:16]} | {commit} | {doc['gpu'].get('name')} | {run['shape']} | "
                     f"{run['format']}→{run['target']} | {cell('fetch')} | {cell('quantize')} | {cell('build')} | "
                     f"{cell('package')} | {cell('bench')} | {cell('publish')} | "
                     f"{q.get('torch_peak_gib', '—')} / {q.get('nvidia_smi_peak_gib', '—')} | "
                     f"{max((s.get('host_peak_rss_gib') or 0) for s in run['stages']):.1f} | {b.get('errors', '—')} | "
                     f"{' '.join(run.get('extra_overrides') or []) or '—'} |")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable; default 4b")
    parser.add_argument("--run", action="append", help="FORMAT:TARGET, repeatable; default fp8:h200")
    parser.add_argument("--until", default="publish", choices=STAGES)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra pipeline overrides for every run (recorded with the run)")
    parser.add_argument("--root", type=Path, required=True, help="working directory for the pipeline's outputs")
    parser.add_argument("--calib-rows", type=int, help="calibration rows (default: the synthetic model's 24)")
    parser.add_argument("--calib-seq", type=int, help="calibration tokens per row (default: 128)")
    parser.add_argument("--calib-text", help="calibration text, a .txt or .jsonl file (default: the shipped corpus)")


def run(args) -> dict:
    a = args
    doc = {"host": {"hostname": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count()},
           "gpu": gpu_info(), "until": a.until, "runs": []}
    failed = []
    cal = calib_overrides(a.calib_rows, a.calib_seq, a.calib_text)
    a.root.mkdir(parents=True, exist_ok=True)
    partial = a.root / "gpu_e2e-partial.json"
    for shape in a.shape or ["4b"]:
        for spec in a.run or ["fp8:h200"]:
            fmt, _, target = spec.partition(":")
            root = a.root / f"{shape}-{fmt}-{target}"
            log_dir = root / "logs"
            log_dir.mkdir(parents=True, exist_ok=True)
            run_ = {"shape": shape, "format": fmt, "target": target,
                    "overrides": overrides(shape, fmt, target) + cal + a.set, "extra_overrides": cal + a.set,
                    "stages": []}
            doc["runs"].append(run_)
            for stage in STAGES[:STAGES.index(a.until) + 1]:
                print(f"[gpu_e2e] {shape} {fmt}->{target}: {stage} ...", flush=True)
                r = run_stage(run_["overrides"], root, stage, log_dir)
                run_["stages"].append(r)
                print(f"[gpu_e2e]   {json.dumps({k: v for k, v in r.items() if k != 'stderr_tail'})}", flush=True)
                partial.write_text(json.dumps(doc, default=str))  # what ran so far survives a kill
                if r["returncode"]:
                    failed.append(f"{shape} {fmt}->{target}: {stage}")
                    print(r.get("stderr_tail", ""), flush=True)
                    break
    if failed:
        doc["error"] = "failed: " + "; ".join(failed)
    return doc
