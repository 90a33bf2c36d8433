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
from typing import Sequence

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


def slurm_env(cluster, root: Path, **extra: str) -> dict[str, str]:
    return cli_env(root, SLURM_CONF=str(cluster.conf), **extra)


def hold(release: Path, quant: str = "") -> list[str]:
    """Overrides that hold each job (or those of ``quant``) inside its quantize stage, its temp output made and its
    lock taken, until ``release`` exists (``tests/helpers/slurm_hold.py``; the sweep needs :func:`held_env`)."""
    return ["+hydra.callbacks.hold._target_=tests.helpers.slurm_hold.HoldQuantize",
            f"+hydra.callbacks.hold.release={release}", *([f"+hydra.callbacks.hold.quant={quant}"] if quant else [])]


def held_env(cluster, root: Path) -> dict[str, str]:
    """The sweep's environment with the checkout on PYTHONPATH: the submitter and the jobs import the hold."""
    return slurm_env(cluster, root, PYTHONPATH=str(REPO))


def held(release: Path) -> list[str]:
    """The Slurm jobs (``ARRAY_TASK``) the hold has stopped so far."""
    return sorted(p.name.rsplit(".held-", 1)[1] for p in release.parent.glob(f"{release.name}.held-*"))


def start_sweep(args: Sequence[str], root: Path, env: dict[str, str], name: str = "sweep"):
    """``python -m pipeline ARGS paths.root=ROOT`` started in the background, its stdout and stderr written to files
    the test reads while it runs: (process, stdout file, stderr file)."""
    out, err = root / f"{name}.stdout", root / f"{name}.stderr"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline", *args, f"paths.root={root}"], cwd=root, env=env,
                                stdout=o, stderr=e, text=True)
    return proc, out, err


def wait_for(what: str, ready, proc=None, timeout: float = 600) -> None:
    """Poll ``ready()`` until true; fail naming ``what`` if the sweep ``proc`` ended or the time ran out first."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc is None or proc.poll() is None, f"the sweep ended ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.3)


def task_states(cluster, array: str) -> dict[str, str]:
    """{ARRAY_TASK: state} of the array's tasks the controller holds, ended ones included."""
    lines = cluster.run("squeue", "-h", "-r", "-t", "all", "-j", array, "-o", "%i %T").stdout.splitlines()
    return dict(x.split() for x in lines if x.strip())


def array_of(err: Path) -> str | None:
    m = re.search(r"^submitted Slurm array (\d+):", err.read_text(), re.M)
    return m.group(1) if m else None


def scontrol(cluster, job_id: str) -> dict[str, str]:
    """``scontrol show job -o JOB_ID`` as {field: value} (the first record: one array task, or the job)."""
    line = cluster.run("scontrol", "show", "job", "-o", job_id).stdout.splitlines()[0]
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", line))


