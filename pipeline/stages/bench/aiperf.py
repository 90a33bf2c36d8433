"""aiperf run natively against the OpenAI front end: one ``aiperf profile`` per measured level, whose artifact
directory (``profile_export_aiperf.json``/``.csv``, ``profile_export.jsonl``, ``inputs.json``, its log) is the
level's aiperf export, which ``aiperf plot`` reads.

The flags are aiperf 0.13's (``aiperf profile --help``; ``aiperf/config/flags``): ``--endpoint-type chat
--streaming`` (aiperf's own OpenAI chat endpoint type, ``POST /v1/chat/completions`` with ``stream: true`` and
``stream_options.include_usage``; no request template), ``--url`` (the base URL: aiperf appends the endpoint's
path), ``--model``, ``--tokenizer`` (the bundle's tokenizer directory; aiperf counts output tokens with it, as the
bench does), the level's own prompts as a ``single_turn`` dataset (``--input-file``, ``--custom-dataset-type``;
``output_length`` per line: ``max_completion_tokens``) sent in order, ``--request-count``, ``--concurrency``,
``--extra-inputs temperature:0`` (greedy, like the bench's other rows) and ``--artifact-dir``.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipeline.errors import StageFailed

# aiperf 0.13 in offline mode resolves every tokenizer name through the Hub cache (``snapshot_download``), a local
# directory included (aiperf/common/tokenizer.py ``_from_pretrained_local``); online, a local directory is loaded
# as it is, without a Hub request. The tokenizer is always the bundle's local directory.
_DROPPED_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def endpoint_type(chat: bool) -> str:
    """aiperf's endpoint type for the bench's OpenAI rows: ``chat`` (the chat template applied by the front end),
    ``completions`` for a model benched without its chat template."""
    return "chat" if chat else "completions"


def command(base_url: str, model: str, tokenizer: Path, dataset: Path, requests: int, concurrency: int, out: Path,
            chat: bool, seed: int, timeout_s: float, api_key: str | None = None) -> list[str]:
    """The ``aiperf profile`` command line of one level (``base_url``: ``http://HOST:PORT``, no ``/v1``; ``api_key``:
    the front end's key, which aiperf sends as ``Authorization: Bearer KEY`` and leaves out of its exports)."""
    return [sys.executable, "-m", "aiperf", "profile", *(["--api-key", api_key] if api_key else []),
            "--endpoint-type", endpoint_type(chat), "--streaming", "--url", base_url, "--model", model,
            "--tokenizer", str(tokenizer), "--input-file", str(dataset), "--custom-dataset-type", "single_turn",
            "--dataset-sampling-strategy", "sequential", "--request-count", str(requests),
            "--concurrency", str(concurrency), "--extra-inputs", "temperature:0", "--random-seed", str(seed),
            "--request-timeout-seconds", str(int(timeout_s)), "--artifact-dir", str(out), "--ui-type", "none",
            "--no-gpu-telemetry", "--no-server-metrics"]


def export_problems(run_dir: Path, chat: bool, requests: int, concurrency: int) -> list[str]:
    """What in aiperf's export in ``run_dir`` says it is not the level asked for: aiperf's own OpenAI endpoint type
    (``chat``, or ``completions`` without a chat template), streaming, no request template, every request sent
    (``inputs.json``: streamed payloads of that endpoint), the level's concurrency and request count."""
    want = endpoint_type(chat)
    try:
        doc = json.loads((run_dir / "profile_export_aiperf.json").read_text())
    except (OSError, ValueError) as exc:
        return [f"profile_export_aiperf.json: {exc}"]
    out = []
    ep = (doc.get("input_config") or {}).get("endpoint") or {}
    if ep.get("type") != want:
        out.append(f"endpoint type {ep.get('type')!r}, not {want!r}")
    if ep.get("streaming") is not True:
        out.append("not streaming")
    if "template" in ep or ep.get("custom_endpoint") or ep.get("path"):
        out.append("a request template or custom endpoint path (aiperf's own endpoint type sends its own requests)")
    phases = [p for p in (doc.get("input_config") or {}).get("phases") or [] if p.get("name") == "profiling"]
    if not phases or (phases[0].get("concurrency"), phases[0].get("requests")) != (concurrency, requests):
        got = (phases[0].get("concurrency"), phases[0].get("requests")) if phases else None
        out.append(f"profiling phase (concurrency, requests) {got}, not {(concurrency, requests)}")
    done = (doc.get("request_count") or {}).get("avg", 0) + (doc.get("error_request_count") or {}).get("avg", 0)
    if done != requests:
        out.append(f"{done:g} requests recorded, not {requests}")
    try:
        payloads = [p for s in json.loads((run_dir / "inputs.json").read_text())["data"] for p in s["payloads"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return out + [f"inputs.json: {exc}"]
    field = "messages" if chat else "prompt"
    bad = [p for p in payloads if p.get("stream") is not True or field not in p]
    if bad:
        out.append(f"inputs.json: {len(bad)} payload(s) not streamed {want} requests ({field!r}, stream: true)")
    return out


def profile(base_url: str, model: str, tokenizer: Path, prompts: list[str], max_tokens: int, concurrency: int,
            out: Path, chat: bool, seed: int, timeout_s: float, api_key: str | None = None) -> dict[str, Any]:
    """Run aiperf over ``prompts`` (in order) at ``concurrency``; its artifact directory is ``out``. Returns what
    bench.json records of it. aiperf runs under the server's supervisor (nothing outlives a ``kill -9``); a failed
    run, or an export that is not the level asked for, is a :class:`StageFailed` naming aiperf's log."""
    from pipeline.triton.server import supervised

    out.mkdir(parents=True, exist_ok=True)
    dataset = out.parent / f"{out.name}.dataset.jsonl"  # beside, not inside: the directory is aiperf's
    dataset.write_text("".join(json.dumps({"text": p, "output_length": max_tokens}) + "\n" for p in prompts))
    cmd = command(base_url, model, tokenizer, dataset, len(prompts), concurrency, out, chat, seed, timeout_s, api_key)
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    # aiperf leaves its IPC directories and dataset memory maps in the temporary directory: one of its own, removed
    # (aiperf's unix sockets live there, and a socket path over 107 bytes cannot be bound: a short one)
    base = tempfile.gettempdir()
    scratch = Path(tempfile.mkdtemp(prefix="aiperf-", dir=base if len(base) <= 40 or not os.path.isdir("/tmp")
                                    else "/tmp"))
    env["TMPDIR"] = str(scratch)
    log = out.parent / f"{out.name}.aiperf.log"
    with open(log, "wb") as fh, contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, scratch, ignore_errors=True)
        proc = subprocess.Popen(supervised(cmd), stdin=subprocess.PIPE, stdout=fh, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=120 + timeout_s * max(1, len(prompts) // max(1, concurrency)))
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            proc.stdin.close()  # the supervisor's stdin at EOF: it kills what is left of aiperf, then exits
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    dataset.unlink(missing_ok=True)  # aiperf's inputs.json holds every request it sent
    tail = " | ".join(x.strip() for x in log.read_text(errors="replace").strip().splitlines()[-8:] if x.strip())
    if rc != 0:
        what = "timed out" if rc is None else f"exited with {rc}"
        raise StageFailed(f"aiperf profile {what} at concurrency {concurrency}; its output ends: {tail}")
    problems = export_problems(out, chat, len(prompts), concurrency)
    if problems:
        raise StageFailed(f"aiperf's export at concurrency {concurrency} is not the level asked for: "
                          f"{'; '.join(problems)}; aiperf's output ends: {tail}")
    log.unlink()
    doc = json.loads((out / "profile_export_aiperf.json").read_text())

    def p50(tag):
        return (doc.get(tag) or {}).get("p50")

    return {"endpoint_type": endpoint_type(chat), "streaming": True, "aiperf_version": doc.get("aiperf_version"),
            "request_count": int((doc.get("request_count") or {}).get("avg", 0)),
            "error_count": int((doc.get("error_request_count") or {}).get("avg", 0)),
            "time_to_first_token_p50_ms": p50("time_to_first_token"),
            "inter_token_latency_p50_ms": p50("inter_token_latency"),
            "output_token_throughput": (doc.get("output_token_throughput") or {}).get("avg")}
