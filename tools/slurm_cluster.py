"""A one-node Slurm cluster on loopback, for trying and testing ``hydra/launcher=pipeline_slurm`` without a cluster.

    .venv/bin/python tools/slurm_cluster.py up /tmp/slurm-test     # as root; prints the SLURM_CONF to export
    export SLURM_CONF=/tmp/slurm-test/slurm.conf
    python -m pipeline build -m target=cpu quant=fp8,none hydra/launcher=pipeline_slurm ...
    .venv/bin/python tools/slurm_cluster.py down /tmp/slurm-test   # stops it and removes the directory

Debian's ``slurm-wlm`` (22.05) and ``munge`` are installed with apt-get where missing (root only). Everything the
cluster writes lives in its directory: its own munge key and socket, ``slurm.conf``, ``gres.conf``, ``cgroup.conf``,
the controller's state, the node's spool, the daemons' logs and pid files. ``down`` cancels every job, stops the
daemons (and any job process still carrying the cluster's ``SLURM_CONF``) by their process ids, and removes the
directory; nothing of the cluster is left.

The node, ``node1``, is this machine: partitions ``cpu`` (the default) and ``gpu``, the features of every shipped
target's ``slurm.constraint`` (conf/target/*.yaml), and a ``gpu`` GRES backed by placeholder files under
``DIR/dev``, so that Slurm accepts, places and accounts for the GPUs a job asks for. There is no GPU behind them: a
job that needs one finds none (``nvidia-smi``/NVML see nothing). Process tracking is ``proctrack/linuxproc`` and the
task plugin ``task/none``: no cgroup is created, which is what works inside a container without a delegated cgroup
tree. Settings are Slurm 22.05's (``man slurm.conf``, ``man gres.conf``).
"""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")
NODE = "node1"
MARK = "# one node on loopback, written by tools/slurm_cluster.py (Slurm 22.05 settings: man slurm.conf)"
REPO = Path(__file__).resolve().parents[1]


class Unavailable(RuntimeError):
    """The cluster cannot be started here (not root, packages missing and not installable); the message says why."""


def _target_features() -> list[str]:
    """Every ``slurm.constraint`` of the shipped targets (conf/target/*.yaml): each target's job can be placed."""
    import yaml

    out = []
    for p in sorted((REPO / "conf" / "target").glob("*.yaml")):
        doc = yaml.safe_load(p.read_text()) or {}
        c = (doc.get("slurm") or {}).get("constraint")
        if c and c not in out:
            out.append(str(c))
    return out