def summary_rows(stdout: str) -> list[dict[str, str]]:
    """The sweep summary's job rows, in job order: [{"num", "label", "slurm_id", "outcome", "log"}]."""
    return [{"num": m.group(1), "label": m.group(2), "slurm_id": m.group(3), "outcome": m.group(4),
             "log": m.group(5)}
            for m in re.finditer(r"^\s+[✓✗] #(\d+) (.+?)  job (\S+)  (done|failed|cancelled)  log: (\S+)$", stdout,
                                 re.M)]


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
    # no partition (the cluster's default); the CPUs and memory of the plan: one process, a model of a few MB
    array = re.search(r"^submitted Slurm array (\d+): 4 jobs \(--cpus-per-task=1 --mem=1GB\)$", proc.stderr,
                      re.M).group(1)
    assert re.search(r"^  --cpus-per-task=1 from the plan: 1 job process; --mem=1GB from the plan: .* GB of bf16 "
                     r"weights x 1.1 held in host memory \+ 0.7 GB for the job's process$", proc.stderr, re.M)
    progress = re.findall(r"^slurm: 4 jobs: (\d+) queued(?: \(\w+\))?, (\d+) running, (\d+) done, (\d+) failed; "
                          r"\d+:\d\d:\d\d elapsed$", proc.stderr, re.M)
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
    """Each GPU target's array asks for its partition, constraint and TP x PP GPUs, and the CPUs and memory of its
    plan, as scontrol shows; Slurm places it (the node has the features and the gpu GRES), and the job itself
    refuses in one line that names the node, the job and what the node lacks, and points at target.slurm (not at
    the fan-out that submitted it, which the same plan outside Slurm advises). Nothing is built on the CPU.
    nvfp4 x h100 is left out before anything is submitted."""
    root = tmp_path / "gpu"
    proc = run_cli("build", "-m", *TINY, "target=h100,b200", "quant=fp8,nvfp4", "until=build", *SLURM, root=root,
                   env=slurm_env(cluster, root), timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "skipped target=h100 quant=nvfp4: nvfp4 needs Blackwell" in proc.stderr
    # one process (nothing served, the reference runtime has no ranks); a few MB of model + a GPU job's 11.6 GB
    arrays = dict((m.group(2), m.group(1)) for m in re.finditer(
        r"^submitted Slurm array (\d+): \d jobs? \(--partition=gpu --constraint=(\w+) --gpus-per-node=1 "
        r"--cpus-per-task=1 --mem=12GB\)$", proc.stderr, re.M))
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
        assert (job["NumCPUs"], job["MinMemoryNode"]) == ("1", "12G")
        assert (job["JobState"], job["NodeList"]) == ("FAILED", "node1")  # placed and run; failed in the job
        sm = {"h100": 90, "b200": 100}[target]
        expected = re.escape(
            f"error: target {target} (sm{sm}) needs its GPU to build, and node node1 (Slurm job {r['slurm_id']}) has "
            f"none that NVML can see, although Slurm allocated it GPU @: the node lacks an sm{sm} GPU with a working "
            f"NVIDIA driver; make target.slurm (partition=gpu constraint={target}) select only nodes with an sm{sm} "
            f"GPU and its driver (sinfo -N -o '%N %P %f %G' lists each node's partitions, features and GPUs), or "
            f"report node1 to the cluster's admins").replace("@", r"[01]")  # the gres index Slurm gave the job
        [line] = [x for x in Path(r["log"]).read_text().splitlines() if re.fullmatch(expected, x)]  # its stderr
        assert r["outcome"] == "failed" and f"      {line}" in proc.stdout.splitlines()
        assert f"(Slurm job {r['slurm_id']}, log {r['log']}): {line}" in proc.stderr.splitlines()[-1]
        # control: the same plan outside Slurm (here, no GPU) advises the fan-out the job came from
        plan = run_cli("plan", "--json", *TINY, f"target={target}", f"quant={quant}", "until=build", root=root)
        reason = json.loads(plan.stdout)["not_buildable_here"][0]
        assert "hydra/launcher=pipeline_slurm" in reason and "node1" not in reason and "hydra/launcher" not in line
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
                           "--gpus-per-node=1 --cpus-per-task=4 --mem=12GB: "), last
    assert "invalid partition" in last.lower(), last
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
    """SIGINT to the submitting process while both its jobs are writing a stage (each held inside quantize, its temp
    output made and its lock taken, until the test releases it: tests/helpers/slurm_hold.py): the arrays are
    cancelled (squeue empty), no temp output or held lock is left in the store, the summary lists both jobs
    cancelled, exit 130. The release comes after the sweep ended: a job process that outlived the cancel would then
    finish its stage, which the last check would see."""
    root = tmp_path / "cancel"
    root.mkdir()
    release = tmp_path / "release"
    args = ["build", "-m", *TINY, "target=cpu", "quant=fp8,none", "until=quantize", *SLURM, *hold(release)]
    proc, out, err = start_sweep(args, root, held_env(cluster, root))
    try:
        wait_for("both jobs held in their quantize stage", lambda: len(held(release)) == 2, proc)
        assert len(_tmp_outputs(root / ".store")) == 2
        running = cluster.jobs()
        assert len(running) == 2 and all(j.endswith("RUNNING") for j in running), running
        assert len(_held_locks(root)) == 2  # each job holds its stage's lock: the check below can see one
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    stdout, stderr = out.read_text(), err.read_text()
    assert proc.returncode == 130, stderr[-3000:]
    array = array_of(err)
    assert f"cancelled Slurm array {array}" in stderr and stderr.rstrip().endswith("interrupted")
    assert cluster.jobs() == []
    assert all(scontrol(cluster, f"{array}_{i}")["JobState"] == "CANCELLED" for i in range(2))
    assert [(r["label"], r["outcome"]) for r in summary_rows(stdout)] == [("quant=fp8", "cancelled"),
                                                                          ("quant=none", "cancelled")]
    assert "Slurm sweep interrupted: 0 done, 0 failed, 2 cancelled" in stdout
    assert _tmp_outputs(root) == [] and _held_locks(root) == []
    release.touch()
    time.sleep(5)
    assert not list(root.glob(".store/*-quantize-*")) and _tmp_outputs(root) == []  # nothing finished behind it


