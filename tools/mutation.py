"""Mutation testing of the checks that vouch for a bundle, with mutmut (3.x).

    python tools/mutation.py                      # every module below, one after the other
    python tools/mutation.py proof lint           # some of them (names from MODULES)
    python tools/mutation.py --list               # the modules, their functions in scope and their tests
    python tools/mutation.py --render             # only re-render docs/mutation.md from the JSON
    python tools/mutation.py --sample 80          # 80 mutants per module, evenly spaced (a quick estimate)

Needs the ``mutation`` extra (``pip install -e '.[mutation]'``: mutmut 3).

Each module is mutated in a scratch copy of the working tree (``--work``, default a temporary directory), with a
``setup.cfg [mutmut]`` written there: ``only_mutate`` is that one file, the tests are the fast test files that
cover it (``MODULES``), and only the mutants of the functions that make the check (``MODULES[...]["functions"]``) are
run. mutmut records which tests reach each function and runs only those for each mutant. One worker
(``--max-children 1``) under ``nice -n 19`` by default: a run shares the machine with timing benchmarks.

A mutant is *killed* when a test fails on it (or its tests run past mutmut's CPU-time limit: those are listed, with
their change, so that a kill by timeout can be read), *survived* when every covering test passes, *no
tests* when no selected test reaches its function. The score of a module is killed / (all mutants in scope minus
the survivors recorded as equivalent in ``tools/mutation_equivalent.yaml``, each with the mutated line it applies
to and why no test can tell it apart). Raw results, survivors with their diffs included, go to
``benchmarks/results/mutation.json``; the table in ``docs/mutation.md`` is rendered from that file only.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "mutation.json"
DOC = REPO / "docs" / "mutation.md"
EQUIVALENT = REPO / "tools" / "mutation_equivalent.yaml"
TARGET = 0.90

# name -> the file mutated, the functions in scope (fnmatch patterns on mutmut's function names: ``x_<function>``
# for a module function, ``xǁ<Class>ǁ<method>`` for a method) and the fast test files that cover them.
MODULES: dict[str, dict] = {
    "proof": {
        "path": "pipeline/quant/proof.py",
        "functions": ["x_check_structure", "x_check_layers", "x_scale_problems", "x_check_numbers", "x_quant_config",
                      "x_architecture", "x_sketch_matrix", "x__sketch", "xǁCheckpointǁ*",
                      "x_calibrated_scales", "x_quantized_linears", "x__pre_quant_scale", "x_record", "x_resketch",
                      "xǁReferenceǁto_json"],
        "tests": ["tests/unit/test_export_proof.py", "tests/unit/test_quant_checks.py"],
    },
    "formats": {  # the export layouts the proof reads, and the kernels the reference runtime computes with
        "path": "pipeline/formats/_base.py",
        "functions": ["xǁExportLayoutǁ*", "xǁQuantFormatǁ*", "xǁKVFormatǁ*", "x_e4m3_to_float", "x_fake_fp8",
                      "x_unpack_int4_rows", "x_dequantize_int4_groups"],
        "tests": ["tests/unit/test_export_proof.py", "tests/unit/test_formats.py", "tests/unit/test_reference.py"],
    },
    "quality": {
        "path": "pipeline/quality.py",
        "functions": ["x_compare", "x_breaches", "x_gate", "x_assess", "x_failure"],
        "tests": ["tests/unit/test_quality.py"],
    },
    "lint": {
        "path": "pipeline/triton/lint.py",
        "functions": ["x_conformance", "x__tensor_view", "x__steps", "x__step_differences", "x__tensors",
                      "x__dtype", "x__params", "x_check_ensemble", "x_lint"],
        "tests": ["tests/unit/test_lint_conformance.py", "tests/unit/test_lint_ensemble.py", "tests/unit/test_lint.py",
                  "tests/e2e/test_conformance.py"],
    },
    "upstream": {
        "path": "pipeline/upstream/__init__.py",
        "functions": ["x_*"],
        "tests": ["tests/unit/test_upstream_lookup.py", "tests/unit/test_upstream.py", "tests/unit/test_lint.py",
                  "tests/e2e/test_conformance.py"],
    },
    "upstream-verify": {
        "path": "pipeline/upstream/refresh.py",
        "functions": ["x_find_layout_dir", "x_parse_checkout", "x__by_name", "x__norm", "x_diff_model",
                      "x_verify_checkout"],
        "tests": ["tests/unit/test_record_comparison.py", "tests/unit/test_upstream.py"],
    },
    "upstream-parse": {
        "path": "pipeline/upstream/pbtxt.py",
        "functions": ["x_*"],
        "tests": ["tests/unit/test_record_comparison.py", "tests/unit/test_upstream.py",
                  "tests/e2e/test_conformance.py"],
    },
    "bench-gates": {
        "path": "pipeline/stages/bench/gates.py",
        "functions": ["x_gates", "x__bench_rows_ok", "x__read_baseline", "x_baseline_line", "x_summary_row"],
        "tests": ["tests/unit/test_bench_gates.py", "tests/unit/test_bench.py"],
    },
    "bench-result": {
        "path": "pipeline/stages/bench/stage.py",
        "functions": ["x_bench_result", "x_choose_entry"],
        "tests": ["tests/unit/test_bench_gates.py", "tests/unit/test_bench.py"],
    },
    "verify": {
        "path": "pipeline/bundle/verifying.py",
        "functions": ["x__verify", "x_verify", "x_container_check", "x__same_version"],
        "tests": ["tests/unit/test_bundle.py", "tests/unit/test_verify.py", "tests/e2e/test_signing.py"],
    },
    "bundle-store": {
        "path": "pipeline/bundle/remote.py",
        "functions": ["x_sha256", "x_open_manifest", "x__damaged"],
        "tests": ["tests/unit/test_bundle.py", "tests/unit/test_verify.py"],
    },
    "publish-gates": {
        "path": "pipeline/stages/publish.py",
        "functions": ["x_bench_verdict", "x_gates_passed", "x_gate_verdicts", "x_unquantized"],
        "tests": ["tests/unit/test_publish_gates.py", "tests/unit/test_bundle.py"],
    },
}

# mutmut's exit codes (mutmut/stats.py status_by_exit_code), folded into the outcomes reported here
TIMED_OUT = {36, -24, 24, 152, 255}  # the tests ran past their CPU-time limit (SIGXCPU): mutmut counts it killed
KILLED = {1, 3} | TIMED_OUT  # a failing test, pytest's internal error, or a timeout
# mutmut's CPU-time limit for a mutant is (the tests' recorded call time + timeout_constant) * timeout_multiplier * 2;
# the recorded time leaves fixtures out (rendering model repositories, building exports), so the constant covers them:
# a survivor must be able to run all its tests within the limit, or a mutant no test tells apart is counted killed.
TIMEOUT_MULTIPLIER = 5.0
TIMEOUT_CONSTANT = 15.0
SURVIVED = {0}
NO_TESTS = {5, 33}


def _copy_tree(dst: Path) -> None:
    """The working tree as git sees it (tracked and untracked-but-not-ignored files), without the outputs."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = REPO / name
        if not src.is_file() or name.startswith("benchmarks/results/"):
            continue
        target = dst / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def _setup_cfg(module: dict, basetemp: Path) -> str:
    def lines(values: list[str]) -> str:
        return "".join(f"\n    {v}" for v in values)

    addopts = ["-p", "no:cacheprovider", f"--basetemp={basetemp}", "-m", "not slow and not serial and not network",
               "-p", "no:xdist", "-p", "no:randomly"]
    return ("[mutmut]\n"
            "source_paths = pipeline\n"
            f"only_mutate = {module['path']}\n"
            f"also_copy ={lines(['conf', 'hydra_plugins', 'benchmarks', 'tools'])}\n"
            f"pytest_add_cli_args_test_selection ={lines(module['tests'])}\n"
            f"pytest_add_cli_args ={lines(addopts)}\n"
            f"timeout_multiplier = {TIMEOUT_MULTIPLIER}\n"
            f"timeout_constant = {TIMEOUT_CONSTANT}\n"
            "use_git_change_detection = false\n")


