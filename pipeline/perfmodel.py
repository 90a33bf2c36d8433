"""NVIDIA's performance model for serving (aiconfigurator-core, pinned): predicted TTFT, TPOT, tokens/s/GPU and memory
of a model x GPU x quant x KV dtype x TP x batch on TensorRT-LLM, from the measured kernel tables it ships per GPU
system and TensorRT-LLM version. Offline, no GPU.

What the figures are: aiconfigurator's aggregated (in-flight batching) estimate, the same computation as
``aiconfigurator cli estimate --estimate-mode agg`` (``pipeline/perfmodel_worker.py`` says which of its modules), on
the newest TensorRT-LLM tables it holds for the system (``version`` in each result: 1.3.0rc20 for Hopper and
Blackwell in 0.12.0). They are predictions from kernel timings measured by NVIDIA, not measurements of a bundle; no
TensorRT-LLM run on this project's machines has checked them.

Where it runs: aiconfigurator-core needs numpy >= 2.1, and this environment keeps numpy < 2 as NVIDIA's TensorRT-LLM
container does (TensorRT-LLM pins it), so the model runs in an environment of its own beside this one
(:func:`env_path`; ``make setup`` makes it, ``make wheelhouse`` carries it), as child processes kept for the
command, one per database mode, reading and writing JSON lines (``pipeline/perfmodel_worker.py``). Results are cached on disk per query and installed version
(:func:`cache_dir`): a warm ``plan`` reads JSON and starts no child.

Where it is required: it chooses the serving settings of a TensorRT-LLM bundle on a GPU with tables
(:mod:`pipeline.serving_plan`), so a host without it refuses such a config (one line naming ``make perfmodel-env``)
rather than build another bundle than ``plan`` showed elsewhere. The installed version (:func:`installed_version`,
read from its package metadata) is recorded with the plan and enters the build's fingerprint.

Where the tables have no data (a CPU target, a GPU without tables such as the A10G, a head size they do not hold such
as SmolLM2's 64, a format without a mode), a result is one line saying so, never a made-up figure.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PINNED = "aiconfigurator-core==0.12.0"
# NVIDIA's CLI over the same core: only where tests run (tests/e2e/test_perfmodel.py holds plan's figures against it)
CLI = "aiconfigurator==0.12.0"
CORE_VERSION = PINNED.split("==")[1]
CACHE_FORMAT = 3  # what perfmodel_worker.py writes per query; a cached result of another form is asked again

# target (conf/target) -> aiconfigurator system (aiconfigurator_core/systems/*.yaml). None: no tables (a10g, cpu).
SYSTEMS = {"h100": "h100_sxm", "h200": "h200_sxm", "b200": "b200_sxm", "gb200": "gb200", "l40s": "l40s",
           "rtx-pro-6000": "rtx_pro_6000_server", "a100": "a100_sxm"}
# quant.format -> aiconfigurator GEMMQuantMode (aiconfigurator_core/sdk/common.py). ModelOpt's FP8 is per-tensor FP8
# with static (calibrated) activation scales: aiconfigurator reads such a checkpoint as fp8_static
# (sdk/models/helpers.py _infer_quant_modes_from_raw_config: quant_algo fp8 without quant_dynamic). NVFP4 is nvfp4
# (the model itself turns it into weight-only nvfp4_wo off Blackwell: helpers.resolve_nvfp4_for_system). INT4 AWQ is
# W4A16: int4_wo. INT8 SmoothQuant is sq. W4A16 NVFP4 is w4a16_nvfp4 (NVFP4 weights dequantized into the bf16 MMA
# lane, the mode's own description). FP8 per-channel per-token quantizes activations dynamically per token, which
# aiconfigurator models as fp8 (the mode it gives an FP8 checkpoint marked quant_dynamic; per-channel weight scales
# differ from per-tensor ones only in the GEMM's epilogue). No mode: W4A8 AWQ, NVFP4 AWQ (its pre-quant scale is an
# extra op before each GEMM that no table times), W4A8 NVFP4-FP8 and MXFP8 (no such GEMMQuantMode).
GEMM_MODES = {"none": "bfloat16", "fp8": "fp8_static", "nvfp4": "nvfp4", "int4_awq": "int4_wo", "int8_sq": "sq",
              "w4a16_nvfp4": "w4a16_nvfp4", "fp8_per_channel_per_token": "fp8"}
# quant.kv_cache -> KVCacheQuantMode (bfloat16, int8, fp8); an NVFP4 KV cache has none.
KV_MODES = {"none": "bfloat16", "bf16": "bfloat16", "fp8": "fp8", "fp8_cast": "fp8"}  # fp8_cast: FP8, scale 1.0

ENV_HINT = "make perfmodel-env"
# the versions of aiconfigurator-core's own dependencies there (every host computes with the same libraries)
CONSTRAINTS = Path(__file__).with_name("data") / "perfmodel-constraints.txt"


def fmha_mode(runtime: str, quant: str, kv: str, build: dict[str, Any]) -> str:
    """The context attention (aiconfigurator's ``FMHAQuantMode``) the bundle serves with. Engine path: FP8 exactly
    where ``trtllm-build`` enables FP8 context FMHA (:func:`pipeline.runtime.trtllm.fp8_context_fmha`, the flag the
    build renders). LLM-API path: FP8 where aiconfigurator reads the exported checkpoint so, a quantized checkpoint
    with an FP8 KV cache (aiconfigurator_core/sdk/models/helpers.py ``_infer_quant_modes_from_raw_config``: a
    quant_algo with an FP8 KV cache -> FMHAQuantMode.fp8; its tables hold FP8 context attention only beside an FP8
    KV cache, ``resolve_context_fmha_by_data``)."""
    from pipeline.formats import FORMATS, KV_FORMATS
    from pipeline.runtime import trtllm

    algo, kv_algo = FORMATS[quant].quant_algo, KV_FORMATS[kv].quant_algo
    if runtime == "trtllm_engine":
        return "fp8" if trtllm.fp8_context_fmha(build, algo, kv_algo) else "bfloat16"
    return "fp8" if algo is not None and kv_algo == "FP8" else "bfloat16"


def env_path() -> Path:
    """The performance model's own environment: beside this one (``sys.prefix``), like the evaluation overlay;
    ``PIPELINE_PERFMODEL_ENV`` names another (a shared one, or one made from a wheelhouse)."""
    return Path(os.environ.get("PIPELINE_PERFMODEL_ENV") or Path(sys.prefix) / "perfmodel")


def env_python() -> Path:
    return env_path() / "bin" / "python"


def installed_version() -> str | None:
    """The aiconfigurator-core version installed in the model's environment, read from its package metadata without
    starting it (None: not installed there)."""
    return _version(str(env_path()))


@functools.lru_cache(maxsize=8)
def _version(env: str) -> str | None:
    for d in sorted(Path(env).glob("lib/python*/site-packages/aiconfigurator_core-*.dist-info")):
        return d.name[len("aiconfigurator_core-"):-len(".dist-info")]
    return None


def installed() -> str:
    """``aiconfigurator-core==<installed version>``: what decided a plan's settings (the pin where none is installed)."""
    return f"aiconfigurator-core=={installed_version() or CORE_VERSION}"


def cache_dir() -> Path:
    return env_path().with_name(env_path().name + "-cache") / (installed_version() or CORE_VERSION)


def available() -> str | None:
    """None when the model can run here; else why not, with the fix (one line)."""
    if env_python().is_file() and installed_version():
        return None
    return (f"NVIDIA's performance model ({PINNED}) is not installed here: run `{ENV_HINT}` (an environment of its "
            f"own beside this one, since it needs numpy 2; offline: `make wheelhouse` carries it, `make "
            f"install-offline` makes it)")


def _installer(python: str) -> list[str]:
    """The install command for the environment of ``python``: uv (``tools/uv_pip.py``, this machine's pip sources,
    bytecode compiled) where this Python has it, else that environment's own pip (NVIDIA's container)."""
    import importlib.util

    if importlib.util.find_spec("uv") is None:
        return [python, "-m", "pip", "install", "-q"]
    tool = Path(__file__).resolve().parents[1] / "tools" / "uv_pip.py"
    return ([sys.executable, str(tool), "--python", python, "--uv", sys.executable, "--"] if tool.is_file() else
            [sys.executable, "-m", "uv", "pip", "install", "--python", python, "--compile-bytecode"])


def _has_cli() -> bool:
    return any(env_path().glob("lib/python*/site-packages/aiconfigurator-*.dist-info"))


def create(find_links: str | None = None, with_cli: bool = False, offline: bool = False) -> Path:
    """Make the environment: a venv holding the pinned aiconfigurator-core (and, ``with_cli``, NVIDIA's CLI over it,
    for the tests), from PyPI or a wheelhouse (``find_links``; ``offline``: only from it). It is built beside and
    renamed into place when complete."""
    import importlib.util

    from pipeline import overlays

    root = env_path()
    extra = (["--find-links", find_links] if find_links else []) + (["--no-index"] if offline else []) + [
        "-c", str(CONSTRAINTS)]
    with overlays.replacing(root) as tmp:
        if importlib.util.find_spec("uv") is not None:
            subprocess.run([sys.executable, "-m", "uv", "venv", "-q", "--python", sys.executable, str(tmp)],
                           check=True)
        else:
            subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True)
        subprocess.run([*_installer(str(tmp / "bin" / "python")), *extra, PINNED, *([CLI] if with_cli else [])],
                       check=True)
    _version.cache_clear()
    return root