def test_ctrl_c_summary_lists_the_jobs_that_finished(cluster, tmp_path):
    """Ctrl-C after one job of the sweep finished and while the other is held mid-stage: the summary lists the
    finished one as done (its output stays in the store) and the other as cancelled (nothing of it left), exit 130."""
    root = tmp_path / "partly"
    root.mkdir()
    release = tmp_path / "release"
    args = ["build", "-m", *TINY, "target=cpu", "quant=fp8,none", "until=quantize", *SLURM, *hold(release, "fp8")]
    proc, out, err = start_sweep(args, root, held_env(cluster, root))
    try:
        wait_for("the fp8 job held", lambda: len(held(release)) == 1, proc)
        array = array_of(err)
        wait_for("the none job completed", lambda: task_states(cluster, array).get(f"{array}_1") == "COMPLETED",
                 proc)
        assert task_states(cluster, array)[f"{array}_0"] == "RUNNING" and held(release) == [f"{array}_0"]
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        release.touch()
    stdout, stderr = out.read_text(), err.read_text()
    assert proc.returncode == 130, stderr[-3000:]
    assert [(r["label"], r["slurm_id"], r["outcome"]) for r in summary_rows(stdout)] == [
        ("quant=fp8", f"{array}_0", "cancelled"), ("quant=none", f"{array}_1", "done")]
    assert "Slurm sweep interrupted: 1 done, 0 failed, 1 cancelled; submit dir: " in stdout
    assert scontrol(cluster, f"{array}_0")["JobState"] == "CANCELLED"
    assert stderr.rstrip().endswith("interrupted")
    assert [p.name.split("-quantize-")[0] for p in root.glob(".store/*-quantize-*")] == ["tiny-qwen3.none-kvfp8"]
    assert _tmp_outputs(root) == [] and _held_locks(root) == []


def test_a_hangup_leaves_the_arrays_running_and_the_same_sweep_resumes(cluster, tmp_path):
    """SIGHUP (the terminal closed) while both jobs are held mid-stage: one line on stderr names the array, says it
    runs on and how to resume, exit 129, and the jobs still run. The same sweep run again is the resume: its jobs
    wait on the first ones' locks, and once those are released and finish, take their outputs from the store."""
    root = tmp_path / "hangup"
    root.mkdir()
    release = tmp_path / "release"
    args = ["build", "-m", *TINY, "target=cpu", "quant=fp8,none", "until=quantize", *SLURM, *hold(release)]
    env = held_env(cluster, root)
    first, _, err = start_sweep(args, root, env, "first")
    again = None
    try:
        wait_for("both jobs held in their quantize stage", lambda: len(held(release)) == 2, first)
        array = array_of(err)
        first.send_signal(signal.SIGHUP)
        first.wait(timeout=120)
        stderr = err.read_text()
        assert first.returncode == 129, stderr[-3000:]
        assert stderr.rstrip().splitlines()[-1].startswith(
            f"hangup (SIGHUP: the terminal closed): stopped waiting; Slurm array {array} runs on, nothing cancelled "
            f"(2 of 2 jobs not finished; scancel {array} stops them); run the same sweep again to resume"), stderr
        assert task_states(cluster, array) == {f"{array}_0": "RUNNING", f"{array}_1": "RUNNING"}
        assert len(_tmp_outputs(root / ".store")) == 2  # still writing
        again, out2, err2 = start_sweep(args, root, env, "again")
        wait_for("the second sweep's jobs running", lambda: array_of(err2) is not None and list(
            task_states(cluster, array_of(err2)).values()) == ["RUNNING"] * 2, again)
        release.touch()
        again.wait(timeout=600)
    finally:
        release.touch()
        for p in (first, again):
            if p is not None and p.poll() is None:
                p.kill()
    assert again.returncode == 0, err2.read_text()[-3000:]
    assert "Slurm sweep: 2 done, 0 failed" in out2.read_text()
    wait_for("the first sweep's jobs completed", lambda: set(task_states(cluster, array).values()) == {"COMPLETED"},
             timeout=120)  # they committed their outputs, which the second sweep's took; now they end
    assert stage_counts(root, "ran")["quantize"] == 2  # by the first sweep's jobs, which ran on
    assert stage_counts(root, "cached")["quantize"] == 2  # the second sweep's took their outputs
    for r in summary_rows(out2.read_text()):  # after waiting on the locks the first sweep's jobs held
        assert "quantize: waiting for another run that holds" in Path(r["log"]).read_text()
    assert len(list(root.glob(".store/*-quantize-*/manifest.json"))) == 2