def _mutmut() -> list[str]:
    exe = Path(sys.executable).with_name("mutmut")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "mutmut"]


def _diff(work: Path, name: str, env: dict[str, str]) -> str:
    proc = subprocess.run([*_mutmut(), "show", name], cwd=work, env=env, capture_output=True, text=True)
    return "\n".join(x for x in proc.stdout.splitlines() if not x.startswith("# "))


def _changed_line(diff: str) -> str:
    plus = [x[1:].strip() for x in diff.splitlines() if x.startswith("+") and not x.startswith("+++")]
    return plus[0] if plus else ""


EQUIVALENTS: dict[str, dict] | None = None  # read once per run (main), so an edit during a run cannot break it


def _load_equivalent() -> dict[str, dict]:
    if not EQUIVALENT.is_file():
        return {}
    import yaml

    return yaml.safe_load(EQUIVALENT.read_text()) or {}


def mutant_stem(path: str) -> str:
    """The dotted prefix of mutmut's mutant names for a module file (a package's ``__init__`` is the package)."""
    stem = path[:-3].replace("/", ".")
    return stem[: -len(".__init__")] if stem.endswith(".__init__") else stem


def _generate(work: Path, env: dict[str, str], path: str, patterns: list[str], nice: int, timeout: float,
              key: str) -> list[str]:
    """Every mutant name in scope: mutmut writes them all when it starts (``mutants/<path>.meta``); a run of one
    unknown name generates them and stops."""
    import fnmatch

    subprocess.run(["nice", "-n", str(nice), *_mutmut(), "run", "--max-children", "1",
                    f"{mutant_stem(path)}.x_no_such_function"],
                   cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    meta = work / "mutants" / f"{path}.meta"
    if not meta.is_file():
        raise SystemExit(f"[{key}] mutmut generated no mutants (no {meta})")
    names = json.loads(meta.read_text())["exit_code_by_key"]
    return sorted(n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns))


