"""Every quantization format on the real SmolLM2-135M-Instruct, side by side; prepends a table to docs/benchmarks.md.

    python benchmarks/quant_accuracy.py                     # all formats, FP8 KV cache
    python benchmarks/quant_accuracy.py quant.calib.num_samples=64

Runs the real CLI (``build until=quantize``) once per format in one fresh output root, so fetch is shared, with
``quant.gate=warn`` so that every format is measured even when it breaches its gate. SmolLM2's hidden size (576) is
not a multiple of 128, so the AWQ formats use block size 64 (plan refuses 128 and names 64).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rebuild_noop import REPO, commit, machine, prepend  # noqa: E402

FORMATS = [("none", []), ("fp8", []), ("int8_sq", []), ("int4_awq", ["quant.block_size=64"]),
           ("w4a8_awq", ["quant.block_size=64"]), ("nvfp4", [])]


def main() -> None:
    extra = sys.argv[1:]
    rows = []
    with tempfile.TemporaryDirectory(prefix="quant-bench-") as root:
        for fmt, args in FORMATS:
            cmd = [sys.executable, "-m", "pipeline", "build", f"quant={fmt}", "quant.kv_cache=fp8", "quant.gate=warn",
                   "until=quantize", f"paths.root={root}", *args, *extra]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                rows.append({"format": fmt, "error": proc.stderr.strip().splitlines()[-1]})
                print(f"{fmt}: {rows[-1]['error']}", file=sys.stderr)
                continue
            acc_file = next(Path(root, ".store").glob(f"smollm2-135m.{fmt}-kvfp8-quantize-*/accuracy.json"))
            r = json.loads(acc_file.read_text())
            rows.append({"format": fmt, "wall_s": wall, **r})
            print(f"{fmt}: done in {wall:.0f}s", file=sys.stderr)
    lines = [f"\n## Quantization formats on SmolLM2-135M-Instruct (`benchmarks/quant_accuracy.py`)",
             f"{time.strftime('%Y-%m-%d')} · commit {commit()} · {machine()} · CPU calibration · extra overrides: "
             f"`{' '.join(extra) or '(none)'}`", "",
             "Quantized vs unquantized on the held-out fifth of the shipped corpus; FP8 KV cache throughout. "
             "Bytes/param counts every tensor of the exported checkpoint (embeddings stay bf16 and are tied: "
             "28M of the 135M parameters) over the parameter count.", "",
             "| format | quant_algo | bytes/param | mean KL | top-1 agreement | perplexity ratio | export check | "
             "gate | calibration (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['format']} | error: {r['error']} | | | | | | | |")
            continue
        if "accuracy" not in r:
            lines.append(f"| {r['format']} | (unquantized) | {r.get('bytes_per_param', '-')} | 0 | 1 | 1 | - | - | - |")
            continue
        a = r["accuracy"]["quantized_vs_unquantized"]
        lines.append(f"| {r['format']} | {r['quant_algo'] or '-'} | {r['bytes_per_param']} | {a['kl_mean']:.4f} | "
                     f"{a['top1_agreement']:.3f} | {a['ppl_ratio']:.3f} | {r['accuracy']['export_check']} | "
                     f"{r['accuracy']['gate']} | {r['timings_s']['calibrate_s']:.1f} |")
    prepend("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