def test_waiting_lines_beat_with_the_time_and_why_jobs_wait_and_jobs_ask_for_the_planned_memory(cluster, tmp_path):
    """Two jobs of 3 CPUs each (hydra.launcher.cpus_per_task, the user's value winning) on the node's 4: the first
    is held mid-stage, the second waits for Resources. While the counts stay the same, a line every
    hydra.launcher.heartbeat_s (2 s here) says so with the time elapsed and squeue's reason. The memory each job asks
    for is the plan's, as sbatch got it (scontrol)."""
    root = tmp_path / "beat"
    root.mkdir()
    release = tmp_path / "release"
    args = ["build", "-m", *TINY, "target=cpu", "quant=fp8,none", "until=quantize", *SLURM, *hold(release),
            "hydra.launcher.cpus_per_task=3", "hydra.launcher.heartbeat_s=2"]
    proc, out, err = start_sweep(args, root, held_env(cluster, root))
    waiting = re.compile(r"^slurm: 2 jobs: 1 queued \(Resources\), 1 running, 0 done, 0 failed; (\d+):(\d\d):(\d\d) "
                         r"elapsed$", re.M)
    try:
        # the first job is RUNNING (the counts) from the moment Slurm starts it; it reaches the hold only once its
        # process has imported the pipeline and fetched, which on a loaded machine takes longer than three beats
        wait_for("the first job held and three unchanged waiting lines",
                 lambda: held(release) and len(waiting.findall(err.read_text())) >= 3, proc)
        array = array_of(err)
        assert held(release) == [f"{array}_0"]
        assert task_states(cluster, array) == {f"{array}_0": "RUNNING", f"{array}_1": "PENDING"}
        release.touch()
        proc.wait(timeout=600)
    finally:
        release.touch()
        if proc.poll() is None:
            proc.kill()
    stdout, stderr = out.read_text(), err.read_text()
    assert proc.returncode == 0, stderr[-3000:]
    assert "Slurm sweep: 2 done, 0 failed" in stdout
    beats = [int(h) * 3600 + int(m) * 60 + int(s) for h, m, s in waiting.findall(stderr)]
    assert len(beats) >= 3 and all(b - a >= 2 for a, b in zip(beats, beats[1:])), beats  # a heartbeat, in time
    assert re.search(rf"^submitted Slurm array {array}: 2 jobs \(--cpus-per-task=3 --mem=1GB\)$", stderr, re.M)
    assert re.search(r"^  --cpus-per-task=3 from hydra.launcher.cpus_per_task; --mem=1GB from the plan: ", stderr,
                     re.M)
    for i in range(2):
        job = scontrol(cluster, f"{array}_{i}")
        assert (job["NumCPUs"], job["MinMemoryNode"], job["JobState"]) == ("3", "1G", "COMPLETED")


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
    written, and each stage output is built by one job; the other waits on its lock and takes it cached. The jobs
    that took a quantize lock are held in the stage until all four run, so that they overlap however the two
    submitters and Slurm's scheduling are timed on a loaded machine."""
    root = tmp_path / "shared"
    root.mkdir()
    release = tmp_path / "release"
    args = readme_sweep()
    assert args[:2] == ["build", "-m"] and "hydra/launcher=pipeline_slurm" in args
    env = held_env(cluster, root)
    sweeps = [start_sweep([*args, *hold(release)], root, env, f"sweep{i}") for i in range(2)]
    try:
        def all_four_running() -> bool:
            arrays = [array_of(err) for _, _, err in sweeps]
            return None not in arrays and [s for a in arrays for s in task_states(cluster, a).values()] == [
                "RUNNING"] * 4
        def waiting_on_a_lock() -> int:
            dirs = [re.search(r"^submit dir: (\S+)$", err.read_text(), re.M) for _, _, err in sweeps]
            return sum("quantize: waiting for another run that holds" in f.read_text()
                       for d in dirs if d for f in Path(d.group(1)).glob("*/*_log.err"))
        wait_for("two jobs holding the quantize locks, two waiting on them, the four running at once",
                 lambda: len(held(release)) == 2 and all_four_running() and waiting_on_a_lock() == 2, sweeps[0][0])
        release.touch()
        for proc, _, _ in sweeps:
            proc.wait(timeout=1200)
    finally:
        release.touch()
        for proc, _, _ in sweeps:
            if proc.poll() is None:
                proc.kill()
    outs = [(out.read_text(), err.read_text()) for _, out, err in sweeps]
    assert [proc.returncode for proc, _, _ in sweeps] == [0, 0], [e[-2000:] for _, e in outs]
    submit_dirs = [re.search(r"^submit dir: (\S+)$", e, re.M).group(1) for _, e in outs]
    assert submit_dirs[0] != submit_dirs[1]  # each sweep its own, started in the same second or not
    rows = [row for o, _ in outs for row in summary_rows(o)]
    assert [r["label"] for r in rows] == ["quant=fp8", "quant=none"] * 2
    for a, b in ((0, 2), (1, 3)):  # the same job of the two sweeps ran at the same time
        ja, jb = scontrol(cluster, rows[a]["slurm_id"]), scontrol(cluster, rows[b]["slurm_id"])
        assert max(ja["StartTime"], jb["StartTime"]) < min(ja["EndTime"], jb["EndTime"]), (ja, jb)
    logs = "".join(p.read_text() for p in (root / ".store" / "logs").glob("*.log"))
    assert logs.count("stage fetch: ran") == 1 and logs.count("stage fetch: cached") == 3
    assert logs.count("stage quantize: ran") == 2 and logs.count("stage quantize: cached") == 2
    assert len(list(root.glob(".store/*-quantize-*/manifest.json"))) == 2
    for a, b in ((0, 2), (1, 3)):  # of the same job of the two sweeps, one held the lock and one waited on it
        waited = ["quantize: waiting for another run that holds" in Path(rows[i]["log"]).read_text() for i in (a, b)]
        assert sorted(waited) == [False, True], (rows[a], rows[b])


