"""The flagship's serving settings, derived per GPU by the serving plan, against the old fixed ones (the CPU smoke's
8 sequences of 2,048 tokens, 8,192-token budget), with NVIDIA's performance model's predictions for both.

    python -m benchmarks perf_model [--targets h100 h200 b200] [--quants fp8 nvfp4]

For conf/model/qwen32b with an FP8 KV cache, per target and format: the settings ``plan`` derives
(``pipeline.serving_plan.resolve``) and the figures aiconfigurator-core 0.12.0 predicts for the typical request
(``build.expected_*_len``: 1,024 in / 256 out) at them, beside the old settings at the TP the capacity planner chose
for them. The predictions come from NVIDIA's measured TensorRT-LLM kernel tables (the version each row names); no
TensorRT-LLM run here has checked them. Needs the model's environment (``make perfmodel-env``); a target or format
the tables lack is recorded with the model's one line.
"""
from __future__ import annotations

import argparse

TITLE = "Serving settings per GPU vs the old fixed ones, with predicted figures (flagship)"
OLD = {"max_batch_size": 8, "max_seq_len": 2048, "max_input_len": 1024, "max_num_tokens": 8192,
       "cuda_graph_batch_sizes": [1, 2, 4, 8]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--targets", nargs="+", default=["h100", "h200", "b200"])
    parser.add_argument("--quants", nargs="+", default=["fp8", "nvfp4"])


def run(args) -> dict:
    from pipeline import capacity, hardware, perfmodel, serving_plan
    from pipeline.config import to_plain

    if perfmodel.available():
        raise SystemExit(perfmodel.available())
    rows = []
    for quant in args.quants:
        for target in args.targets:
            base = ["model=qwen32b", f"quant={quant}", f"target={target}", "runtime=trtllm_llmapi", "quant.kv_cache=fp8"]
            cfg = hardware.compose(base)
            new = serving_plan.resolve(cfg, predict=True)
            shape = capacity.shape_from(to_plain(cfg.model.shape))
            old_tp = capacity.plan(shape, quant, "fp8", float(cfg.target.memory_gb), int(cfg.target.gpus_per_node),
                                   max_num_tokens=8192, max_batch_size=8, max_seq_len=2048).tp
            old_cfg = hardware.compose(base + [f"build.{k}={v}".replace(" ", "") for k, v in OLD.items()]
                                       + [f"build.tp_size={old_tp}"])
            old = serving_plan.resolve(old_cfg, predict=True)

            def side(p):
                typ = ((p.predictions or {}).get("workloads") or {}).get("typical") or {}
                return {"tp": p.tp, "settings": p.settings, "kv_tokens": p.kv_tokens,
                        "predicted": typ.get("kv_fp8"), "predicted_bf16_kv": typ.get("kv_bf16"),
                        "speed_of_light": typ.get("speed_of_light"), "profile": p.profile, "notes": list(p.notes)}

            rows.append({"target": target, "quant": quant, "new": side(new), "old": side(old),
                         "trtllm_tables": (new.predictions or {}).get("trtllm_tables")})
    return {"model": "qwen32b", "kv_cache": "fp8", "performance_model": perfmodel.PINNED,
            "workload": {"isl": 1024, "osl": 256}, "rows": rows}


def _fig(p: dict | None, key: str, fmt: str) -> str:
    return "-" if not p or key not in p else format(p[key], fmt)


def render(record: dict) -> list[str]:
    lines = [f"{record['date'][:16].replace('T', ' ')} UTC · commit {record.get('commit')} · {record['machine']} · "
             f"{record['performance_model']} (NVIDIA's measured TensorRT-LLM kernel tables; predictions, not "
             f"measurements: no TensorRT-LLM run here has checked them) · qwen32b, FP8 KV, typical request "
             f"{record['workload']['isl']} in / {record['workload']['osl']} out.", "",
             "| target | quant | settings | TP | batch | max_seq_len | max_num_tokens | TTFT ms | TPOT ms | "
             "tokens/s/GPU | tables |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        for which in ("old", "new"):
            s = r[which]
            st = s["settings"]
            p = s["predicted"]
            lines.append(f"| {r['target']} | {r['quant']} | {which} | {s['tp']} | {st['max_batch_size']} | "
                         f"{st['max_seq_len']:,} | {st['max_num_tokens']:,} | {_fig(p, 'ttft_ms', '.0f')} | "
                         f"{_fig(p, 'tpot_ms', '.1f')} | {_fig(p, 'tokens_per_s_per_gpu', ',.0f')} | "
                         f"{r.get('trtllm_tables') or 'no data'} |")
    notes = sorted({n for r in record["rows"] for n in r["new"]["notes"]})
    lines += [""] + [f"- {n}" for n in notes] if notes else []
    return lines