def ensure(find_links: str | None = None, with_cli: bool = False, offline: bool = False) -> str:
    """Make the environment where it is missing or holds another version than the pin; add the CLI where asked and
    missing. Returns what it did (one line)."""
    if installed_version() != CORE_VERSION:
        create(find_links, with_cli, offline)
        return f"performance model: {PINNED} in {env_path()}"
    if with_cli and not _has_cli():
        extra = (["--find-links", find_links] if find_links else []) + (["--no-index"] if offline else []) + [
            "-c", str(CONSTRAINTS)]
        subprocess.run([*_installer(str(env_python())), *extra, CLI], check=True)
        return f"performance model: {PINNED} with {CLI} in {env_path()}"
    return f"performance model: {PINNED} in {env_path()} (already there)"


@dataclass(frozen=True)
class Query:
    """One aggregated estimate: ``hub_id`` (``org/name``, used where aiconfigurator bundles its config) or
    ``config`` (a ``config.json``), the system, GEMM, KV and context-FMHA modes, TP, batch, input and output lengths,
    the context-token budget of one step (``ctx_tokens``: the bundle's ``max_num_tokens``; 0: the input length, the
    CLI's default), the served ``max_seq_len`` (0: input + output, the CLI's default) and the database mode
    (SILICON: the measured tables; SOL: speed of light)."""

    hub_id: str
    config: str  # config.json as sorted JSON (hashable)
    system: str
    gemm: str
    kv: str
    tp: int
    batch: int
    isl: int
    osl: int
    database_mode: str = "SILICON"
    ctx_tokens: int = 0
    max_seq_len: int = 0
    fmha: str = ""  # "" : aiconfigurator infers it (the CLI without --fmha-quant-mode)

    def doc(self) -> dict[str, Any]:
        return {"hub_id": self.hub_id, "config": json.loads(self.config), "system": self.system, "gemm": self.gemm,
                "kv": self.kv, "tp": self.tp, "batch": self.batch, "isl": self.isl, "osl": self.osl,
                "database_mode": self.database_mode, "ctx_tokens": self.ctx_tokens, "max_seq_len": self.max_seq_len,
                "fmha": self.fmha}

    def key(self) -> str:
        return hashlib.sha256(json.dumps([CACHE_FORMAT, self.doc()], sort_keys=True).encode()).hexdigest()[:24]


