"""``hydra/launcher=pipeline_slurm`` against a real Slurm: a one-node cluster on loopback (Debian's slurm-wlm 22.05,
slurmctld + slurmd + munged, ``tools/slurm_cluster.py``) started once for the module and torn down after it. Sweeps
are submitted by the real CLI with ``SLURM_CONF`` pointing at it; the jobs run on the node as Slurm starts them.

The cluster needs root (its daemons run as root with a munge key of their own; the packages are installed with
apt-get where missing): elsewhere the tests that use it are skipped with the reason. Slow tier: each job starts a Python process that imports
the pipeline; the sweeps use the tiny synthetic model."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, cli_env, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # serial: the teardown looks through every process

_spec = importlib.util.spec_from_file_location("slurm_cluster", REPO / "tools" / "slurm_cluster.py")
slurm_cluster = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(slurm_cluster)

SLURM = ["hydra/launcher=pipeline_slurm"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The running one-node cluster; stopped (jobs cancelled, daemons stopped, its directory with the munge key
    removed) after the module, and checked to have left nothing."""
    if os.geteuid() != 0:
        pytest.skip("the test Slurm cluster needs root (its daemons run as root; apt-get installs slurm-wlm, munge)")
    root = tmp_path_factory.mktemp("slurm") / "cluster"
    # four job slots on this 2-core machine (SlurmdParameters=config_overrides): jobs that share a stage overlap
    c = slurm_cluster.Cluster(root, cpus=4, gpus=2, kill_wait_s=10)
    try:
        c.start()
    except slurm_cluster.Unavailable as exc:
        pytest.fail(f"the test cluster did not start: {exc}")
    yield c
    conf = c.conf
    c.stop()
    assert not root.exists()
    assert not c.leftover_pids(), "a process with the cluster's SLURM_CONF outlived it"
    assert not conf.exists()


def test_the_hosts_pages_trial_commands_run_as_written(tmp_path):
    """docs/hosts.md's four lines that try a sweep without a cluster, run as the page writes them (its /tmp/slurm-test
    made this test's directory; first in the module, before the shared cluster starts): up, export, the sweep, whose
    launcher settings reach sbatch (the time limit, and an sbatch option added as the page says), and down."""
    import shlex

    if os.geteuid() != 0:
        pytest.skip("the test Slurm cluster needs root (its daemons run as root; apt-get installs slurm-wlm, munge)")
    text = (REPO / "docs" / "hosts.md").read_text().split("To try it without a cluster", 1)[1]
    where = tmp_path / "slurm-test"
    lines = [x.split("  #", 1)[0].strip().replace("/tmp/slurm-test", str(where))
             for x in text.splitlines() if x.startswith("    ")][:4]
    up, export, build, down = lines
    assert up.startswith(".venv/bin/python tools/slurm_cluster.py up ") and export.startswith("export SLURM_CONF=")
    assert build.startswith("python -m pipeline build -m ") and down.startswith(".venv/bin/python tools/slurm_cluster")
    started = subprocess.run([sys.executable, *shlex.split(up)[1:]], cwd=REPO, capture_output=True, text=True,
                             timeout=600)
    assert started.returncode == 0, started.stderr[-3000:]
    try:
        key, value = export.removeprefix("export ").split("=", 1)
        root = tmp_path / "sweep"
        proc = run_cli(*shlex.split(build)[3:], root=root, env=cli_env(root, **{key: value}), timeout=1200)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "Slurm sweep: 2 done, 0 failed" in proc.stdout
        submit_dir = Path(re.search(r"^submit dir: (\S+)$", proc.stderr, re.M).group(1))
        script = next(submit_dir.rglob("*_submission.sh")).read_text()
        assert "#SBATCH --time=30" in script and "#SBATCH --mail-type=NONE" in script, script
    finally:
        stopped = subprocess.run([sys.executable, *shlex.split(down)[1:]], cwd=REPO, capture_output=True, text=True,
                                 timeout=600)
    assert stopped.returncode == 0 and not where.exists(), stopped.stderr[-3000:]


