"""Run NVIDIA's own Triton client scripts, unchanged, against ``python -m pipeline serve`` of each reference
deployment of ``model=tiny-qwen3``, and record what every command returned.

    python tools/upstream_clients.py --backend-checkout DIR --llmapi-client FILE [--root DIR] [--only NAME ...]

``DIR``: a triton-inference-server/tensorrtllm_backend checkout or extracted tree (read at c2e65b8) holding
``inflight_batcher_llm/client/end_to_end_grpc_client.py``,
``inflight_batcher_llm/client/inflight_batcher_llm_client.py``, ``tools/inflight_batcher_llm/end_to_end_test.py``
with ``tools/utils/`` and its CI dataset ``ci/L0_backend_trtllm/simple_data.json``. ``FILE``: NVIDIA/TensorRT-LLM
``triton_backend/tools/llmapi_client.py``. The scripts stay where they are and run as subprocesses with their own
command-line flags; nothing of them is in this project. They import ``pandas`` and ``tabulate``
(``pip install -e '.[upstream-clients]'``).

For each deployment (``inflight_batcher_llm`` and ``llmapi``, decoupled and unary) the tool builds the repository
with the pipeline itself (``python -m pipeline build model=tiny-qwen3 serve.layout=.. serve.decoupled=..
until=package``; the stages before package are cached and shared; ``--engine-from PACKAGE`` renders each repository
around an existing package's build output instead, as tests/e2e/test_clients.py does), serves it with
``python -m pipeline serve REPO``, runs every client command of that deployment, and stops the server. Per command
it records the exit code, the texts the script printed (parsed from its own output: a script that exits 0 but
prints no text fails) and every error line in its output. A command expected to be refused (a unary request to a
decoupled model, a stream to a unary one, as upstream's backends refuse them) passes only when the output names the
refusal.

Writes ``benchmarks/results/upstream_clients.json`` and re-renders the generated table in ``docs/execution.md``.
Exit 1 when any command failed.
"""
from __future__ import annotations

import argparse
import ast
import datetime as dt
import hashlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "benchmarks" / "results" / "upstream_clients.json"
DOC = ROOT / "docs" / "execution.md"
MARKER = "upstream-clients"
TINY = ["model=tiny-qwen3", "quant.gate=warn"]  # a random model's logits move more than real models' gates allow
ENGINE_REL = "tensorrt_llm/1/engine"  # the build output inside the repository: the tokenizer lives here

SCRIPTS = {  # key -> path inside the backend checkout (llmapi_client: the --llmapi-client file)
    "end_to_end_grpc_client.py": "inflight_batcher_llm/client/end_to_end_grpc_client.py",
    "inflight_batcher_llm_client.py": "inflight_batcher_llm/client/inflight_batcher_llm_client.py",
    "end_to_end_test.py": "tools/inflight_batcher_llm/end_to_end_test.py",
    "llmapi_client.py": None,
}
DATASET = "ci/L0_backend_trtllm/simple_data.json"

PROMPT = "The capital of France is"
BATCH = '["This is a test","I want you to","The cat is"]'  # upstream README's --batch-inputs example
E2E = ["-u", "{grpc}", "-p", PROMPT, "-o", "16"]
IBL = ["-u", "{grpc}", "--text", PROMPT, "--tokenizer-dir", "{tokenizer}"]
E2E_TEST = ["--dataset", "{dataset}", "--max-input-len", "500"]
LLMAPI_TEST = [*E2E_TEST, "--test-llmapi", "--model-name", "tensorrt_llm", "-v"]  # prints its texts only with -v
STOP = ["--exclude-input-in-output", "--stop-words", " com"]  # " com" is the 2nd token tiny-qwen3 generates greedily
STOPPED = "the text ends at the stop word"
OUTPUT_CONFIG = ["--output-config", "{'return_finish_reason': True, 'return_stop_reason': True}"]


def C(script: str, args: list[str], expect: str = "text", texts: int = 1, note: str = "", ends: str = "") -> dict:
    """One client command. ``expect``: "text" (exit 0, ``texts`` non-empty texts printed, no error; each ending with
    ``ends`` when given) or "refused" (the server's error names the refusal)."""
    return {"script": script, "args": args, "expect": expect, "texts": texts, "note": note, "ends": ends}


