"""plan's predictions against NVIDIA's own CLI: for the flagship (conf/model/qwen32b) at fp8 and nvfp4 on h100, h200
and b200, the figures the serving plan shows equal what ``aiconfigurator cli estimate`` prints for the same inputs
(the CLI is installed beside the model by `make .venv/.installed-test`: ``python -m pipeline.perfmodel --with-cli``).
A planted wrong mapping (the FP8 KV cache sent as bf16) must not match. Where the tables have no data (NVFP4 on Hopper:
its weight-only GEMM rows are missing) both say so."""
from __future__ import annotations

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
def model_on(monkeypatch):
    monkeypatch.setenv("PIPELINE_PERFMODEL", "on")
    if perfmodel.available():
        pytest.skip(perfmodel.available())
    cli = subprocess.run([str(perfmodel.env_python()), "-c", "import aiconfigurator.main"], capture_output=True)
    if cli.returncode:
        pytest.skip(f"{perfmodel.CLI} is not installed beside the model: python -m pipeline.perfmodel --with-cli")


def cli_estimate(system: str, gemm: str, kv: str, tp: int, batch: int, isl: int, osl: int) -> dict | str:
    """``aiconfigurator cli estimate`` (agg) as a user runs it; its printed figures, or its last line on failure."""
    proc = subprocess.run(
        [str(perfmodel.env_python()), "-c", "import sys; from aiconfigurator.main import main; sys.exit(main())",
         "cli", "estimate", "--model-path", "Qwen/Qwen3-32B", "--system", system, "--backend", "trtllm",
         "--isl", str(isl), "--osl", str(osl), "--batch-size", str(batch), "--tp-size", str(tp),
         "--gemm-quant-mode", gemm, "--kvcache-quant-mode", kv, "--estimate-mode", "agg"],
        capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    if proc.returncode or "TTFT:" not in out:
        return (out.strip().splitlines() or ["no output"])[-1]
    return {k: float(re.search(rx, out).group(1).replace(",", "")) for k, rx in FIELDS.items()}


def close(ours: dict, theirs: dict) -> bool:
    # the CLI prints 3 decimals (TTFT/TPOT), 2 (tokens/s, GB); the plan rounds to 2
    return all(abs(ours[k] - theirs[k]) <= max(0.01, 1e-4 * abs(theirs[k])) for k in FIELDS)


def test_plan_figures_equal_aiconfigurators_cli_and_a_wrong_kv_mapping_does_not():
    cases = [(q, t) for q in ("fp8", "nvfp4") for t in ("h100", "h200", "b200")]
    plans = {}
    for q, t in cases:
        # TP and batch set (the profile's sweep is the same model at more points; one point keeps this test short)
        cfg = hardware.compose(["model=qwen32b", f"quant={q}", f"target={t}", "runtime=trtllm_llmapi",
                                "quant.kv_cache=fp8", "build.tp_size=1", "build.max_batch_size=64",
                                "serve.slo.ttft_ms=100000", "serve.slo.tpot_ms=1000"])
        plans[(q, t)] = (cfg, serving_plan.resolve(cfg, predict=True))
    jobs = {}
    with ThreadPoolExecutor(2) as pool:
        for (q, t), (cfg, p) in plans.items():
            i, o = serving_plan.workloads(cfg)["typical"]
            b = int(p.settings["max_batch_size"])
            sysname, gemm = perfmodel.SYSTEMS[t], perfmodel.GEMM_MODES[q]
            jobs[(q, t)] = pool.submit(cli_estimate, sysname, gemm, "fp8", p.tp, b, i, o)
            if (q, t) == ("fp8", "h200"):  # the planted wrong mapping: FP8 KV sent as bf16
                jobs["planted"] = pool.submit(cli_estimate, sysname, gemm, "bfloat16", p.tp, b, i, o)
    compared = 0
    for (q, t), (cfg, p) in plans.items():
        theirs = jobs[(q, t)].result()
        if p.predictions is None:  # no data in the tables: the plan says so in one line, and so does the CLI
            assert isinstance(theirs, str), (q, t, theirs)
            assert any("no prediction" in n and "\n" not in n for n in p.notes), p.notes
            continue
        ours = p.predictions["workloads"]["typical"]["kv_fp8"]
        assert isinstance(theirs, dict), (q, t, theirs)
        assert close(ours, theirs), (q, t, ours, theirs)
        compared += 1
        if (q, t) == ("fp8", "h200"):
            planted = jobs["planted"].result()
            assert not close(ours, planted), "FP8 KV sent as bf16 must not match"
            assert close(p.predictions["workloads"]["typical"]["kv_bf16"], planted)  # and bf16 is bf16
    assert compared >= 4  # fp8 on all three, nvfp4 on b200 at least


def test_the_service_limits_choose_the_profile_and_a_target_that_cannot_meet_them_is_refused():
    base = ["model=qwen32b", "quant=fp8", "target=h200", "runtime=trtllm_llmapi", "quant.kv_cache=fp8"]
    thr = serving_plan.resolve(hardware.compose(base))  # the default limits, objective throughput
    lat = serving_plan.resolve(hardware.compose(base + ["serve.slo.objective=latency"]))  # the same sweep, cached
    t, l_ = thr.profile["chosen"], lat.profile["chosen"]
    assert t["tokens_per_s_per_gpu"] > l_["tokens_per_s_per_gpu"] and t["request_latency_ms"] > l_["request_latency_ms"]
    assert thr.settings["max_batch_size"] == t["batch"] and lat.settings["max_batch_size"] == l_["batch"]
    assert t["ttft_ms"] <= 2000 and t["tpot_ms"] <= 30 and thr.profile["runners_up"]
    # the longer sequences a smaller batch leaves room for, within the same pool
    assert lat.settings["max_seq_len"] >= thr.settings["max_seq_len"]
    with pytest.raises(UserError, match=r"no TP x batch meets serve.slo .* the closest is TP=\d+ batch \d+"):
        serving_plan.resolve(hardware.compose(base + ["serve.slo.tpot_ms=1"]))  # planted: 1 ms per token


def test_a_head_size_the_tables_lack_is_one_line_and_the_plan_goes_on():
    cfg = hardware.compose(["model=smollm2-135m", "quant=fp8", "target=h100", "runtime=trtllm_llmapi"])
    p = serving_plan.resolve(cfg, predict=True)
    assert p.predictions is None and p.profile is None
    lines = [n for n in p.notes if "no prediction" in n]
    assert len(lines) == 1 and "head_size: 64" in lines[0] and "\n" not in lines[0]
    assert str(perfmodel.env_path()) not in lines[0]  # no local paths in the line
    assert p.settings["max_batch_size"] > 8 and serving_plan.kv_problems(p) == []  # sized by the KV rule all the same