def model_config(shape: dict[str, Any], model_type: str) -> dict[str, Any]:
    """A ``config.json`` aiconfigurator can read, from the model's shape (for models whose config it does not bundle)."""
    arch = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM"}.get(model_type, "LlamaForCausalLM")
    return {"architectures": [arch], "model_type": model_type or "llama",
            "num_hidden_layers": int(shape["num_layers"]), "hidden_size": int(shape["hidden_size"]),
            "intermediate_size": int(shape["intermediate_size"]), "num_attention_heads": int(shape["num_heads"]),
            "num_key_value_heads": int(shape["num_kv_heads"]), "head_dim": int(shape["head_dim"]),
            "vocab_size": int(shape["vocab_size"]),
            "max_position_embeddings": int(shape.get("max_position_embeddings") or 0) or 4096,
            "tie_word_embeddings": bool(shape.get("tie_word_embeddings")), "torch_dtype": "bfloat16"}


def no_data(target: str, device: str, quant: str, kv: str) -> str | None:
    """Why the tables cannot answer for this target/format at all (one line), before asking them; None when they may."""
    if device != "cuda":
        return f"target {target} is a CPU: the performance model's tables are TensorRT-LLM on NVIDIA GPUs"
    if target not in SYSTEMS:
        return (f"target {target} has no tables in {PINNED} (systems with data: "
                f"{', '.join(sorted(SYSTEMS))})")
    if quant not in GEMM_MODES:
        return (f"quant {quant} has no GEMM mode in {PINNED} (formats with one: "
                f"{', '.join(sorted(k for k in GEMM_MODES if k != 'none'))})")
    if kv not in KV_MODES:
        return f"KV cache {kv} has no KV mode in {PINNED} (bfloat16, int8, fp8)"
    return None