def _sample(names: list[str], n: int) -> list[str]:
    """``n`` names evenly spaced over the sorted list (every function keeps its share; the same names for the same
    code)."""
    if n <= 0 or n >= len(names):
        return names
    step = len(names) / n
    return [names[int(i * step)] for i in range(n)]


def run_module(key: str, work_root: Path, *, nice: int, timeout: float, sample: int = 0) -> dict:
    import fnmatch

    module = MODULES[key]
    work = work_root / key
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    _copy_tree(work)
    basetemp = work_root / f"{key}-pytest"
    (work / "setup.cfg").write_text(_setup_cfg(module, basetemp))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MUTANT_UNDER_TEST")}
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1"})
    stem = mutant_stem(module["path"])
    patterns = [f"{stem}.{f}__mutmut_*" for f in module["functions"]]
    selected = patterns
    population = None
    if sample:
        everyone = _generate(work, env, module["path"], patterns, nice, timeout, key)
        population = len(everyone)
        selected = _sample(everyone, sample)
        if not selected:
            raise SystemExit(f"[{key}] no mutant matches {module['functions']} in {module['path']}")
        patterns = selected  # the score is over the sample
    cmd = ["nice", "-n", str(nice), *_mutmut(), "run", "--max-children", "1", *selected]
    started = time.monotonic()
    print(f"[{key}] mutmut run on {module['path']} against {', '.join(module['tests'])}", flush=True)
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - started
    (work_root / f"{key}.log").write_text(proc.stdout + proc.stderr)
    meta = work / "mutants" / f"{module['path']}.meta"
    if not meta.is_file():
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise SystemExit(f"[{key}] mutmut wrote no results (exit {proc.returncode}); its output ends:\n{tail}")
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    in_scope = {n: c for n, c in codes.items()
                if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
    equivalent = EQUIVALENTS if EQUIVALENTS is not None else _load_equivalent()
    outcome = {"killed": [], "survived": [], "no_tests": [], "other": []}
    survivors, timed_out = [], []
    for name, code in sorted(in_scope.items()):
        if code in KILLED:
            outcome["killed"].append(name)
            if code in TIMED_OUT:  # listed with its change: a timeout is a kill only if the mutant really hangs
                diff = _diff(work, name, env)
                timed_out.append({"mutant": name, "changed_line": _changed_line(diff), "diff": diff})
        elif code in SURVIVED:
            outcome["survived"].append(name)
            diff = _diff(work, name, env)
            line = _changed_line(diff)
            eq = equivalent.get(name)
            is_eq = bool(eq) and eq.get("line", "").strip() == line
            survivors.append({"mutant": name, "changed_line": line, "diff": diff,
                              "equivalent": is_eq, "reason": eq.get("reason") if is_eq else None})
        elif code in NO_TESTS:
            outcome["no_tests"].append(name)
        else:
            outcome["other"].append(f"{name}: exit {code}")
    n_eq = sum(s["equivalent"] for s in survivors)
    scored = len(in_scope) - n_eq
    score = len(outcome["killed"]) / scored if scored else None
    print(f"[{key}] {len(outcome['killed'])}/{scored} killed ({len(timed_out)} by timeout; {n_eq} equivalent "
          f"survivors left out), "
          f"{wall:.0f} s", flush=True)
    return {"module": module["path"], "functions": module["functions"], "tests": module["tests"],
            "mutants": len(in_scope), "sampled_from": population, "killed": len(outcome["killed"]), "survived": len(outcome["survived"]),
            "no_tests": len(outcome["no_tests"]), "other": outcome["other"], "equivalent": n_eq,
            "score": round(score, 4) if score is not None else None, "meets_target": score is not None and
            score >= TARGET, "wall_s": round(wall, 1), "mutmut_exit": proc.returncode,
            "timed_out": timed_out, "survivors": survivors, "untested": outcome["no_tests"]}


def commit_info() -> dict:
    """The commit the script saw, and whether the working tree differed from it (a run of uncommitted code)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    # the tool's own outputs (this JSON and the table rendered from it) are left out: they are not what is measured
    outputs = [f":(exclude){p.relative_to(REPO)}" for p in (RESULTS, DOC)]
    return {"commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", *outputs))}


def render(doc: dict) -> None:
    from _docfile import replace_block  # tools/_docfile.py, beside this script

    lines = [f"Last run {doc['date']} on {doc['machine']}, commit `{(doc['commit'] or '?')[:10]}`"
             f"{' (with uncommitted changes)' if doc['dirty'] else ''}, mutmut {doc['mutmut']}; each module's row "
             f"names the commit it was measured at; raw results: "
             f"`benchmarks/results/mutation.json` (written by `python tools/mutation.py`).", "",
             "| module | mutants in scope | killed | survived (equivalent) | no test reaches | score | target 90% |"
             " tests | wall | commit |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in doc["modules"].items():
        score = f"{100 * r['score']:.1f}%" if r["score"] is not None else "n/a"
        scope = f"{r['mutants']}" + (f" (sample of {r['sampled_from']})" if r.get("sampled_from") else "")
        timeouts = len(r.get("timed_out", []))
        killed = f"{r['killed']}" + (f" ({timeouts} by timeout)" if timeouts else "")
        lines.append(f"| {key} (`{r['module']}`) | {scope} | {killed} | {r['survived']} "
                     f"({r['equivalent']}) | {r['no_tests']} | {score} | {'met' if r['meets_target'] else 'NOT met'} "
                     f"| {', '.join(f'`{t}`' for t in r['tests'])} | {r['wall_s']:.0f} s "
                     f"| `{(r.get('commit') or '?')[:10]}`{' (uncommitted changes)' if r.get('dirty') else ''} |")
    lines += ["", "Survivors (equivalent ones with the reason; the others are gaps), and mutants killed only by a "
                  "timeout:", ""]
    for key, r in doc["modules"].items():
        for s in r["survivors"]:
            why = f"equivalent: {s['reason']}" if s["equivalent"] else "**not killed**"
            lines.append(f"- {key}: `{s['mutant']}`: `{s['changed_line']}`: {why}")
        for name in r["untested"]:
            lines.append(f"- {key}: `{name}`: no selected test reaches it")
        for t in r.get("timed_out", []):
            lines.append(f"- {key}: `{t['mutant']}`: `{t['changed_line']}`: counted killed by a timeout (its tests "
                         f"ran past mutmut's CPU-time limit)")
    replace_block("mutation", "\n".join(lines), DOC)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("modules", nargs="*", help=f"of {', '.join(MODULES)} (default: all)")
    ap.add_argument("--work", type=Path, help="scratch directory (default: a new temporary one, removed after)")
    ap.add_argument("--nice", type=int, default=19)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per module")
    ap.add_argument("--sample", type=int, default=0, metavar="N",
                    help="run N mutants per module, evenly spaced over those in scope (0: all)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--render", action="store_true")
    args = ap.parse_args(argv)
    if args.list:
        for key, m in MODULES.items():
            print(f"{key}: {m['path']}\n  functions: {', '.join(m['functions'])}\n  tests: {', '.join(m['tests'])}")
        return 0
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        print(f"error: unknown module {', '.join(unknown)}; choose from {', '.join(MODULES)}", file=sys.stderr)
        return 2
    global EQUIVALENTS
    EQUIVALENTS = _load_equivalent()
    doc = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"modules": {}}
    if not args.render:
        from importlib import metadata

        work_root = args.work or Path(tempfile.mkdtemp(prefix="mutation-"))
        keys = args.modules or list(MODULES)
        for key in keys:  # the raw JSON is written after each module: a long run keeps what it measured
            info = commit_info()  # the tree each module copies, read just before it is copied
            doc["modules"][key] = {**run_module(key, work_root, nice=args.nice, timeout=args.timeout,
                                                sample=args.sample), **info}
            doc.update(info, date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       machine=f"{platform.node()} ({os.cpu_count()} cores, {platform.python_version()})",
                       mutmut=metadata.version("mutmut"), target=TARGET)
            doc["modules"] = {k: doc["modules"][k] for k in MODULES if k in doc["modules"]}
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
        if args.work is None:
            shutil.rmtree(work_root, ignore_errors=True)
    render(doc)
    failing = [k for k, r in doc["modules"].items() if not r["meets_target"]]
    if failing:
        print(f"below {TARGET:.0%}: {', '.join(failing)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
