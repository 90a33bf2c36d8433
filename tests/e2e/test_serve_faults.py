"""`pipeline serve` as ops run it, against the real tritonserver and front end serving the shared tiny build: a
kill -9 of Triton under load (named, the reason in every client's error, nothing left in /dev/shm), restarts with
`serve.restart=on-failure`, a stalled Triton (SIGSTOP) seen by a bounded `/health`, and SIGTERM under load (a drain:
503 with Retry-After, in-flight streams finished or ended with an error event and [DONE], exit 0 only when it
completed). Slow tier: each test starts its own server."""
from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.serving import Serve

pytestmark = pytest.mark.slow

SHM = Path("/dev/shm")
SECTION = "pipeline serve under faults"
HEAD = ["tiny-qwen3 on the reference runtime behind the real tritonserver and the OpenAI front end, 8 streamed chat "
        "completions in flight (`ignore_eos`) unless the fault says otherwise. Each row is what its test observed: "
        "the clients' view, what `serve` printed (first line) and its exit code, and what was left afterwards "
        "(the server's `/dev/shm` regions, found by its own prefix, and its tritonserver process).", "",
        "| fault | what clients see | what serve prints | exit | left behind |", "|---|---|---|---|---|"]


def _row(fault: str, clients: str, prints: str, rc, left: str) -> None:
    """This fault's row of the section in docs/reliability.md (other rows kept)."""
    from tests.e2e.test_reliability import REPO, _record_section

    rows: dict[str, str] = {}
    text = (REPO / "docs" / "reliability.md").read_text()
    if f"\n## {SECTION}\n" in text:
        for line in text.split(f"\n## {SECTION}\n", 1)[1].split("\n## ", 1)[0].splitlines():
            if line.startswith("| ") and not line.startswith(("| fault |", "|---")):
                rows[line.split(" | ", 1)[0][2:]] = line
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    rows[fault] = f"| {cell(fault)} | {cell(clients)} | `{cell(prints)}` | {rc} | {cell(left)} |"
    _record_section(SECTION, [*HEAD, *(rows[k] for k in sorted(rows))])