def slurm_env(cluster, root: Path) -> dict[str, str]:
    return cli_env(root, SLURM_CONF=str(cluster.conf))


def scontrol(cluster, job_id: str) -> dict[str, str]:
    """``scontrol show job -o JOB_ID`` as {field: value} (the first record: one array task, or the job)."""
    line = cluster.run("scontrol", "show", "job", "-o", job_id).stdout.splitlines()[0]
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", line))


def summary_rows(stdout: str) -> list[dict[str, str]]:
    """The sweep summary's job rows, in job order: [{"num", "label", "slurm_id", "outcome", "log"}]."""
    return [{"num": m.group(1), "label": m.group(2), "slurm_id": m.group(3), "outcome": m.group(4),
             "log": m.group(5)}
            for m in re.finditer(r"^\s+[✓✗] #(\d+) (.+?)  job (\S+)  (done|failed)  log: (\S+)$", stdout, re.M)]


def by_label(stdout: str) -> dict[str, dict[str, str]]:
    return {r["label"]: r for r in summary_rows(stdout)}


def statuses(root: Path, label: str) -> dict[str, str]:
    doc = json.loads((root / "reports" / f"{label}.json").read_text())
    return {r["stage"]: r["status"] for r in doc["stages"]}


def test_cpu_sweep_runs_on_the_cluster_into_the_store_and_reruns_all_cached(cluster, tmp_path):
    """The README's sweep shape on CPU targets: one array of four jobs, run by slurmd on the node; the results land
    in the store and reports a local run reads; the same sweep again is all cache hits."""
    root = tmp_path / "sweep"
    args = ("build", "-m", *TINY, "target=cpu,cpu", "quant=fp8,none", "until=package", *SLURM)
    proc = run_cli(*args, root=root, env=slurm_env(cluster, root), timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    array = re.search(r"^submitted Slurm array (\d+): 4 jobs \(default partition\)$", proc.stderr, re.M).group(1)
    progress = re.findall(r"^slurm: 4 jobs: (\d+) queued, (\d+) running, (\d+) done, (\d+) failed$", proc.stderr,
                          re.M)
    assert progress[-1] == ("0", "0", "4", "0") and len(progress) >= 2  # seen waiting, then all done
    assert any(int(r) > 0 for _, r, _, _ in progress)  # seen running
    submit_dir = re.search(r"^submit dir: (\S+)$", proc.stderr, re.M).group(1)
    assert f"Slurm sweep: 4 done, 0 failed; submit dir: {submit_dir}" in proc.stdout
    rows = summary_rows(proc.stdout)
    assert [r["slurm_id"] for r in rows] == [f"{array}_{i}" for i in range(4)]
    assert [r["label"] for r in rows] == ["quant=fp8", "quant=none"] * 2  # target=cpu,cpu: the same two twice
    for r in rows:  # each job ran on the node, as Slurm's array task, and its log is where it says
        assert Path(r["log"]).is_file() and Path(r["log"]).is_relative_to(submit_dir)
        out = Path(r["log"]).with_suffix(".out").read_text()
        assert f"JobEnvironment(job_id={r['slurm_id']}, hostname=" in out
        job = scontrol(cluster, r["slurm_id"])
        assert (job["JobState"], job["Partition"], job["NodeList"]) == ("COMPLETED", "cpu", "node1")
    # into the store and reports a local run uses: a local plan of each job finds every stage cached
    labels = {"fp8": "tiny-qwen3.fp8-kvfp8.cpu.reference", "none": "tiny-qwen3.none-kvfp8.cpu.reference"}
    for q in labels:
        plan = run_cli("plan", "--json", *TINY, "target=cpu", f"quant={q}", "until=package", root=root)
        assert plan.returncode == 0, plan.stderr[-2000:]
        assert [s["cached"] for s in json.loads(plan.stdout)["stages"]] == [True] * 4
    stages = ("fetch", "quantize", "build", "package")
    ran = stage_counts(root, "ran")
    assert ran == {"fetch": 1, "quantize": 2, "build": 2, "package": 2}  # fp8 and none, each by one of its 2 jobs
    assert len(list(root.glob(".store/*-quantize-*/manifest.json"))) == 2

    again = run_cli(*args, root=root, env=slurm_env(cluster, root), timeout=1200)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "Slurm sweep: 4 done, 0 failed" in again.stdout
    assert stage_counts(root, "ran") == ran  # nothing built again: the first run's builds are the control
    assert stage_counts(root, "cached") == {s: 8 - ran[s] for s in stages}  # every stage of the 4 new jobs
    assert all(set(statuses(root, label).values()) == {"cached"} for label in labels.values())


def stage_counts(root: Path, status: str) -> dict[str, int]:
    """How often each stage was logged with ``status`` (ran, cached) in the store's run logs, every job's."""
    logs = "".join(p.read_text() for p in (root / ".store" / "logs").glob("*.log"))
    return {s: logs.count(f"stage {s}: {status}") for s in ("fetch", "quantize", "build", "package")}


def test_gpu_targets_get_their_resources_and_the_job_refuses_without_a_gpu(cluster, tmp_path):
    """Each GPU target's array asks for its partition, constraint and TP x PP GPUs, as scontrol shows; Slurm places
    it (the node has the features and the gpu GRES), and the job itself refuses with the plan's one line: no GPU
    here. Nothing is built on the CPU. nvfp4 x h100 is left out before anything is submitted."""
    root = tmp_path / "gpu"
    proc = run_cli("build", "-m", *TINY, "target=h100,b200", "quant=fp8,nvfp4", "until=build", *SLURM, root=root,
                   env=slurm_env(cluster, root), timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "skipped target=h100 quant=nvfp4: nvfp4 needs Blackwell" in proc.stderr
    arrays = dict((m.group(2), m.group(1)) for m in re.finditer(
        r"^submitted Slurm array (\d+): \d jobs? \(--partition=gpu --constraint=(\w+) --gpus-per-node=1\)$",
        proc.stderr, re.M))
    assert sorted(arrays) == ["b200", "h100"]
    lines = proc.stderr.splitlines()
    submits = [i for i, x in enumerate(lines) if x.startswith("submitted Slurm array")]
    assert max(submits) < min(i for i, x in enumerate(lines) if x.startswith("slurm: "))  # all before any wait
    rows = by_label(proc.stdout)
    assert sorted(rows) == ["target=b200 quant=fp8", "target=b200 quant=nvfp4", "target=h100 quant=fp8"]
    for label, r in rows.items():
        target, quant = (kv.split("=")[1] for kv in label.split())
        job = scontrol(cluster, r["slurm_id"])
        assert r["slurm_id"].split("_")[0] == arrays[target]
        assert (job["Partition"], job["Features"], job["TresPerNode"]) == ("gpu", target, "gres:gpu:1")
        assert (job["JobState"], job["NodeList"]) == ("FAILED", "node1")  # placed and run; failed in the job
        plan = run_cli("plan", "--json", *TINY, f"target={target}", f"quant={quant}", "until=build", root=root)
        reason = json.loads(plan.stdout)["not_buildable_here"]
        assert reason and reason[0].startswith(f"target {target} (sm")  # the plan's own line, computed here
        line = f"error: {reason[0]}"
        assert r["outcome"] == "failed" and f"      {line}" in proc.stdout.splitlines()
        assert line in Path(r["log"]).read_text().splitlines()  # the job's own stderr says it
        assert f"(Slurm job {r['slurm_id']}, log {r['log']}): {line}" in proc.stderr.splitlines()[-1]
    assert proc.stderr.splitlines()[-1].startswith("failed: 3 of 3 Slurm jobs failed: ")
    assert not list(root.glob(".store/*-quantize-*")) and not list(root.glob("engines/*"))  # never ran on the CPU
    assert not list(root.glob("reports/*.json"))


def test_one_failing_job_fails_only_itself(cluster, tmp_path):
    """A planted bad override that only the job can find (a Hub calibration dataset, unreachable where the job runs)
    fails its job; the sweep's other job finishes; the summary and the last line name the failed job with its Slurm
    job id and log; exit 1."""
    root = tmp_path / "fail"
    proc = run_cli("build", "-m", *TINY, "target=cpu", "quant=fp8,none", "quant.kv_cache=none",
                   "quant.calib.dataset=nobody/missing-calib", "until=quantize", *SLURM, root=root,
                   env=slurm_env(cluster, root), timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = by_label(proc.stdout)
    bad, good = rows["quant=fp8"], rows["quant=none"]
    assert (bad["outcome"], good["outcome"]) == ("failed", "done")
    assert scontrol(cluster, bad["slurm_id"])["JobState"] == "FAILED"
    assert scontrol(cluster, good["slurm_id"])["JobState"] == "COMPLETED"
    last = proc.stderr.splitlines()[-1]
    assert last.startswith(f"failed: 1 of 2 Slurm jobs failed: #{bad['num']} quant=fp8 (Slurm job "
                           f"{bad['slurm_id']}, log {bad['log']}): error: quant.calib.dataset=nobody/missing-calib "
                           f"comes from the Hub"), last
    assert any(x.startswith("error: quant.calib.dataset=nobody/missing-calib comes from the Hub")
               for x in Path(bad["log"]).read_text().splitlines())
    assert "slurm: 2 jobs: 0 queued, 0 running, 1 done, 1 failed" in proc.stderr
    assert statuses(root, "tiny-qwen3.none-kvnone.cpu.reference") == {"fetch": "ran", "quantize": "ran"}
    assert not (root / "reports" / "tiny-qwen3.fp8-kvnone.cpu.reference.json").exists()


def test_an_array_slurm_refuses_is_one_line_and_nothing_runs(cluster, tmp_path):
    """A partition the cluster does not have: sbatch refuses the array; one error line naming it and the fix,
    exit 2, no job left in the queue."""
    root = tmp_path / "refused"
    proc = run_cli("build", "-m", *TINY, "target=h100", "target.slurm.partition=nosuch", "quant=fp8,none", *SLURM,
                   root=root, env=slurm_env(cluster, root), timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: Slurm refused the array for --partition=nosuch --constraint=h100 "
                           "--gpus-per-node=1: ") and "invalid partition" in last.lower(), last
    assert "Traceback" not in proc.stderr and cluster.jobs() == []


def test_without_sbatch_the_sweep_is_refused_in_one_line(tmp_path):
    """No Slurm client on PATH (not a cluster machine): one line naming what to do, exit 2, nothing submitted."""
    root = tmp_path / "nosbatch"
    proc = run_cli("build", "-m", *TINY, "target=cpu", "quant=fp8,none", *SLURM, root=root,
                   env=cli_env(root, PATH=str(Path(sys.executable).parent)), timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: hydra/launcher=pipeline_slurm submits with Slurm's sbatch, which is not on PATH here")
    assert not list(root.glob(".store/*-fetch-*"))


def _tmp_outputs(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp" in p.name]


def _held_locks(root: Path) -> list[Path]:
    from filelock import FileLock, Timeout

    held = []
    for p in (root / ".store" / "locks").glob("*.lock"):
        try:
            FileLock(str(p)).acquire(timeout=0).lock.release()
        except Timeout:
            held.append(p)
    return held


def test_ctrl_c_cancels_the_submitted_arrays_and_leaves_nothing_half_written(cluster, tmp_path):
    """SIGINT to the submitting process while its jobs are writing a stage: the arrays are cancelled (squeue
    empty), no temp output or held lock is left in the store, exit 130."""
    root = tmp_path / "cancel"
    root.mkdir()
    cmd = [sys.executable, "-m", "pipeline", "build", "-m", *TINY, "target=cpu", "quant=fp8,none",
           "until=quantize", *SLURM, f"paths.root={root}"]
    proc = subprocess.Popen(cmd, cwd=root, env=slurm_env(cluster, root), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while not _tmp_outputs(root / ".store") and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert _tmp_outputs(root / ".store"), "no job started writing a stage"
        running = cluster.jobs()
        assert running and all(j.endswith("RUNNING") for j in running), running
        assert _held_locks(root)  # a job holds its stage's lock: the check below can see one
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    array = re.search(r"^submitted Slurm array (\d+):", err, re.M).group(1)
    assert f"cancelled Slurm array {array}" in err and err.rstrip().endswith("interrupted")
    assert cluster.jobs() == []
    assert all(scontrol(cluster, f"{array}_{i}")["JobState"] == "CANCELLED" for i in range(2))
    assert _tmp_outputs(root) == [] and _held_locks(root) == []
    assert not list(root.glob(".store/*-quantize-*"))  # nothing finished behind the cancel


def readme_sweep() -> list[str]:
    """The sweep command of the README's cluster section (after ``python -m pipeline``), as written there."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("### Sweeps on a Slurm cluster"):]
    section = section[:section.index("\n#", 10)]  # up to the next heading
    lines = [x.strip() for x in section.splitlines() if x.startswith("    python -m pipeline build ") and "tiny" in x]
    assert len(lines) == 1, lines
    return lines[0].split()[3:]


def test_two_sweeps_sharing_a_store_build_each_stage_once(cluster, tmp_path):
    """The README's sweep, twice at once into one store, the jobs running side by side on the node: it runs as
    written, and each stage output is built by one job; the other waits on its lock and takes it cached."""
    root = tmp_path / "shared"
    root.mkdir()
    args = readme_sweep()
    assert args[:2] == ["build", "-m"] and "hydra/launcher=pipeline_slurm" in args
    cmd = [sys.executable, "-m", "pipeline", *args, f"paths.root={root}"]
    procs = [subprocess.Popen(cmd, cwd=root, env=slurm_env(cluster, root), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=1200) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    rows = [row for o in outs for row in summary_rows(o[0])]
    assert [r["label"] for r in rows] == ["quant=fp8", "quant=none"] * 2
    for a, b in ((0, 2), (1, 3)):  # the same job of the two sweeps ran at the same time
        ja, jb = scontrol(cluster, rows[a]["slurm_id"]), scontrol(cluster, rows[b]["slurm_id"])
        assert max(ja["StartTime"], jb["StartTime"]) < min(ja["EndTime"], jb["EndTime"]), (ja, jb)
    logs = "".join(p.read_text() for p in (root / ".store" / "logs").glob("*.log"))
    assert logs.count("stage fetch: ran") == 1 and logs.count("stage fetch: cached") == 3
    assert logs.count("stage quantize: ran") == 2 and logs.count("stage quantize: cached") == 2
    assert len(list(root.glob(".store/*-quantize-*/manifest.json"))) == 2


def test_a_job_past_its_time_limit_fails_in_one_line_naming_timeout_min(cluster, tmp_path):
    """A one-minute limit with submitit's signal 40 s before it: the job (fetch to bench: longer than 20 s) is ended
    by submitit at the signal ("timed-out too many times" in its log); the sweep's line names
    hydra.launcher.timeout_min, the limit and the fix."""
    root = tmp_path / "late"
    proc = run_cli("build", "-m", *TINY, "target=cpu", "quant=fp8", "until=bench", *SLURM,
                   "hydra.launcher.timeout_min=1", "hydra.launcher.signal_delay_s=40", root=root,
                   env=slurm_env(cluster, root), timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = ("failed: the job ran into its time limit, hydra.launcher.timeout_min=1 (Slurm's limit: 1 min; submitit "
            "stops the job hydra.launcher.signal_delay_s=40 s before it); raise hydra.launcher.timeout_min and run "
            "the sweep again (the stages that finished are reused)")
    assert line in proc.stdout and proc.stderr.strip().splitlines()[-1].endswith(line), proc.stdout[-2000:]
    row = summary_rows(proc.stdout)[0]
    assert "timed-out too many times" in Path(row["log"]).read_text()  # submitit's own words, in the job's log

