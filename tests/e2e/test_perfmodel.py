"""plan's predictions against NVIDIA's own CLI: for the flagship (conf/model/qwen32b) at fp8 and nvfp4 on h100, h200
and b200, the figures the serving plan shows equal what ``aiconfigurator cli estimate`` prints for the same inputs at
the bundle's own settings (``--ctx-tokens`` = its max_num_tokens, ``--max-seq-len`` = its max_seq_len,
``--fmha-quant-mode`` = its context attention), one row per workload at least; where the plan marks a row's memory at
full length beyond the GPU, the CLI stops with "OOM" (the CLI is installed beside the model by
`make test-slow`: ``python -m pipeline.perfmodel --if-needed --with-cli``). A planted wrong mapping (the FP8 KV cache
sent as bf16) and the CLI's own default token budget (the input length) must not match. Where the tables have no
data (NVFP4 on Hopper: its weight-only GEMM rows are missing) both say so."""
from __future__ import annotations

import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from pipeline import hardware, perfmodel, serving_plan
from pipeline.errors import UserError

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

FIELDS = {"ttft_ms": r"TTFT:\s+([\d.,]+) ms", "tpot_ms": r"TPOT:\s+([\d.,]+) ms",
          "tokens_per_s_per_gpu": r"tokens/s/gpu:\s+([\d.,]+)", "memory_gb": r"Memory \(GPU\):\s+([\d.,]+) GB"}


@pytest.fixture(autouse=True)
def model_installed():
    if perfmodel.available():
        pytest.skip(perfmodel.available())
    cli = subprocess.run([str(perfmodel.env_python()), "-c", "import aiconfigurator.main"], capture_output=True)
    if cli.returncode:
        pytest.skip(f"{perfmodel.CLI} is not installed beside the model: python -m pipeline.perfmodel --with-cli")