def _resumed(proc, timeout_s: float = 10) -> None:
    """SIGCONT until ``proc`` runs again (a resume seen lost once on the loaded machine)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while proc.status() == psutil.STATUS_STOPPED and time.monotonic() < deadline:
        time.sleep(0.1)
        proc.send_signal(signal.SIGCONT)


def _left(prefix: str, triton) -> str:
    import psutil

    regions = list(SHM.glob(f"{prefix}*"))
    alive = psutil.pid_exists(triton.pid) and psutil.Process(triton.pid).status() != psutil.STATUS_ZOMBIE
    assert not regions, f"shared-memory regions outlived the server: {regions}"
    assert not alive, "tritonserver outlived serve"
    return "nothing (0 shm regions, no tritonserver)"


@pytest.fixture(scope="module")
def repo(tiny_build) -> Path:
    return next(tiny_build.glob("triton_repo/*-package-*/manifest.json")).parent


def _triton(serve: Serve):
    """(the tritonserver process under this serve, its python-backend shm prefix)."""
    import psutil

    for p in psutil.Process(serve.proc.pid).children(recursive=True):
        cmd = p.cmdline()
        if cmd and cmd[0].endswith("tritonserver"):
            prefix = next(a.split("=", 2)[2] for a in cmd if "shm-region-prefix-name=" in a)
            return p, prefix
    raise AssertionError("no tritonserver under pipeline serve")


def _stream(url: str, out: list, max_tokens: int = 400, started: threading.Semaphore | None = None) -> None:
    """One streamed chat completion that runs to ``max_tokens``; appends (status, events, Retry-After); releases
    ``started`` at its first event."""
    import httpx

    body = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Count."}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    events: list = []
    try:
        with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                out.append((r.status_code, [json.loads(r.read())], r.headers.get("retry-after")))
                return
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    if len(events) == 1 and started is not None:
                        started.release()
        out.append((200, events, None))
    except httpx.HTTPError as exc:
        out.append(("transport", events + [f"{type(exc).__name__}: {exc}"], None))


def _load(url: str, n: int, max_tokens: int = 400, timeout_s: float = 120) -> tuple[list, list[threading.Thread]]:
    """``n`` streams, returned once each has had its first event (all in flight)."""
    out: list = []
    started = threading.Semaphore(0)
    threads = [threading.Thread(target=_stream, args=(url, out, max_tokens, started), daemon=True)
               for _ in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for _ in range(n):
        assert started.acquire(timeout=max(0.0, deadline - time.monotonic())), f"streams did not start: {out}"
    return out, threads


def test_kill_9_of_triton_under_load_is_named_and_leaves_no_shm(repo, tmp_path):
    with Serve(repo, "serve.openai.port=0", cwd=tmp_path) as s:
        triton, prefix = _triton(s)
        regions = list(SHM.glob(f"{prefix}*"))
        assert regions, f"no /dev/shm region named {prefix}* while it serves"  # the check below can see them
        out, threads = _load(s.url, 8, max_tokens=2000)
        triton.send_signal(signal.SIGKILL)
        for t in threads:
            t.join(60)
        rc = s.proc.wait(60)
        err = s.proc.stderr.read()
    assert rc == 1, err[-2000:]
    assert "error: Triton was killed by SIGKILL while serving; its log since it became ready" in err, err[-2000:]
    assert "Traceback" not in err and "AioRpcError" not in err
    assert len(out) == 8
    for status, events, _ in out:
        assert status == 200, (status, events)
        error = next(e for e in events if isinstance(e, dict) and "error" in e)
        assert "is down: Triton was killed by SIGKILL" in error["error"]["message"], error
        assert events[-1] == "[DONE]"
    assert not list(SHM.glob(f"{prefix}*")), "shared-memory regions outlived the server"
    _row("kill -9 of tritonserver under load", f"each stream: an error event ({error['error']['message'][:90]}…) "
         f"then [DONE]", err.strip().splitlines()[0], rc, _left(prefix, triton))


def test_restart_on_failure_serves_again_then_gives_up(repo, tmp_path):
    import httpx

    with Serve(repo, "serve.openai.port=0", "serve.restart=on-failure", "serve.restart_max=1",
               "serve.restart_backoff_s=0.5", cwd=tmp_path) as s:
        first, prefix1 = _triton(s)
        first.send_signal(signal.SIGKILL)
        for line in s.proc.stdout:  # serving again: the same OpenAI address
            if line.startswith("stop with"):
                break
        second, prefix2 = _triton(s)
        assert second.pid != first.pid and prefix2 != prefix1
        assert not list(SHM.glob(f"{prefix1}*"))
        r = httpx.post(f"{s.url}/chat/completions", timeout=60,
                       json={"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        second.send_signal(signal.SIGKILL)  # the bound: one restart only
        rc = s.proc.wait(60)
        err = s.proc.stderr.read()
    assert rc == 1
    assert "restarting Triton in 0.5 s (restart 1 of 1, serve.restart=on-failure)" in err, err
    assert "error: gave up after 1 restarts (serve.restart_max=1)" in err, err
    assert not list(SHM.glob(f"{prefix2}*"))
    _row("kill -9 of tritonserver, serve.restart=on-failure restart_max=1, twice",
         f"after the first: the same address answers again ({r.status_code}); after the second: the server is gone",
         next(x for x in err.splitlines() if x.startswith("restarting")) + " … error: gave up after 1 restarts",
         rc, _left(prefix2, second))


def test_health_reports_a_stalled_triton_within_its_bound(repo, tmp_path):
    import httpx

    with Serve(repo, "serve.openai.port=0", cwd=tmp_path) as s:
        triton, _ = _triton(s)
        base = s.url.removesuffix("/v1")
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200  # control: healthy while it runs
        triton.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            r = httpx.get(f"{base}/health", timeout=10)
            took = time.monotonic() - t0
        finally:
            triton.send_signal(signal.SIGCONT)
            _resumed(triton)
        assert r.status_code == 503 and took < 4, (r.status_code, took)
        assert "did not answer a readiness probe within 2 s" in r.json()["error"]["message"]
        _, prefix = _triton(s)
        rc = s.stop()
        assert rc == 0
        printed = next(x for x in s.proc.stdout.read().splitlines() if x.startswith("stopped"))
    _row("SIGSTOP of tritonserver (then SIGCONT, then SIGINT to serve)",
         f"GET /health: {r.status_code} in {took:.1f} s, \"{r.json()['error']['message']}\"",
         f"nothing during the stall; on SIGINT: {printed}", rc, _left(prefix, triton))


@pytest.mark.parametrize("drain_s, max_tokens, completed", [(60, 300, True), (2, 2000, False)])
def test_sigterm_under_load_drains(repo, tmp_path, drain_s, max_tokens, completed):
    """8 streams in flight, then SIGTERM: a new request gets 503 with Retry-After; the streams finish (a long
    drain_s) or end with an error event and [DONE] once drain_s ran out; then Triton stops and nothing is left;
    exit 0 only when the drain completed (3 when it was cut)."""
    import httpx

    with Serve(repo, "serve.openai.port=0", f"serve.drain_s={drain_s}", cwd=tmp_path) as s:
        triton, prefix = _triton(s)
        out, threads = _load(s.url, 8, max_tokens=max_tokens)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        for _ in range(100):  # until the drain has begun (a request before it is served as usual)
            refused = httpx.post(f"{s.url}/chat/completions", timeout=30,
                                 json={"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 1})
            if refused.status_code != 200:
                break
            time.sleep(0.05)
        for t in threads:
            t.join(120)
        rc = s.proc.wait(120)
        took = time.monotonic() - t0
        stdout, err = s.proc.stdout.read(), s.proc.stderr.read()
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.text
    assert "shutting down" in refused.json()["error"]["message"]
    assert len(out) == 8
    for status, events, _ in out:
        assert status == 200 and events[-1] == "[DONE]", (status, events[-3:])
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        if completed:
            assert not errors and events[-2]["choices"][0]["finish_reason"] == "length", events[-3:]
        else:
            assert len(errors) == 1 and "serve.drain_s=2 s" in errors[0]["error"]["message"], events[-3:]
    assert "Traceback" not in err and "CancelledError" not in err, err[-3000:]
    if completed:
        assert rc == 0 and "stopped (drained: every request in flight finished; Triton stopped after)" in stdout
    else:
        assert rc == 3 and "drain cut after serve.drain_s=2 s" in stdout, (rc, stdout, err[-2000:])
        assert took < 2 + 5 + 15, took  # the drain, the cut's grace, Triton's stop
    first = next(x for x in stdout.splitlines() if x.startswith("stopped"))
    seen = ("each stream ran to its end (finish_reason length) and [DONE]" if completed else
            f"each stream: an error event ({errors[0]['error']['message'][:80]}…) then [DONE]")
    _row(f"SIGTERM to serve under load, serve.drain_s={drain_s}",
         f"{seen}; a new request: 503, Retry-After {refused.headers['retry-after']}", first, rc,
         _left(prefix, triton))


def test_kill_9_of_serve_itself_leaves_no_server_and_no_shm(repo, tmp_path):
    """The supervisor sees its pipe close: it kills Triton and its stubs and removes the server's regions. The work
    directory the killed serve had in the temp directory is left; the next serve removes it (its owner's pid is
    dead), and leaves a live owner's and any other directory alone."""
    import os

    import psutil

    with Serve(repo, "serve.openai.port=0", cwd=tmp_path) as s:
        triton, prefix = _triton(s)
        assert list(SHM.glob(f"{prefix}*"))  # the control: they exist while it serves
        work = list(tmp_path.glob("pipeline-serve-*"))
        assert len(work) == 1, work
        s.proc.send_signal(signal.SIGKILL)
        rc = s.proc.wait(30)
        deadline = time.monotonic() + 10
        while (list(SHM.glob(f"{prefix}*")) or psutil.pid_exists(triton.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
    left = _left(prefix, triton)
    assert work[0].is_dir()  # what the kill left
    live = tmp_path / f"pipeline-serve-{os.getpid()}-planted"  # a live owner's (this test's pid)
    other = tmp_path / "pipeline-serve-notapid"  # not named by a pid: not ours to judge
    for d in (live, other):
        d.mkdir()
    with Serve(repo, "serve.openai.port=0", cwd=tmp_path) as s:
        assert s.stop() == 0
    assert not work[0].exists(), f"the next serve left the killed serve's {work[0].name}"
    assert live.is_dir() and other.is_dir()
    _row("kill -9 of pipeline serve", "the connection drops (no process is left to answer)", "nothing (killed)",
         rc, f"{left}; its work directory in the temp directory, removed by the next serve (its owner's pid is dead)")


def test_a_second_signal_during_a_drain_ends_the_streams_at_once(repo, tmp_path):
    """8 long streams, then SIGINT twice 0.2 s apart while the drain (serve.drain_s=60) waits for them: the second
    signal ends every stream at once with the error event and [DONE], serve says so and exits 3 (requests were still
    in flight when the drain ended), with no traceback."""
    with Serve(repo, "serve.openai.port=0", "serve.drain_s=60", cwd=tmp_path) as s:
        triton, prefix = _triton(s)
        out, threads = _load(s.url, 8, max_tokens=2000)
        s.proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(60)
        ended = time.monotonic() - t0
        rc = s.proc.wait(60)
        stdout, err = s.proc.stdout.read(), s.proc.stderr.read()
    assert len(out) == 8
    for status, events, _ in out:
        assert status == 200 and events[-1] == "[DONE]", (status, events[-3:])
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and "second SIGINT" in errors[0]["error"]["message"], events[-3:]
    assert ended < 4, f"the streams ended {ended:.1f} s after the second signal"
    assert "Traceback" not in err and "CancelledError" not in err, err[-3000:]
    first = next(x for x in stdout.splitlines() if x.startswith("stopped"))
    assert rc == 3 and "drain cut by a second SIGINT" in first, (rc, stdout, err[-2000:])
    _row("SIGINT to serve under load, then a second SIGINT 0.2 s later (serve.drain_s=60)",
         f"each stream: an error event (…{errors[0]['error']['message'].rsplit(': ', 1)[-1]}) then [DONE], "
         f"{ended:.1f} s after the second signal", first, rc, _left(prefix, triton))


def _probe(url: str) -> tuple:
    """One chat completion: (status, Retry-After, error message) or ("refused", None, None)."""
    import httpx

    try:
        r = httpx.post(f"{url}/chat/completions", timeout=30,
                       json={"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    except httpx.TransportError as exc:
        return ("refused", None, type(exc).__name__)
    message = r.json().get("error", {}).get("message") if r.status_code != 200 else None
    return (r.status_code, r.headers.get("retry-after"), message)


def test_the_openai_port_answers_503_while_triton_restarts(repo, tmp_path):
    """kill -9 of Triton with serve.restart=on-failure: until the new server serves, every request is answered 503
    with Retry-After and the reason; then 200 on the same address. No connection is refused meanwhile."""
    with Serve(repo, "serve.openai.port=0", "serve.restart=on-failure", "serve.restart_backoff_s=1",
               cwd=tmp_path) as s:
        first, prefix = _triton(s)
        first.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        seen = []
        while time.monotonic() - t0 < 120:
            seen.append(_probe(s.url))
            if seen[-1][0] == 200:
                break
            time.sleep(0.1)
        took = time.monotonic() - t0
        rc = s.stop()
        err = s.proc.stderr.read()
    assert rc == 0, err[-2000:]
    outcomes = sorted({str(x[0]) for x in seen})
    assert seen[-1][0] == 200, seen[-5:]
    assert all(x[0] in (200, 503) for x in seen), f"outcomes while Triton restarted: {outcomes}: {seen[:10]}"
    refused = [x for x in seen if x[0] == 503]
    assert refused, "no request was made while Triton restarted"
    for status, retry, message in refused:
        assert retry is not None and int(retry) > 0, (status, retry, message)
        assert "killed by SIGKILL" in message, message
    _row("kill -9 of tritonserver, serve.restart=on-failure (restart_backoff_s=1), requests every 0.1 s",
         f"{len(refused)} requests answered 503 with Retry-After {refused[0][1]} (\"{refused[0][2][:90]}…\"), then "
         f"200 on the same address after {took:.1f} s; no connection refused",
         next(x for x in err.splitlines() if x.startswith("restarting")), rc, _left(prefix, first))


def test_the_openai_port_answers_503_until_serve_exits_after_triton_died(repo, tmp_path):
    """kill -9 of Triton with serve.restart=no: serve exits 1, and until its listening socket closes on its way out
    (its last act: the interpreter's own teardown follows), every request is answered 503 with Retry-After and the
    reason."""
    with Serve(repo, "serve.openai.port=0", cwd=tmp_path) as s:
        triton, prefix = _triton(s)
        triton.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        seen = []
        while s.proc.poll() is None and time.monotonic() - t0 < 60:
            seen.append((time.monotonic(), *_probe(s.url)))
            time.sleep(0.05)
        exited = time.monotonic()
        rc = s.proc.wait(30)
        err = s.proc.stderr.read()
    assert rc == 1, err[-2000:]
    answered = [x for x in seen if x[1] != "refused"]
    refused = [x for x in seen if x[1] == "refused"]
    assert answered, f"no request was answered after the kill: {seen[:5]}"
    for _, status, retry, message in answered:
        assert status == 503 and retry is not None, (status, retry, message)
        assert "killed by SIGKILL" in message, message
    assert not refused or refused[0][0] > answered[-1][0], "the port refused a request, then answered again"
    window = exited - refused[0][0] if refused else 0.0
    assert window < 2.0, f"connections were refused {window:.2f} s before serve exited"
    _row("kill -9 of tritonserver, serve.restart=no, requests every 0.05 s until serve exits",
         f"{len(answered)} request{'s' if len(answered) != 1 else ''} answered 503 with Retry-After "
         f"{answered[0][2]} (\"{answered[0][3][:90]}…\"); "
         f"refused only once serve closed its port on the way out, {window:.2f} s before it exited",
         err.strip().splitlines()[0], rc, _left(prefix, triton))