def test_a_job_past_its_time_limit_fails_in_one_line_naming_timeout_min(cluster, tmp_path):
    """A two-minute limit with submitit's signal 20 s before it: the job, held in its quantize stage and never
    released (however fast the machine, it is still running then), is ended by submitit at the signal ("timed-out
    too many times" in its log); the sweep's line names hydra.launcher.timeout_min, the limit and the fix. Slurm
    may send the signal up to 60 s early (``man sbatch``, ``--signal``), so it comes 40 s after the start at the
    earliest: long after submitit's job has set its handler (a job here starts its stages within a few seconds).
    A signal before the handler is test_launcher's case."""
    root = tmp_path / "late"
    proc = run_cli("build", "-m", *TINY, "target=cpu", "quant=fp8", "until=quantize", *SLURM,
                   *hold(tmp_path / "never"), "hydra.launcher.timeout_min=2", "hydra.launcher.signal_delay_s=20",
                   root=root, env=held_env(cluster, root), timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = ("failed: the job ran into its time limit, hydra.launcher.timeout_min=2 (Slurm's limit: 2 min; submitit "
            "stops the job hydra.launcher.signal_delay_s=20 s before it); raise hydra.launcher.timeout_min and run "
            "the sweep again (the stages that finished are reused)")
    assert line in proc.stdout and proc.stderr.strip().splitlines()[-1].endswith(line), proc.stdout[-2000:]
    row = summary_rows(proc.stdout)[0]
    assert "timed-out too many times" in Path(row["log"]).read_text()  # submitit's own words, in the job's log