def _cached(q: Query) -> dict[str, Any] | None:
    f = cache_dir() / f"{q.key()}.json"
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None


def _store(q: Query, result: dict[str, Any]) -> None:
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{q.key()}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(result, sort_keys=True))
    tmp.replace(d / f"{q.key()}.json")


class Unavailable(RuntimeError):
    """The model cannot run here (not installed, or its process failed as a whole): one line."""


class _Worker:
    """A model process for this command and database mode (:mod:`pipeline.perfmodel_worker`), started once and
    kept: every estimate of a ``plan`` or of a ``validate`` over hundreds of configurations in that mode goes to the same
    process, which loads each GPU's tables once. Its stderr goes to a temporary file (read back when it fails)."""

    def __init__(self, timeout_s: float):
        import tempfile
        import threading

        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.err = tempfile.TemporaryFile()
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        # the model configs it reads from disk go beside the cached answers, by content: nothing is left in the
        # command's temporary directory when the command exits before its model process does
        env["PIPELINE_PERFMODEL_MODELS"] = str(cache_dir() / "models")
        self.proc = subprocess.Popen([str(env_python()), str(Path(__file__).with_name("perfmodel_worker.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     env=env)
        self.unread = 0  # answers to warm-ups not read yet
        self.version: str | None = None
        # Lines are read by a thread into a queue: a timed wait on the queue, unlike select() on the buffered pipe,
        # sees a second answer that arrived in the same read as the first.
        import queue

        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True, name="perfmodel-reader").start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")  # end of output: the process exited

    def send(self, doc: dict[str, Any]) -> None:
        try:
            self.proc.stdin.write(json.dumps(doc) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise Unavailable(self.failure()) from exc

    def read(self) -> dict[str, Any]:
        import queue

        try:
            line = self.lines.get(timeout=self.timeout_s)
        except queue.Empty:
            self.proc.kill()
            raise Unavailable(f"the performance model took over {self.timeout_s:.0f} s")
        if not line:
            raise Unavailable(self.failure())
        doc = json.loads(line)
        self.version = doc.get("version") or self.version
        return doc

    def warm(self, queries: list[Query]) -> None:
        with self.lock:
            self.send({"warm": [q.doc() for q in queries]})
            self.unread += 1

    def ask(self, queries: list[Query]) -> list[dict[str, Any]]:
        with self.lock:
            self.submit(queries)
            return self.collect()

    def submit(self, queries: list[Query]) -> None:
        """Send ``queries`` (the caller holds the lock and :meth:`collect` s their answers)."""
        self.send({"queries": [q.doc() for q in queries]})

    def collect(self) -> list[dict[str, Any]]:
        while self.unread:  # the warm-ups' answers come first
            self.read()
            self.unread -= 1
        return self.read()["results"]

    def failure(self) -> str:
        code = self.proc.wait(timeout=10)
        self.err.seek(0)
        tail = (self.err.read().decode("utf-8", "replace").strip().splitlines() or ["no output"])[-1]
        return f"the performance model failed (exit {code}): {tail}"

    def close(self) -> None:
        """End the process: its stdin closes, and it exits on its own (nothing is waited for, so a command's exit is
        not held up by the model's interpreter shutting down)."""
        try:
            self.proc.stdin.close()
        except OSError:
            self.proc.kill()
        self.err.close()


# The command's model processes, one per database mode: the measured tables (SILICON) and the speed-of-light view
# (SOL), which each load the GPU's data on their first query (~1.4 s and ~0.7 s on 2 cores) and so load it side by
# side while the command waits.
_WORKERS: dict[str, _Worker] = {}


def _worker(mode: str = "SILICON", timeout_s: float = 600) -> _Worker:
    w = _WORKERS.get(mode)
    if w is not None and w.proc.poll() is not None:
        w = None
    if w is None:
        why = available()
        if why:
            raise Unavailable(why)
        import atexit

        w = _WORKERS[mode] = _Worker(timeout_s)
        atexit.register(w.close)
    return w


def start(overrides: list[str]) -> None:
    """Start the model's process before the config is composed, where the overrides name a GPU target it has tables
    for and a TensorRT-LLM runtime (or leave the runtime to ``auto``): its imports run while the command composes.
    A guess from the words alone; :func:`prewarm` gives it its first work once the config is known."""
    words = dict(o.split("=", 1) for o in overrides if "=" in o and not o.startswith(("+", "~")))
    if words.get("target") in SYSTEMS and words.get("runtime", "auto") != "reference" and available() is None:
        _worker("SILICON")


def prewarm(queries: list[Query]) -> None:
    """Start the model's process now, estimating ``queries`` (the first a command will ask), unless the cache holds
    them: the tables load while the caller goes on. Does nothing where the model is not installed (the caller that
    needs it says so)."""
    missing = [q for q in queries if _cached(q) is None]
    if missing and available() is None:
        for mode in dict.fromkeys(q.database_mode for q in missing):
            _worker(mode).warm([q for q in missing if q.database_mode == mode])


def estimate(queries: list[Query]) -> list[dict[str, Any]]:
    """Each query's result (cached ones from disk; the rest from the command's one model process): the figures
    (``ttft_ms``, ``tpot_ms``, ``tokens_per_s_per_gpu``, ``tokens_per_s_per_user``, ``request_latency_ms``,
    ``memory_gb`` at the query's ``max_seq_len``, ``memory_gb_at_request`` at its own length, ``oom``: that memory
    exceeds the GPU, the modes used and the tables' TensorRT-LLM ``version``) or ``{"error": one line}``."""
    results: dict[Query, dict[str, Any]] = {}
    missing = []
    for q in dict.fromkeys(queries):
        hit = _cached(q)
        if hit is None:
            missing.append(q)
        else:
            results[q] = hit
    if missing:  # each mode's queries to its process, all sent before any answer is read
        groups: dict[_Worker, list[Query]] = {}
        for q in missing:
            groups.setdefault(_worker(q.database_mode), []).append(q)
        for w in groups:
            w.lock.acquire()
        try:
            for w, qs in groups.items():
                w.submit(qs)
            for w, qs in groups.items():
                for q, r in zip(qs, w.collect()):
                    _store(q, r)
                    results[q] = r
        finally:
            for w in groups:
                w.lock.release()
    return [results[q] for q in queries]


def main(argv: list[str] | None = None) -> None:
    """``python -m pipeline.perfmodel [--if-needed] [--find-links DIR [--offline]] [--with-cli]``: make the
    performance model's environment."""
    import argparse

    ap = argparse.ArgumentParser(description="make the performance model's environment (aiconfigurator-core)")
    ap.add_argument("--find-links", help="a wheelhouse to install from")
    ap.add_argument("--offline", action="store_true", help="install from --find-links only (no index)")
    ap.add_argument("--with-cli", action="store_true", help=f"also {CLI} (the tests compare against its CLI)")
    ap.add_argument("--if-needed", action="store_true", help="only where it is missing or holds another version")
    a = ap.parse_args(argv)
    if a.if_needed:
        print(ensure(a.find_links, a.with_cli, a.offline))
    else:
        print(f"performance model: {PINNED} in {create(a.find_links, a.with_cli, a.offline)}")


if __name__ == "__main__":
    main()