N_DATASET = 13  # prompts in upstream's simple_data.json under --max-input-len 500: one text each
UNARY_BATCH = ("one unary response holds every row; the script prints row 0 of each response "
               "(`text_output[0]`, `batch_index[0][0]`)")
EXCLUDED = ("the repository sets `exclude_input_in_output: true` (upstream's quick start), so unary `output_ids` hold "
            "no prompt; without `--exclude-input-in-output` the script still cuts the prompt's length off them and "
            "prints only the rest")
# name -> (layout, decoupled, commands)
DEPLOYMENTS: dict[str, tuple[str, bool, list[dict]]] = {
    "inflight_batcher_llm, decoupled": ("inflight_batcher_llm", True, [
        C("end_to_end_grpc_client.py", E2E),
        C("end_to_end_grpc_client.py", [*E2E, "-S"]),
        C("end_to_end_grpc_client.py", [*E2E, "--model-name", "tensorrt_llm_bls"]),
        C("end_to_end_grpc_client.py", [*E2E, "--model-name", "tensorrt_llm_bls", "-S"]),
        C("end_to_end_grpc_client.py", ["-u", "{grpc}", "-p", BATCH, "-o", "5", "--batch-inputs"], texts=3),
        C("end_to_end_grpc_client.py", ["-u", "{grpc}", "-p", BATCH, "-o", "5", "--batch-inputs",
                                        "--model-name", "tensorrt_llm_bls"], texts=3),
        C("end_to_end_grpc_client.py", [*E2E, *STOP], ends=" com", note=STOPPED),
        C("end_to_end_grpc_client.py", [*E2E, "-n", "2"], texts=2),
        C("end_to_end_grpc_client.py", [*E2E, "--return-log-probs", "--return-context-logits",
                                        "--return-generation-logits"]),
        C("end_to_end_grpc_client.py", [*E2E, "-S", "--return-perf-metrics"]),  # as upstream's CI runs it
        C("inflight_batcher_llm_client.py", [*IBL, "-S"]),
        C("inflight_batcher_llm_client.py", [*IBL, "-S", "--return-log-probs", "--return-perf-metrics"]),
        C("inflight_batcher_llm_client.py", [*IBL, "-S", "--return-context-logits", "--return-generation-logits"]),
        C("inflight_batcher_llm_client.py", [*IBL, "-n", "2", "--return-log-probs"], texts=2),
        C("inflight_batcher_llm_client.py", [*IBL, "-S", "--exclude-input-in-output"]),
        C("inflight_batcher_llm_client.py", IBL, "refused", 0, "unary ModelInfer to a decoupled model"),
    ]),
    "inflight_batcher_llm, unary (serve.decoupled=false)": ("inflight_batcher_llm", False, [
        C("end_to_end_grpc_client.py", E2E),
        C("end_to_end_grpc_client.py", [*E2E, "--model-name", "tensorrt_llm_bls"]),
        C("end_to_end_grpc_client.py", ["-u", "{grpc}", "-p", BATCH, "-o", "5", "--batch-inputs"],
          note=UNARY_BATCH),
        C("end_to_end_grpc_client.py", ["-u", "{grpc}", "-p", BATCH, "-o", "5", "--batch-inputs",
                                        "--model-name", "tensorrt_llm_bls"], note=UNARY_BATCH),
        C("end_to_end_grpc_client.py", [*E2E, *STOP], ends=" com", note=STOPPED),
        C("inflight_batcher_llm_client.py", IBL, note=EXCLUDED),
        C("inflight_batcher_llm_client.py", [*IBL, "--exclude-input-in-output"]),
        C("end_to_end_test.py", [*E2E_TEST, "-i", "http", "-u", "{http}"], texts=N_DATASET),
        C("end_to_end_test.py", [*E2E_TEST, "-i", "grpc", "-u", "{grpc}"], texts=N_DATASET),
        C("end_to_end_test.py", [*E2E_TEST, "-i", "http", "-u", "{http}", "--test-bls"], texts=N_DATASET),
        C("end_to_end_test.py", [*E2E_TEST, "-i", "grpc", "-u", "{grpc}", "--test-bls"], texts=N_DATASET),
        C("end_to_end_test.py", [*E2E_TEST, "-i", "grpc", "-u", "{grpc}", "--test-bls", "--return-log-probs"],
          texts=N_DATASET),
        C("inflight_batcher_llm_client.py", [*IBL, "--exclude-input-in-output", "--return-log-probs"]),
        C("end_to_end_grpc_client.py", [*E2E, "-S"], "refused", 0, "streaming needs a decoupled model"),
    ]),
    "llmapi, unary (serve.decoupled=false)": ("llmapi", False, [
        C("end_to_end_test.py", [*LLMAPI_TEST, "-i", "http", "-u", "{http}"], texts=N_DATASET),
        C("end_to_end_test.py", [*LLMAPI_TEST, "-i", "grpc", "-u", "{grpc}"], texts=N_DATASET),
        C("end_to_end_test.py", [*LLMAPI_TEST, "-i", "http", "-u", "{http}", *OUTPUT_CONFIG], texts=N_DATASET),
        C("end_to_end_test.py", [*LLMAPI_TEST, "-i", "grpc", "-u", "{grpc}", *OUTPUT_CONFIG], texts=N_DATASET),
        C("llmapi_client.py", ["-u", "{grpc}"]),
    ]),
    "llmapi, decoupled": ("llmapi", True, [
        C("end_to_end_test.py", [*LLMAPI_TEST, "--streaming", "-i", "grpc", "-u", "{grpc}"], texts=N_DATASET,
          note="the script checks the first 13 stream responses, each holding the text so far"),
        C("llmapi_client.py", ["-u", "{grpc}"], "refused", 0, "unary ModelInfer to a decoupled model"),
    ]),
}