def ensure_installed() -> None:
    """slurm-wlm and munge, with apt-get where a daemon or client is missing (root only)."""
    missing = [b for b in (*DAEMONS, *CLIENTS) if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if not missing:
        return
    if os.geteuid() != 0:
        raise Unavailable(f"{', '.join(missing)} not installed and installing them needs root "
                          f"(apt-get install {' '.join(PACKAGES)})")
    if shutil.which("apt-get") is None:
        raise Unavailable(f"{', '.join(missing)} not installed and there is no apt-get to install {' '.join(PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise Unavailable(f"{' '.join(cmd)} failed: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class Cluster:
    """The cluster in ``root`` (created; must not exist or be empty). :meth:`start`, then :meth:`stop`."""

    def __init__(self, root: Path, cpus: int = 2, gpus: int = 2, kill_wait_s: int = 10):
        self.root = Path(root).resolve()
        self.cpus, self.gpus, self.kill_wait_s = cpus, gpus, kill_wait_s
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------------------------------------------ configuration
    def write_config(self) -> None:
        r = self.root
        for d in ("munge", "state", "spool", "log", "dev", "run"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r, 0o700)
        os.chmod(r / "munge", 0o711)  # the socket in it is reached by path
        key = r / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o400)
        for i in range(self.gpus):  # placeholders for the GPUs the gres plugin hands out; nothing is behind them.
            # The gpu plugin takes character devices only: major 240 is set aside for local use (the kernel's
            # Documentation/admin-guide/devices.txt), so no driver answers if one were opened.
            os.mknod(r / "dev" / f"gpu{i}", stat.S_IFCHR | 0o600, os.makedev(240, i))
        ctl_port, node_port = _free_port(), _free_port()
        features = ",".join(_target_features())
        host = socket.gethostname()
        # RealMemory: this machine's memory in MB (Slurm's default is 1 MB, which refuses any job that asks for
        # memory, as pipeline_slurm's jobs do: --mem); with CR_Core it is checked, not allocated
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        node = (f"NodeName={NODE} NodeAddr=127.0.0.1 NodeHostname={host} CPUs={self.cpus} RealMemory={memory_mb} "
                f"Gres=gpu:{self.gpus} Features={features} State=UNKNOWN")
        self.conf.write_text(f"""\
{MARK}
ClusterName=pipeline-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctl_port}
SlurmdPort={node_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={r}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
PlugStackConfig={r}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
KillWait={self.kill_wait_s}
MinJobAge=600
SchedulerParameters=sched_interval=2,bf_interval=2
{node}
PartitionName=cpu Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes={NODE} MaxTime=INFINITE State=UP
""")
        gpu_files = f"{r}/dev/gpu[0-{self.gpus - 1}]" if self.gpus > 1 else f"{r}/dev/gpu0"
        (r / "gres.conf").write_text(f"NodeName={NODE} Name=gpu File={gpu_files}\n")
        # read by the cgroup plugins only; proctrack/linuxproc and task/none load none of them
        (r / "cgroup.conf").write_text("CgroupPlugin=autodetect\nConstrainCores=no\nConstrainDevices=no\n"
                                       "ConstrainRAMSpace=no\n")
        (r / "plugstack.conf").write_text("")

    # ------------------------------------------------------------------------------------------------ daemons
    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.stdout", "ab")
        self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()

    def start(self, timeout: float = 60) -> None:
        if self.root.exists() and any(self.root.iterdir()):
            raise Unavailable(f"{self.root} is not empty; give a new directory")
        if len(str(self.root / "munge" / "munge.socket")) > 100:  # sun_path holds 108 bytes
            raise Unavailable(f"{self.root} is too long a path for munge's socket in it; give a shorter directory")
        ensure_installed()
        if os.geteuid() != 0:
            raise Unavailable("the test cluster's daemons run as root (SlurmUser=root, a munge key of its own)")
        self.write_config()
        r = self.root
        try:
            self._spawn("munged", [_sbin("munged"), "--foreground", "--force", f"--key-file={r}/munge/munge.key",
                                   f"--socket={r}/munge/munge.socket", f"--pid-file={r}/run/munged.pid",
                                   f"--log-file={r}/log/munged.log", f"--seed-file={r}/munge/munged.seed"])
            self._wait(lambda: (r / "munge" / "munge.socket").exists(), "munged", 20)
            self._spawn("slurmctld", [_sbin("slurmctld"), "-D", "-c", "-f", str(self.conf)])
            self._wait(lambda: self._ok(["scontrol", "ping"]), "slurmctld", timeout)
            self._spawn("slurmd", [_sbin("slurmd"), "-D", "-N", NODE, "-f", str(self.conf)])
            self._wait(self.node_idle, "slurmd (node idle)", timeout)
        except BaseException:
            self.stop()
            raise

    def _ok(self, cmd: list[str]) -> bool:
        return subprocess.run(cmd, env=self.env, capture_output=True).returncode == 0

    def _wait(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise Unavailable(f"{name} exited ({p.returncode}) while starting: {self.log_tail(name)}")
            if ready():
                return
            time.sleep(0.3)
        raise Unavailable(f"{what} not ready after {timeout:.0f}s: {self.log_tail(what.split()[0])}")

    def log_tail(self, name: str, n: int = 5) -> str:
        lines = []
        for f in (self.root / "log" / f"{name}.log", self.root / "log" / f"{name}.stdout"):
            if f.is_file():
                lines += f.read_text(errors="replace").splitlines()[-n:]
        return " | ".join(lines) or "(no log)"

    def node_state(self) -> str:
        proc = subprocess.run(["sinfo", "-h", "-N", "-n", NODE, "-o", "%T"], env=self.env, capture_output=True,
                              text=True)
        return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else ""

    def node_idle(self) -> bool:
        return self.node_state() == "idle"

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster (``SLURM_CONF`` set)."""
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, check=check, timeout=60)

    def jobs(self) -> list[str]:
        """``JOBID STATE`` of every job the controller still shows as queued or running."""
        return self.run("squeue", "-h", "-o", "%i %T").stdout.split("\n")[:-1]

    def version(self) -> str:
        return self.run("sinfo", "-V").stdout.strip()

    def stop(self) -> None:
        """Cancel every job, stop the daemons and every job process of this cluster, remove ``root``."""
        if self.conf.is_file():
            subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True, timeout=60)
            deadline = time.monotonic() + self.kill_wait_s + 20
            while time.monotonic() < deadline:
                q = subprocess.run(["squeue", "-h"], env=self.env, capture_output=True, text=True, timeout=60)
                if q.returncode != 0 or not q.stdout.strip():
                    break
                time.sleep(0.5)
        for name in reversed(DAEMONS):
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        for sig in (signal.SIGTERM, signal.SIGKILL):  # started by another process (``up``), or outliving slurmd
            pids = self.leftover_pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            while pids and time.monotonic() < deadline and self.leftover_pids():
                time.sleep(0.2)
        self.procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def leftover_pids(self) -> list[int]:
        """This cluster's daemons and job processes still running: those with its ``SLURM_CONF`` in their
        environment (its daemons pass it to the job steps they start) that are a Slurm or munge daemon, a job step,
        or a job's process (``SLURM_JOB_ID`` set). A shell that merely exported the ``SLURM_CONF`` is not one."""
        needle = f"SLURM_CONF={self.conf}".encode()
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                env = (d / "environ").read_bytes().split(b"\0")
                comm = (d / "comm").read_text().strip()
            except OSError:
                continue
            ours = comm in (*DAEMONS, "slurmstepd") or any(e.startswith(b"SLURM_JOB_ID=") for e in env)
            if needle in env and ours:
                out.append(int(d.name))
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["up", "down"])
    p.add_argument("dir", type=Path, help="the cluster's directory (up: new or empty; down: the one up used)")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--gpus", type=int, default=2)
    a = p.parse_args(argv)
    c = Cluster(a.dir, cpus=a.cpus, gpus=a.gpus)
    if a.action == "up":
        try:
            c.start()
        except Unavailable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"{c.version()} up: node {NODE} idle; export SLURM_CONF={c.conf}")
        return 0
    if c.root.exists() and MARK not in (c.conf.read_text().splitlines()[:1] if c.conf.is_file() else []):
        print(f"error: {c.root} holds no cluster of this script (no {c.conf.name} written by it); nothing done",
              file=sys.stderr)
        return 2
    c.stop()
    print(f"down: {c.root} removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
