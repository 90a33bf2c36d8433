"""Shared fixtures. Tests compose the real config, shrink to the synthetic ``tiny-qwen3`` model, write under
``tmp_path``, and run the real CLI in a subprocess (real ModelOpt, real tritonserver, real tritonclient)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# A test runner started in the background by a non-interactive shell (`.ci/run &`, `nohup`) ignores SIGINT, and every
# child inherits that: Python then installs no KeyboardInterrupt handler, and the tests that interrupt a build, a
# sweep or `pipeline serve` as Ctrl-C does would see it run on. Tests run with Ctrl-C's default meaning, however they
# were started (the pipeline itself keeps an inherited "ignore", as any Unix program does).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REPO = Path(__file__).resolve().parents[1]
# quant.gate=warn: a random model's logits move more under quantization than the real-model gates allow.
TINY = ["model=tiny-qwen3", "quant.gate=warn", "bench.concurrency=[1,2]", "bench.requests_per_level=3",
        "bench.warmup_requests=1", "bench.workloads.chat.max_tokens=8",
        "bench.workloads.rag.prompt_words=120", "bench.workloads.rag.max_tokens=4",
        "bench.gates.regression_pct=null",  # CPU timings of a random model are noise: no regression gate here
        "eval.limit=20",  # a random model scores chance either way: a few items show the task gate works
        "bench.aiperf=false"]  # aiperf's own export (a run per level) is checked on one build of its own (test_bench)


def cli_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HF_HOME": str(tmp / "hf-home"), "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp), **extra})
    env.pop("HF_TOKEN", None)
    env.update(extra)
    return env


def run_cli(*args: str, root: Path, env: dict[str, str] | None = None, timeout: float = 900,
            cwd: Path | None = None, raw: bool = False) -> subprocess.CompletedProcess:
    """``python -m pipeline ARGS paths.root=ROOT`` in a subprocess; returns the completed process (with ``raw``, its
    output is decoded as written: carriage returns are kept, not turned into newlines)."""
    root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pipeline", *args]
    if args and args[0] not in ("validate", "lint", "verify", "diff", "matrix"):
        cmd.append(f"paths.root={root}")
    proc = subprocess.run(cmd, cwd=cwd or root, env=env or cli_env(root), capture_output=True, text=not raw,
                          timeout=timeout)
    if raw:
        proc.stdout, proc.stderr = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    return proc


def report(root: Path, label: str = "tiny-qwen3.fp8-kvfp8.cpu.reference") -> dict:
    return json.loads((root / "reports" / f"{label}.json").read_text())


def statuses(root: Path, label: str = "tiny-qwen3.fp8-kvfp8.cpu.reference") -> dict[str, str]:
    return {r["stage"]: r["status"] for r in report(root, label)["stages"]}


def ensure_tiny_build(base: Path) -> tuple[Path, dict]:
    """Build the shared tiny-qwen3 build under ``base`` once (under a file lock; whoever comes later waits and reads
    the record). -> (output root, {"returncode", "stdout", "stderr"} of the CLI)."""
    from filelock import FileLock

    root, done = base / "tiny-build", base / "tiny-build.json"
    with FileLock(str(base / "tiny-build.lock")):
        if not done.is_file():
            proc = run_cli("build", *TINY, root=root, raw=True)
            done.write_text(json.dumps({"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}))
    return root, json.loads(done.read_text())


@pytest.fixture(scope="session")
def tiny_build_run(tmp_path_factory) -> tuple[Path, dict]:
    """One full tiny-qwen3 build through every stage, run non-interactively (output captured), shared by the
    end-to-end tests (read-only for them) and, under pytest-xdist, by every worker of the run (built once, under a
    file lock; the controller starts it as soon as the collection shows a test that reads it). -> (output root,
    {"returncode", "stdout", "stderr"} of the CLI)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the directory every worker's base temp lies in
    root, out = ensure_tiny_build(base)
    assert out["returncode"] == 0, out["stderr"][-3000:]
    return root, out


# Seconds each test module took in a recorded run of the fast tier on 2 cores (tests/durations.json; refreshed by
# `python -m tests.helpers.durations JUNIT_XML` from a run with --junitxml). Only the order of the modules depends on
# it, never what runs: a module missing from it counts as a short one.
DURATIONS = REPO / "tests" / "durations.json"


def _uses_tiny_build(path: Path) -> bool:
    return path.is_file() and path.name != "conftest.py" and "tiny_build" in path.read_text()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Under xdist (``--dist loadfile --no-loadscope-reorder``: each module is one unit, handed out in this order as
    workers free up): first the modules that do not read the shared tiny build, then those that do, each group
    longest first. The workers start on modules that need nothing while the controller builds the tiny build in the
    background, and no long module starts last while the other worker idles. Within a module the order is
    unchanged."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)  # set on xdist's workers, which collect
    if workers < 2 or len(items) < 2:
        return
    weights = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    files = list(dict.fromkeys(item.nodeid.split("::")[0] for item in items))
    # stable: ties keep the collection order
    ranked = sorted(files, key=lambda f: (_uses_tiny_build(REPO / f), -float(weights.get(f, 0.0))))
    order = {f: i for i, f in enumerate(ranked)}
    items.sort(key=lambda item: order[item.nodeid.split("::")[0]])


_PREBUILD: dict[str, subprocess.Popen] = {}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """On the xdist controller: start the shared tiny build in the background as soon as a collected test module
    uses it, so that no worker sits idle waiting for it while the tests that do not need it run."""
    if _PREBUILD:
        return
    if not any(_uses_tiny_build(REPO / f) for f in {i.split("::")[0] for i in ids}):
        _PREBUILD["none"] = None
        return
    base = node.config._tmp_path_factory.getbasetemp()
    log = open(base / "tiny-build.prebuild.log", "w")
    _PREBUILD["prebuild"] = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from tests.conftest import ensure_tiny_build; "
                               "ensure_tiny_build(Path(sys.argv[1]))", str(base)],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def pytest_sessionfinish(session):
    proc = _PREBUILD.get("prebuild")
    if proc is not None and proc.poll() is None:  # the run ended first (a failure, -x, ^C): nothing left behind
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.fixture(scope="session")
def tiny_build(tiny_build_run) -> Path:
    """The shared tiny-qwen3 build's output root (read-only for the tests)."""
    return tiny_build_run[0]


@pytest.fixture(scope="session")
def smol_default_build(tmp_path_factory):
    """One ``pipeline build`` of the embedded default (SmolLM2-135M, FP8 + FP8 KV, every stage with the task
    evaluation), shared by the slow tests that read it (read-only for them). -> (output root, the CLI's completed
    process, text)."""
    root = tmp_path_factory.mktemp("smol-default")
    proc = run_cli("build", root=root, timeout=2400, raw=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, proc


@pytest.fixture(autouse=True)
def _clear_hydra():
    yield
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
