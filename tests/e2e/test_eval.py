"""Task evaluation end to end: lm-eval through the OpenAI front end against real tritonservers, the baseline's
cache, an external server, and the negative controls on the real SmolLM2 (a planted regression fails, the baseline
compared with itself and with a fresh run of itself differs by nothing, and the served baseline scores what
lm-eval's own in-process model scores)."""
from __future__ import annotations

import importlib.metadata as md
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import hardware
from pipeline.eval import gate, tasks
from tests.conftest import REPO, TINY, report, run_cli, statuses

pytestmark = pytest.mark.e2e
TINY_LABEL = "tiny-qwen3.fp8-kvfp8.cpu.reference"


def _bundle(root: Path) -> tuple[Path, dict]:
    path = next(root.glob("bundles/*-publish-*/bundle.json"))
    return path.parent, json.loads(path.read_text())


def _stage_out(root: Path, stage: str, label: str = TINY_LABEL) -> Path:
    return next(Path(r["output"]) for r in report(root, label)["stages"] if r["stage"] == stage)


def test_the_bundle_records_the_task_gate(tiny_build):
    bundle, doc = _bundle(tiny_build)
    ev = doc["eval"]
    t = ev["tasks"]["pipeline_facts"]
    assert t["items"] == 20 and t["metric"] == "acc"  # eval.limit=20 in the tiny build
    assert t["difference"] == pytest.approx(t["quantized"] - t["baseline"])
    assert t["ci_low"] <= t["difference"] <= t["ci_high"]
    assert t["max_drop"] == 0.05 and t["verdict"] in ("pass", "inconclusive")
    assert doc["gates"]["eval"] == ev["verdict"] == t["verdict"]
    assert ev["lm_eval"] == md.version("lm_eval")
    assert ev["task_files"] == tasks.digests(["pipeline_facts"])
    table = (bundle / "reports" / "eval.md").read_text()
    assert f"| pipeline_facts | acc | 20 | {t['baseline']:.4f} | {t['quantized']:.4f} |" in table
    # lm-eval's requests reached the front end: its log names the endpoint it posted to
    out = _stage_out(tiny_build, "evaluate")
    assert json.loads((out / "eval.json").read_text())["endpoint"].startswith("http://127.0.0.1:")
    base = _stage_out(tiny_build, "eval_baseline")
    assert base.name.startswith("tiny-qwen3.cpu-eval_baseline-")  # no quant, target or runtime in its name


def test_the_bench_and_the_evaluation_share_one_server_and_front_end(tiny_build):
    """One build starts the packaged repository's tritonserver and OpenAI front end once: the bench starts them, the
    evaluation reuses them, the run stops them (the run log's lines, counted); the baseline's own repository gets a
    server of its own. Each stage records whether it started them and keeps its own part of the server's log. A
    planted second start-up (and a start-up never stopped) is what the count reports."""
    from collections import Counter

    from pipeline.runner import leases as shared

    log = Path(report(tiny_build)["log"]).read_text()
    repo = str(_stage_out(tiny_build, "package"))
    counts = shared.startups(log)
    assert shared.startup_problems(log) == [], shared.startup_problems(log)
    for what in ("tritonserver", "OpenAI front end"):
        assert counts[(what, repo)] == Counter(started=1, reused=1, stopped=1), (what, counts)
    base = [n for (what, r), n in counts.items() if what == "tritonserver" and "-eval_baseline-" in r]
    assert base == [Counter(started=1, stopped=1)], counts
    bench = json.loads((_stage_out(tiny_build, "bench") / "bench.json").read_text())
    assert bench["server_shared"] == {"started_by_this_stage": True, "stages": ["bench"]}
    timings = json.loads((_stage_out(tiny_build, "evaluate") / "eval.json").read_text())["timings"]
    assert timings["server_started_by_this_stage"] is False and timings["frontend_started_by_this_stage"] is False
    own = (_stage_out(tiny_build, "evaluate") / "server.log").read_text()
    assert own.startswith("(shared: started by the bench stage of this build run; its log from when evaluate took")
    assert "Started GRPCInferenceService" not in own  # the start-up is in the bench's part
    assert "Started GRPCInferenceService" in (_stage_out(tiny_build, "bench") / "server.log").read_text()

    started = next(ln for ln in log.splitlines() if f"tritonserver started for {repo} " in ln)
    stopped = next(ln for ln in log.splitlines() if f"tritonserver stopped for {repo} " in ln)
    assert shared.startup_problems(log + started + "\n" + stopped + "\n") == [
        f"tritonserver started 2 times for {repo}"]
    assert shared.startup_problems(log + started + "\n") == [
        f"tritonserver started 2 times for {repo}", f"tritonserver for {repo}: started 2, stopped 1"]