# A line of a script's output that reports a failure (the scripts print these, or Python does).
ERROR_LINE = re.compile(r"Received an error from server|Encountered error|Traceback \(most recent call last\)|"
                        r"^\w*(Error|Exception)\b|\bFailed to infer|unexpected inference|FAIL!", re.M)


# ------------------------------------------------------------------------------------------------ parsing
def _bytes_repr(s: str) -> str | None:
    """``[b'..']`` / ``[[b'..']]`` (a numpy array of bytes as the scripts print it) -> its decoded text."""
    try:
        v = ast.literal_eval(s.strip())
    except (ValueError, SyntaxError):
        return None
    while isinstance(v, list) and len(v) == 1:
        v = v[0]
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else None


def _sections(out: str, head: str, stop: str | None = None) -> list[str]:
    """The text after every match of the line-start pattern ``head``, up to the next line matching ``stop`` (or
    ``head``) or the end of the output: a printed text may run over several lines."""
    bound = re.compile(stop or head, re.M)
    texts = []
    for m in re.finditer(head, out, re.M):
        nxt = bound.search(out, m.end())
        texts.append(out[m.end(): nxt.start() if nxt else len(out)].rstrip("\n"))
    return texts


def texts_of(script: str, args: list[str], out: str) -> list[str]:
    """The texts a script printed, read from its own output format."""
    if script == "end_to_end_grpc_client.py":
        if "-S" in args:  # streaming, verbose: one "<batch_index> [b'<piece>']" line per response
            pieces: dict[int, str] = {}
            for m in re.finditer(r"^(\d+) (\[.*\])$", out, re.M):
                piece = _bytes_repr(m.group(2))
                if piece is not None:
                    pieces[int(m.group(1))] = pieces.get(int(m.group(1)), "") + piece
            return [pieces[k] for k in sorted(pieces)]
        # "<batch_index>: <text>", or "<batch_index> [<sequence_index>]: <text>" with several sequences
        head = r"^\d+(?: \[\d+\])?: "
        return _sections(out, head, stop=rf"{head}|^output_log_probs|^context_logits|^generation_logits|"
                                        rf"^kv_cache_|{ERROR_LINE.pattern}")
    if script == "inflight_batcher_llm_client.py":  # "Output beam 0: <text>" (printed twice), then the ids
        texts = _sections(out, r"^Output beam \d+: ", stop=r"^Output beam \d+: |^Output sequence")
        return texts[::2]  # each printed twice
    if script == "end_to_end_test.py":
        if "--test-llmapi" in args:  # with -v: "Text output: <text>" per result
            return _sections(out, r"^Text output: ", stop=r"^(Text output: |Finish reason|Stop reason|\[INFO\])")
        return [t for t in (_bytes_repr(m) for m in re.findall(r"^ensemble output: (.*)$", out, re.M))
                if t is not None]
    if script == "llmapi_client.py":
        return _sections(out, r"^Output text: ", stop=r"^Output text: |^Got completed|^Encountered")
    raise KeyError(script)


