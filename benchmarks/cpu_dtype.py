"""The reference runtime's forward pass on this CPU in bfloat16 and in float32, side by side: what
``runtime.dtype=auto`` decides between (``pipeline.runtime.reference.compute_dtype``).

    python -m benchmarks cpu_dtype --root ROOT [--rows 8] [--tokens 64] [--repeat 5]

ROOT is a build root holding the default model's fetch output (``python -m pipeline build until=fetch
paths.root=ROOT``). The checkpoint is loaded through the reference runtime (``reference.load``) once per dtype; one
torch thread (``serve.torch_threads``' default); a ``--rows`` × ``--tokens`` batch of seeded token ids; after one
warm-up pass, ``--repeat`` passes alternate between the dtypes, so drift on a shared machine hits both alike. Reports
the median pass of each and their ratio, with whether torch finds native bfloat16 (AVX512-BF16 or AMX) here and what
``auto`` resolves to.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks._provenance import commit_label

TITLE = "Reference runtime forward pass on CPU: bfloat16 vs float32"
DTYPES = ("bfloat16", "float32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", type=Path, required=True,
                        help="a build root holding the default model's fetch output")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)


def run(args) -> dict:
    import torch

    from pipeline.runtime import reference

    found = sorted(args.root.glob(".store/smollm2-135m-fetch-*/manifest.json"))
    if not found:
        raise SystemExit(f"no SmolLM2 fetch output under {args.root}: python -m pipeline build until=fetch "
                         f"paths.root={args.root}")
    ckpt = found[-1].parent
    torch.set_num_threads(1)
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    models = {name: reference.load(ckpt, dtype=d) for name, d in dtypes.items()}
    vocab = models["float32"].config.vocab_size
    ids = torch.randint(0, vocab, (args.rows, args.tokens), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {name: [] for name in dtypes}
    with torch.inference_mode():
        for name, m in models.items():
            m(input_ids=ids)  # warm-up
        for _ in range(args.repeat):
            for name, m in models.items():
                t0 = time.perf_counter()
                m(input_ids=ids)
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {"checkpoint": ckpt.name, "rows": args.rows, "tokens": args.tokens, "repeat": args.repeat,
            "torch_threads": 1, "torch": torch.__version__, "native_bf16": reference.native_bf16(),
            "auto_resolves_to": str(reference.compute_dtype("auto", "cpu")).removeprefix("torch."),
            "seconds": times, "median_s": med, "bfloat16_over_float32": med["bfloat16"] / med["float32"]}


def render(record: dict) -> list[str]:
    med, times = record["median_s"], record["seconds"]
    repeat = record.get("repeat", len(times["float32"]))
    lines = [f"{record['date'][:16].replace('T', ' ')} UTC · commit {commit_label(record)} · {record['machine']} · "
             f"torch {record['torch']} · SmolLM2-135M (`{record['checkpoint']}`) through `reference.load`, one torch "
             f"thread, {record['rows']} × {record['tokens']} tokens, {repeat} passes per dtype alternating after a "
             f"warm-up.", "",
             "| dtype | median pass (s) | passes (s) |", "|---|---|---|"]
    for name in DTYPES:
        lines.append(f"| {name} | {med[name]:.3f} | {', '.join(f'{t:.3f}' for t in times[name])} |")
    lines += ["", f"bfloat16 over float32: {record['bfloat16_over_float32']:.2f}×. Native bfloat16 here (torch's "
                  f"AVX512-BF16/AMX probes): {'yes' if record['native_bf16'] else 'no'}; `runtime.dtype=auto` "
                  f"resolves to {record['auto_resolves_to']} on this CPU."]
    return lines