def test_one_baseline_serves_every_format_and_target_of_a_device(tiny_build):
    """The baseline's fingerprint holds the model, the tasks and the device kind: another format reuses it (plan
    says cached), another task limit or model dtype does not."""
    from pipeline.runner import executor as runner
    from pipeline.stages import STAGES

    def planned(*extra):
        cfg = hardware.compose([*TINY, f"paths.root={tiny_build}", *extra])
        return runner.preflight(cfg, STAGES, environment=False).by_name

    same = planned()
    other_format = planned("quant=int8_sq", "quant.kv_cache=none")
    assert other_format["eval_baseline"].fingerprint == same["eval_baseline"].fingerprint
    assert other_format["eval_baseline"].cached and not other_format["evaluate"].cached
    assert planned("eval.concurrency=7")["eval_baseline"].cached  # how fast, not what: unhashed
    assert planned("eval.limit=21")["eval_baseline"].fingerprint != same["eval_baseline"].fingerprint
    assert planned("model.dtype=float32")["eval_baseline"].fingerprint != same["eval_baseline"].fingerprint
    assert planned("eval.max_drop.fp8=0.1")["eval_baseline"].cached  # the gate's limit is evaluate's alone


@pytest.mark.slow
def test_evaluate_runs_unchanged_against_an_external_server(tiny_build, tmp_path):
    from pipeline.triton import server

    root = tmp_path / "x"
    shutil.copytree(tiny_build, root)
    repo = next(root.glob("triton_repo/*-package-*/manifest.json")).parent
    with server.local_server(repo, host="127.0.0.1", server_bin=None, work_dir=tmp_path / "w", timeout_s=180) as s:
        proc = run_cli("build", *TINY, "force=[evaluate]", "until=evaluate", "serve.launcher=external",
                       f"serve.url={s.grpc_url}", root=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    st = statuses(root)
    assert st["evaluate"] == "ran" and st["eval_baseline"] == "cached"
    doc = json.loads((_stage_out(root, "evaluate") / "eval.json").read_text())
    assert doc["launcher"] == "external" and doc["gate"]["tasks"]["pipeline_facts"]["items"] == 20


@pytest.mark.slow
def test_strict_turns_an_inconclusive_gate_into_a_failure(tiny_build, tmp_path):
    """With no drop allowed, even identical answers cannot rule one out: inconclusive, which passes by default and
    fails the stage under eval.strict, naming the task and its interval; the build's summary shows the gate."""
    root = tmp_path / "s"
    shutil.copytree(tiny_build, root)
    proc = run_cli("build", *TINY, "eval.max_drop.fp8=0", "eval.strict=true", "until=evaluate", root=root)
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "task gate inconclusive (fp8 vs its unquantized baseline): pipeline_facts: difference" in line, line
    assert "Traceback" not in proc.stderr
    kept = next((root / "reports" / "failed").glob("*-evaluate-*/eval.md")).read_text()
    assert "| inconclusive |" in kept and "straddles the allowed" in kept
    proc = run_cli("build", *TINY, "eval.max_drop.fp8=0", "until=evaluate", root=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Task gate: inconclusive: pipeline_facts acc" in proc.stdout


def test_a_failed_request_is_named_not_the_closed_session_lm_eval_ends_with(tmp_path):
    """lm-eval 0.4.13 against an endpoint that answers every completion with a 500 (a stand-in for a model that
    fails on the server: its error body is the front end's): once the first request fails, lm-eval leaves its aiohttp
    session and the queued requests fail with "Session is closed", the last lines of its log. The stage's error names
    the status and the server's message instead."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from omegaconf import OmegaConf

    from pipeline import eval as ev
    from pipeline.errors import StageFailed
    from pipeline.stages.fetch import train_tokenizer

    body = json.dumps({"error": {"message": "the model failed: internal error in the reference runtime: TypeError: "
                                            "planted", "type": "internal_error", "param": None, "code": None}}).encode()

    class Failing(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(500)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except OSError:  # lm-eval hung up
                pass

        def log_message(self, *args):
            pass

    train_tokenizer(512).save_pretrained(tmp_path / "tok")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ecfg = OmegaConf.merge(hardware.compose([]).eval, {"limit": 20})
    try:
        with pytest.raises(StageFailed) as err:
            ev.run_harness(f"http://127.0.0.1:{server.server_address[1]}/v1", "m", tmp_path / "tok", ecfg,
                           tmp_path / "work")
    finally:
        server.shutdown()
    log = (tmp_path / "work" / "lm-eval.log").read_text()
    assert "Session is closed" in "".join(log.strip().splitlines()[-3:])  # what its last lines say
    msg = str(err.value)
    assert ("the endpoint answered HTTP 500: the model failed: internal error in the reference runtime: TypeError: "
            "planted") in msg and "Session is closed" not in msg, msg


# ------------------------------------------------------------------------------------------- SmolLM2, for real
SMOL_LABEL = "smollm2-135m.fp8-kvfp8.cpu.reference"


@pytest.fixture(scope="module")
def smol_build(smol_default_build) -> Path:
    return smol_default_build[0]


def _planted(repo: Path, dst: Path, layer: int = 0, factor: float = 2.0) -> tuple[Path, int]:
    """A copy of ``repo`` whose export has every weight scale of decoder layer ``layer`` multiplied by ``factor``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(repo, dst)  # copies: the engine files of the original are hard links into the store
    n = 0
    for f in (dst / "tensorrt_llm" / "1" / "engine").glob("*.safetensors"):
        t = load_file(f)
        for k in list(t):
            if k.endswith(".weight_scale") and f".layers.{layer}." in k:
                t[k] = t[k] * factor
                n += 1
        f.unlink()
        save_file(t, f, metadata={"format": "pt"})
    return dst, n


@pytest.mark.slow
def test_default_build_records_fp8_and_baseline_task_accuracy(smol_build):
    _, doc = _bundle(smol_build)
    t = doc["eval"]["tasks"]["pipeline_facts"]
    assert t["items"] == len((tasks.TASKS_DIR / "pipeline_facts.jsonl").read_text().splitlines())
    assert t["baseline"] > 0.6 and t["quantized"] > 0.6  # four choices: chance is 0.25
    assert t["verdict"] == "pass" and t["ci_low"] > -0.05  # the honest FP8 export passes
    assert doc["gates"]["eval"] == "pass"


@pytest.mark.slow
def test_served_baseline_scores_what_lm_evals_own_model_scores(smol_build, tmp_path):
    """Truth from outside: lm-eval's in-process Hugging Face model on the fetched checkpoint, against the same
    checkpoint served by the reference runtime through Triton and the OpenAI front end."""
    base = json.loads((_stage_out(smol_build, "eval_baseline", SMOL_LABEL) / "eval.json").read_text())
    served = base["tasks"]["pipeline_facts"]["items"]["acc"]
    ckpt = _stage_out(smol_build, "fetch", SMOL_LABEL)
    from pipeline.eval import env

    script = (f"import json, sys; from lm_eval import simple_evaluate; from lm_eval.tasks import TaskManager;"
              f"from pipeline.eval import tasks;"
              f"r = simple_evaluate(model='hf', model_args='pretrained={ckpt},dtype=bfloat16', "
              f"tasks=['pipeline_facts'], task_manager=TaskManager(include_path=str(tasks.include_dir("
              f"__import__('pathlib').Path({str(tmp_path / 'inc')!r}))), include_defaults=False), batch_size=8, "
              f"device='cpu', log_samples=True);"
              f"print(json.dumps({{str(s['doc_id']): s['acc'] for s in r['samples']['pipeline_facts']}}))")
    import os

    child = {**os.environ, "PYTHONPATH": os.pathsep.join([*env.pythonpath(), str(REPO)]), "HF_DATASETS_OFFLINE": "1",
             "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "ds")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=child, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    local = {k: float(v) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    assert set(local) == set(served)
    agree = sum(local[k] == served[k] for k in local) / len(local)
    assert agree >= 0.97, agree
    assert abs(sum(local.values()) - sum(served.values())) / len(local) <= 0.02


@pytest.mark.slow
def test_planted_regression_fails_and_the_baseline_matches_itself(smol_build, tmp_path):
    from pipeline import eval as ev

    cfg = hardware.compose([f"paths.root={smol_build}"])
    base_out = _stage_out(smol_build, "eval_baseline", SMOL_LABEL)
    baseline = json.loads((base_out / "eval.json").read_text())

    repo = _stage_out(smol_build, "package", SMOL_LABEL)
    planted, n = _planted(repo, tmp_path / "planted")
    assert n == 7  # q, k, v, o, gate, up, down of layer 0
    doc = ev.evaluate_repo(planted, cfg.serve, cfg.eval, tmp_path / "p-out", tmp_path / "p-work")
    g = gate(baseline, doc, cfg.eval, "fp8")
    t = g["tasks"]["pipeline_facts"]
    assert g["verdict"] == "fail" and t["ci_high"] < -0.05, t
    assert t["mcnemar"]["lost"] > t["mcnemar"]["gained"]

    g = gate(baseline, baseline, cfg.eval, "none")  # the baseline compared with itself
    t = g["tasks"]["pipeline_facts"]
    assert t["difference"] == 0 and t["ci_low"] == 0 == t["ci_high"] and g["verdict"] == "pass"

    # Re-served and re-run: which prompts arrive together (share a prefill pass) depends on timing, but each
    # prompt's pass has a shape fixed by its own length, so every item scores as it did: exactly zero again.
    again = ev.evaluate_repo(base_out / "triton_repo", cfg.serve, cfg.eval, tmp_path / "b-out", tmp_path / "b-work")
    first, second = baseline["tasks"]["pipeline_facts"]["items"]["acc"], again["tasks"]["pipeline_facts"]["items"]["acc"]
    assert first == second
    g = gate(baseline, again, cfg.eval, "none")
    t = g["tasks"]["pipeline_facts"]
    assert t["difference"] == 0 and t["ci_low"] == 0 == t["ci_high"] and g["verdict"] == "pass", t