def judge(script: str, args: list[str], expect: str, rc: int | None, out: str, n_texts: int = 1,
          ends: str = "") -> dict:
    """rc, texts and error lines -> the record's verdict. Text: exit 0, ``n_texts`` texts printed, none empty, no
    error line. Refused: the output holds an error that names the refusal (decoupled mode)."""
    texts = texts_of(script, args, out) if rc is not None else []
    lines = out.splitlines()
    errors = []  # each error line; "Received an error from server:" joined with the server's message after it
    for i, line in enumerate(lines):
        if ERROR_LINE.search(line):
            follows = lines[i + 1].strip() if line.rstrip().endswith(":") and i + 1 < len(lines) else ""
            errors.append(f"{line.strip()} {follows}".strip())
    errors = list(dict.fromkeys(errors))
    if expect == "text":
        problems = []
        if rc != 0:
            problems.append("timed out" if rc is None else f"exit {rc}")
        if not texts:
            problems.append("no text")
        elif len(texts) != n_texts:
            problems.append(f"{len(texts)} texts for {n_texts} prompts")
        elif not all(t.strip() for t in texts):
            problems.append(f"{sum(not t.strip() for t in texts)} of {len(texts)} texts empty")
        if ends and not all(t.endswith(ends) for t in texts):
            problems.append(f"a text does not end with {ends!r}")
        if errors:
            problems.append("errors in output")
        ok = not problems
    else:
        ok = rc is not None and bool(errors) and "decoupled" in out
        problems = [] if ok else ["not refused as upstream refuses it"]
    return {"rc": rc, "texts": texts, "errors": errors[:10], "ok": ok, "problems": problems}


# ------------------------------------------------------------------------------------------------ running
def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop("HF_TOKEN", None)
    return env