def cli_estimate(system: str, gemm: str, kv: str, tp: int, batch: int, isl: int, osl: int, *,
                 ctx_tokens: int | None = None, max_seq_len: int | None = None, fmha: str | None = None) -> dict | str:
    """``aiconfigurator cli estimate`` (agg) as a user runs it; its printed figures, or its last line on failure."""
    extra = ([] if ctx_tokens is None else ["--ctx-tokens", str(ctx_tokens)]) + (
        [] if max_seq_len is None else ["--max-seq-len", str(max_seq_len)]) + (
        [] if fmha is None else ["--fmha-quant-mode", fmha])
    proc = subprocess.run(
        [str(perfmodel.env_python()), "-c", "import sys; from aiconfigurator.main import main; sys.exit(main())",
         "cli", "estimate", "--model-path", "Qwen/Qwen3-32B", "--system", system, "--backend", "trtllm",
         "--isl", str(isl), "--osl", str(osl), "--batch-size", str(batch), "--tp-size", str(tp),
         "--gemm-quant-mode", gemm, "--kvcache-quant-mode", kv, "--estimate-mode", "agg", *extra],
        capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    if proc.returncode or "TTFT:" not in out:
        return " ".join((out.strip().splitlines() or ["no output"])[-3:])
    return {k: float(re.search(rx, out).group(1).replace(",", "")) for k, rx in FIELDS.items()}


def close(ours: dict, theirs: dict | str) -> bool:
    # the CLI prints 3 decimals (TTFT/TPOT), 2 (tokens/s, GB); the plan rounds to 2
    return isinstance(theirs, dict) and all(abs(ours[k] - theirs[k]) <= max(0.01, 1e-4 * abs(theirs[k])) for k in FIELDS)


def test_plan_figures_equal_aiconfigurators_cli_at_the_bundles_settings():
    cases = [(q, t) for q in ("fp8", "nvfp4") for t in ("h100", "h200", "b200")]
    plans = {}
    for (q, t), cfg in zip(cases, hardware.compose_many([
            ["model=qwen32b", f"quant={q}", f"target={t}", "runtime=trtllm_llmapi", "quant.kv_cache=fp8",
             "build.tp_size=1", "build.max_batch_size=64", "serve.slo.ttft_ms=100000", "serve.slo.tpot_ms=1000"]
            for q, t in cases])):
        # TP and batch set (the profile's sweep is the same model at more points; one point keeps this test short)
        try:
            plans[(q, t)] = (cfg, serving_plan.resolve(cfg))
        except UserError as exc:  # NVFP4 on Hopper: the tables lack its rows, and the plan says so
            plans[(q, t)] = (cfg, exc)
    jobs: dict = {}
    with ThreadPoolExecutor(2) as pool:
        for (q, t), (cfg, p) in plans.items():
            if isinstance(p, UserError) or p.predictions is None:
                i, o = serving_plan.workloads(cfg)["typical"]
                jobs[(q, t, "typical", 64)] = pool.submit(cli_estimate, perfmodel.SYSTEMS[t], perfmodel.GEMM_MODES[q],
                                                          "fp8", 1, 64, i, o)
                continue
            pred = p.predictions
            at = {"ctx_tokens": pred["ctx_tokens"], "max_seq_len": pred["max_seq_len"], "fmha": pred["fmha"]}
            for name, w in pred["workloads"].items():
                sysname, gemm = perfmodel.SYSTEMS[t], perfmodel.GEMM_MODES[q]
                jobs[(q, t, name, w["batch"])] = pool.submit(cli_estimate, sysname, gemm, "fp8", p.tp, w["batch"],
                                                             w["isl"], w["osl"], **at)
                for c in (w.get("by_concurrency") or {}):
                    jobs[(q, t, name, int(c))] = pool.submit(cli_estimate, sysname, gemm, "fp8", p.tp, int(c),
                                                             w["isl"], w["osl"], **at)
            if (q, t) == ("fp8", "h200"):
                chat = pred["workloads"]["chat"]
                # planted: FP8 KV sent as bf16, and the CLI's default token budget (the input length)
                jobs["planted-kv"] = pool.submit(cli_estimate, "h200_sxm", "fp8_static", "bfloat16", 1, 8,
                                                 chat["isl"], chat["osl"], **{**at, "fmha": "bfloat16"})
                jobs["planted-ctx"] = pool.submit(cli_estimate, "h200_sxm", "fp8_static", "fp8", 1, 8, chat["isl"],
                                                  chat["osl"], max_seq_len=at["max_seq_len"], fmha=at["fmha"])
    compared, refused = set(), 0
    for (q, t), (cfg, p) in plans.items():
        if isinstance(p, UserError) or p.predictions is None:  # no data: the plan says so, and so does the CLI
            theirs = jobs[(q, t, "typical", 64)].result()
            assert isinstance(theirs, str), (q, t, theirs)
            assert (isinstance(p, UserError) and "\n" not in str(p)) or any(
                "no prediction" in n and "\n" not in n for n in p.notes)
            continue
        for name, w in p.predictions["workloads"].items():
            rows = [(w["batch"], w["kv_fp8"])] + [(int(c), r) for c, r in (w.get("by_concurrency") or {}).items()]
            for batch, ours in rows:
                theirs = jobs[(q, t, name, batch)].result()
                if ours["oom"]:  # memory at the full max_seq_len beyond the GPU: the CLI stops with OOM
                    assert isinstance(theirs, str) and "OOM" in theirs, (q, t, name, batch, theirs)
                    refused += 1
                    continue
                assert isinstance(theirs, dict), (q, t, name, batch, theirs)
                assert close(ours, theirs), (q, t, name, batch, ours, theirs)
                compared.add((q, t, name))
        if (q, t) == ("fp8", "h200"):
            ours = p.predictions["workloads"]["chat"]["by_concurrency"]["8"]
            planted = jobs["planted-kv"].result()
            assert isinstance(planted, dict) and not close(ours, planted), "FP8 KV sent as bf16 must not match"
            planted = jobs["planted-ctx"].result()
            assert isinstance(planted, dict) and not close(ours, planted), "the CLI's default budget must not match"
    # every workload compared on fp8 on all three GPUs and nvfp4 on b200 at least; the full batch at the full
    # context is beyond the GPU somewhere, and the CLI says so
    assert {(q, t) for q, t, _ in compared} >= {("fp8", "h100"), ("fp8", "h200"), ("fp8", "b200"), ("nvfp4", "b200")}
    assert {n for q, t, n in compared if (q, t) == ("fp8", "h200")} >= {"chat", "rag"}  # every bench workload
    assert refused >= 1


def test_the_service_limits_choose_the_profile_and_a_target_that_cannot_meet_them_is_refused():
    base = ["model=qwen32b", "quant=fp8", "target=h200", "runtime=trtllm_llmapi", "quant.kv_cache=fp8"]
    thr_cfg, lat_cfg, bad_cfg = hardware.compose_many([base, base + ["serve.slo.objective=latency"],
                                                       base + ["serve.slo.tpot_ms=1"]])
    thr = serving_plan.resolve(thr_cfg)  # the default limits, objective throughput
    lat = serving_plan.resolve(lat_cfg)  # the same sweep, cached
    t, l_ = thr.profile["chosen"], lat.profile["chosen"]
    assert t["tokens_per_s_per_gpu"] > l_["tokens_per_s_per_gpu"] and t["request_latency_ms"] > l_["request_latency_ms"]
    assert thr.settings["max_batch_size"] == t["batch"] and lat.settings["max_batch_size"] == l_["batch"] >= 32
    assert t["ttft_ms"] <= 2000 and t["tpot_ms"] <= 30 and thr.profile["runners_up"]
    # both serve the model's whole context
    assert lat.settings["max_seq_len"] == thr.settings["max_seq_len"] == 40960
    with pytest.raises(UserError, match=r"no TP x batch meets serve.slo .* the closest is TP=\d+ batch \d+"):
        serving_plan.resolve(bad_cfg)  # planted: 1 ms per token


def test_a_head_size_the_tables_lack_is_one_line_and_the_plan_goes_on():
    cfg = hardware.compose(["model=smollm2-135m", "quant=fp8", "target=h100", "runtime=trtllm_llmapi"])
    p = serving_plan.resolve(cfg)
    assert p.predictions is None and p.profile is None
    lines = [n for n in p.notes if "no prediction" in n]
    assert len(lines) == 1 and "head_size: 64" in lines[0] and "\n" not in lines[0]
    assert str(perfmodel.env_path()) not in lines[0]  # no local paths in the line
    assert p.settings["max_batch_size"] >= 64 and serving_plan.kv_problems(p) == []  # trtllm-bench's rule
    assert p.settings["max_seq_len"] == int(cfg.model.shape.max_position_embeddings)


def test_a_killed_model_process_leaves_nothing_in_the_commands_temporary_directory(tmp_path, monkeypatch):
    """A command that exits before its model process (a refused config, Ctrl-C) must leave nothing behind: the
    ``config.json`` the model reads for a model aiconfigurator does not bundle goes beside the cached answers, by
    content, never into ``TMPDIR`` (a process killed there runs no clean-up)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    shape = {"num_layers": 4, "hidden_size": 512, "intermediate_size": 1536, "num_heads": 8, "num_kv_heads": 8,
             "head_dim": 64, "vocab_size": 32000, "max_position_embeddings": 8192}
    conf = perfmodel.model_config(shape, "llama")
    q = perfmodel.Query("", json.dumps(conf, sort_keys=True), "h100_sxm", "fp8", "fp8", 1, 1, 128, 16)
    w = perfmodel._Worker(120)
    try:
        w.ask([q])  # an answer or an error row: either way the config was written before it
    finally:
        w.proc.kill()
        w.proc.wait()
    assert list(tmp_path.iterdir()) == []
    stored = perfmodel.cache_dir() / "models"
    assert any(json.loads(f.read_text()) == conf for f in stored.glob("*/config.json"))