def build(root: Path, layout: str, decoupled: bool) -> Path:
    """The packaged repository of this deployment, built by the pipeline (cached stages are reused)."""
    cmd = [sys.executable, "-m", "pipeline", "build", "--json", *TINY, f"serve.layout={layout}",
           f"serve.decoupled={str(decoupled).lower()}", "until=package", f"paths.root={root}"]
    proc = subprocess.run(cmd, cwd=root, env=_env(), capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"build failed ({' '.join(cmd[3:])}):\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout)
    return Path(next(s["output"] for s in report["stages"] if s["stage"] == "package"))


def render_from(package: Path, root: Path, layout: str, decoupled: bool) -> Path:
    """The repository of this deployment rendered around the build output of an existing package (as the client
    tests do): the package's ``tensorrt_llm/1/engine`` copied, every config rendered and linted."""
    import shutil

    from pipeline import hardware
    from pipeline.triton.repository import render_repository
    from pipeline.triton import lint

    repo = root / "rendered" / f"{layout}-{'decoupled' if decoupled else 'unary'}"
    if repo.exists():
        shutil.rmtree(repo)
    shutil.copytree(package / ENGINE_REL, repo / ENGINE_REL)
    cfg = hardware.compose([*TINY, f"serve.layout={layout}", f"serve.decoupled={str(decoupled).lower()}"])
    render_repository(cfg, repo)
    problems = lint.lint(repo)
    if problems:
        raise SystemExit(f"{repo}: lint failed: {problems}")
    return repo


class Served:
    """``python -m pipeline serve REPO`` in a child process, until :meth:`stop`."""

    def __init__(self, repo: Path, log: Path, timeout_s: float = 600):
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", str(repo), "serve.openai.port=0"],
                                     cwd=repo.parent,
                                     env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self.http = self.grpc = None
        self.ready: list[str] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if line is None:
                break
            if line.startswith("HTTP "):
                self.http = line.split()[1].removeprefix("http://")
            elif line.startswith("gRPC "):
                self.grpc = line.split()[1]
            elif line.startswith("ready "):
                self.ready = line[6:].strip().split(", ")
                return
        self.stop()
        raise SystemExit(f"pipeline serve {repo} did not become ready:\n" + "".join(self.seen[-40:]))

    def _pump(self):
        with open(self.log, "w") as f:
            for line in self.proc.stdout:
                f.write(line)
                f.flush()
                self.seen.append(line)
                self.lines.put(line)
        self.lines.put(None)

    def stop(self) -> int | None:
        """SIGTERM (serve stops its server and exits 0), then SIGKILL after a minute."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def run_command(path: Path, args: list[str], subst: dict[str, str], cwd: Path, timeout_s: float) -> tuple:
    argv = [sys.executable, str(path), *(subst.get(a[1:-1], a) if a[:1] + a[-1:] == "{}" else a for a in args)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout_s)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = None
        out = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x for x in (exc.stdout, exc.stderr) if x)
    return rc, out, round(time.monotonic() - t0, 2)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _git_head(d: Path) -> str | None:
    proc = subprocess.run(["git", "-C", str(d), "rev-parse", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


# ------------------------------------------------------------------------------------------------ report
def _shown(args: list[str]) -> str:
    """A command's flags as the table shows them (placeholders kept, connection flags dropped)."""
    keep, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-u", "--dataset", "--max-input-len", "--tokenizer-dir", "--text", "-p", "-o"):
            skip = True
            if a == "--tokenizer-dir":
                keep.append("--tokenizer-dir …")
            if a == "-p" and args[args.index(a) + 1].startswith("["):
                keep.append("-p '[3 prompts]'")
            continue
        keep.append(f'"{a}"' if " " in a else a)
    return " ".join(keep)


def render(results: dict) -> str:
    up = results["upstream"]
    commit = (results["project_commit"] or "unknown") + (" with local changes" if results["project_dirty"] else "")
    lines = [f"Run {results['finished'][:10]} on commit {commit}; raw output in "
             f"`benchmarks/results/upstream_clients.json`. Scripts: tensorrtllm_backend @ {up['backend_ref']}, "
             f"`llmapi_client.py` @ {up['llmapi_ref']}. Connection flags (`-u`), `-p`/`--text` \"{PROMPT}\", `-o 16` "
             f"(`-o 5` with `--batch-inputs`) and `--dataset … --max-input-len 500` are left out below. A run passes "
             f"when it exits 0, prints one non-empty text per prompt and no error; a refusal passes when the server's "
             f"error names it, as upstream's backends refuse the same request.", "",
             "| deployment | script and flags | expected | exit | texts printed (chars) | error printed | verdict |",
             "|---|---|---|---|---|---|---|"]
    for name, dep in results["deployments"].items():
        for c in dep["commands"]:
            sizes = ", ".join(str(len(t)) for t in c["texts"][:3]) + (", …" if len(c["texts"]) > 3 else "")
            got = f"{len(c['texts'])} ({sizes})" if c["texts"] else "0"
            err = c["errors"][-1][:120].replace("|", "\\|") if c["errors"] else ""
            verdict = "pass" if c["ok"] else "**FAIL**: " + "; ".join(c["problems"])
            if c.get("note"):
                verdict += f" ({c['note']})"
            expect = f"text × {c['expected_texts']}" if c["expect"] == "text" else "refusal"
            if c.get("ends"):
                expect += f", ending {c['ends']!r}"
            cmd = f"{c['script']} {_shown(c['args'])}".strip()
            lines.append(f"| {name} | `{cmd}` | {expect} | {c['rc']} | {got} | {err} | {verdict} |")
    total = sum(len(d["commands"]) for d in results["deployments"].values())
    failed = sum(not c["ok"] for d in results["deployments"].values() for c in d["commands"])
    lines += ["", f"{total - failed} of {total} commands passed."]
    return "\n".join(lines)


def replace_block(marker: str, body: str, doc: Path) -> None:
    """tools/_docfile.py's generated-block rewrite (beside this script)."""
    from _docfile import replace_block as rewrite

    rewrite(marker, body, doc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend-checkout", type=Path,
                    help="tensorrtllm_backend checkout or extracted tree (client scripts, tools/utils, CI dataset)")
    ap.add_argument("--llmapi-client", type=Path,
                    help="TensorRT-LLM triton_backend/tools/llmapi_client.py")
    ap.add_argument("--backend-ref", default=None, help="the backend tree's commit, for the record (default: git HEAD)")
    ap.add_argument("--llmapi-ref", default="unknown", help="the commit llmapi_client.py was taken from")
    ap.add_argument("--root", type=Path, default=None, help="build root (default: a new temporary directory)")
    ap.add_argument("--engine-from", type=Path, default=None,
                    help="a packaged tiny-qwen3 repository whose build output (tensorrt_llm/1/engine) every deployment "
                         "reuses, rendered as tests/e2e/test_clients.py renders it, instead of a pipeline build each")
    ap.add_argument("--only", action="append", default=[], help="run only deployments whose name contains this")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per client command")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--no-doc", action="store_true", help="do not re-render docs/execution.md")
    ap.add_argument("--render-only", action="store_true", help="re-render docs/execution.md from --out; run nothing")
    a = ap.parse_args(argv)
    if a.render_only:
        replace_block(MARKER, render(json.loads(a.out.read_text())), DOC)
        return 0
    if a.backend_checkout is None or a.llmapi_client is None:
        ap.error("--backend-checkout and --llmapi-client are required")

    backend = a.backend_checkout.resolve()
    paths = {k: (backend / v if v else a.llmapi_client.resolve()) for k, v in SCRIPTS.items()}
    missing = [str(p) for p in [*paths.values(), backend / DATASET, backend / "tools/utils/utils.py"]
               if not p.is_file()]
    if missing:
        print(f"error: missing upstream files: {', '.join(missing)}", file=sys.stderr)
        return 2
    if a.engine_from and not (a.engine_from / ENGINE_REL).is_dir():
        print(f"error: --engine-from {a.engine_from}: no {ENGINE_REL} there", file=sys.stderr)
        return 2
    a.engine_from = a.engine_from.resolve() if a.engine_from else None
    root = (a.root or Path(tempfile.mkdtemp(prefix="upstream-clients-"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    results = {"started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "repositories": "rendered around --engine-from" if a.engine_from else "pipeline build until=package",
               "project_commit": head.stdout.strip() or None, "project_dirty": bool(dirty),
               "model": "tiny-qwen3", "overrides": TINY,
               "upstream": {"backend_ref": a.backend_ref or _git_head(backend) or "unknown",
                            "llmapi_ref": a.llmapi_ref,
                            "sha256": {k: _sha(p) for k, p in paths.items()}},
               "deployments": {}}
    previous = json.loads(a.out.read_text()) if a.only and a.out.is_file() else None
    for name, (layout, decoupled, commands) in DEPLOYMENTS.items():
        if a.only and not any(o in name for o in a.only):
            if previous and name in previous.get("deployments", {}):
                results["deployments"][name] = previous["deployments"][name]
            continue
        t0 = time.monotonic()
        repo = render_from(a.engine_from, root, layout, decoupled) if a.engine_from else build(root, layout, decoupled)
        print(f"== {name}: {repo} (built in {time.monotonic() - t0:.0f} s)", flush=True)
        served = Served(repo, root / f"serve-{layout}-{decoupled}.log")
        dep = {"layout": layout, "decoupled": decoupled, "ready": served.ready, "commands": []}
        subst = {"grpc": served.grpc, "http": served.http, "tokenizer": str(repo / ENGINE_REL),
                 "dataset": str(backend / DATASET)}
        try:
            for cmd in commands:
                script, args = cmd["script"], cmd["args"]
                path = paths[script]
                rc, out, secs = run_command(path, args, subst, path.parent, a.timeout)
                rec = {"script": script, "args": args, "expect": cmd["expect"], "expected_texts": cmd["texts"],
                       "ends": cmd["ends"], "note": cmd["note"], "seconds": secs,
                       **judge(script, args, cmd["expect"], rc, out, cmd["texts"], cmd["ends"]),
                       "output_tail": out[-2000:]}
                dep["commands"].append(rec)
                print(f"   {'ok  ' if rec['ok'] else 'FAIL'} {script} {_shown(args)}  rc={rc} "
                      f"texts={len(rec['texts'])} {'; '.join(rec['problems'])}", flush=True)
        finally:
            dep["serve_exit"] = served.stop()
        results["deployments"][name] = dep
    results["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1) + "\n")
    if not a.no_doc:
        replace_block(MARKER, render(results), DOC)
    failed = [c for d in results["deployments"].values() for c in d["commands"] if not c["ok"]]
    print(f"{sum(len(d['commands']) for d in results['deployments'].values()) - len(failed)} passed, "
          f"{len(failed)} failed; {a.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
