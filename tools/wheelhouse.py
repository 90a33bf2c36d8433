"""Download every dependency of this project as wheels, for installing on a host without internet.

    python tools/wheelhouse.py --dest wheelhouse --python-version 3.12 --platform manylinux_2_28_x86_64 \
        [--exclude torch] [--extras cpu-server]

1. Packages published only as source (antlr4-python3-runtime, which hydra-core needs) are built into wheels with
   ``pip wheel --no-deps``; they must be pure Python (a ``none-any`` wheel), which is checked.
2. pip resolves the project for the target interpreter and platform without installing anything
   (``pip install --dry-run --report``, binaries only).
3. What the host already has (``--exclude``, e.g. torch on a GPU image) is left out together with everything only it
   needs: a package is kept when the project reaches it without passing through an excluded one.
4. Every kept package must have the version the project's own virtual environment has (``--venv``, ``.venv`` by
   default), which is what the tests ran with: pip resolving for another platform with binaries only backtracks,
   silently, past a version whose dependency has no wheel (lm_eval 0.4.9 needs word2number, published as source
   only, so pip took lm_eval 0.4.1, which fails at import offline). Packages that differ are pinned to the venv's
   versions and resolved again, which builds the source-only dependencies that surface; a difference left after that
   fails the run, naming each package and both versions.
5. The kept packages are downloaded (``pip download --no-deps``), plus setuptools and wheel for the editable install,
   and ``requirements.txt`` in the wheelhouse pins them.

Install on the host with ``make install-offline WHEELHOUSE=DIR`` (``pip install --no-index --find-links DIR``).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
BUILD_TOOLS = ("setuptools>=68", "wheel")  # the editable install builds the project offline with these


def platforms(platform: str) -> list[str]:
    """pip matches ``--platform`` tags exactly: a manylinux_2_N tag also accepts every older glibc's wheels."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    n, arch = int(m.group(1)), m.group(2)
    tags = [f"manylinux_2_{k}_{arch}" for k in range(n, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{name}_{arch}" for k, name in legacy.items() if k <= n]


def target_args(python_version: str, platform: str) -> list[str]:
    args = ["--only-binary=:all:", "--implementation", "cp", "--python-version", python_version]
    for p in platforms(platform):
        args += ["--platform", p]
    return args


def marker_env(python_version: str, platform: str) -> dict[str, str]:
    machine = "aarch64" if platform.endswith("aarch64") else "x86_64"
    return {"python_version": python_version, "python_full_version": f"{python_version}.0", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": machine,
            "platform_python_implementation": "CPython", "implementation_name": "cpython",
            "implementation_version": f"{python_version}.0", "platform_release": "", "platform_version": ""}


def pip(*args: str, capture: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], text=True, capture_output=capture)


def build_project(tmp: Path) -> Path:
    out = tmp / "project"
    r = pip("wheel", "-q", "--no-deps", "-w", str(out), str(ROOT), capture=True)
    if r.returncode:
        sys.exit(f"error: building the project wheel failed:\n{r.stderr[-2000:]}")
    return next(out.glob("*.whl"))


def build_source_only(name: str, dest: Path) -> None:
    """A package with no wheel for the target: build one here; only a pure-Python wheel travels."""
    print(f"wheelhouse: {name} has no wheel on the index; building one from its source (pip wheel --no-deps)")
    with tempfile.TemporaryDirectory() as d:
        r = pip("wheel", "-q", "--no-deps", "--no-binary", ":all:", "-w", d, name, capture=True)
        if r.returncode:
            sys.exit(f"error: cannot build a wheel of {name}:\n{r.stderr[-2000:]}")
        for whl in Path(d).glob("*.whl"):
            _, _, _, tags = parse_wheel_filename(whl.name)
            if not all(t.platform == "any" and t.abi == "none" for t in tags):
                sys.exit(f"error: {whl.name} is not pure Python; build it on a machine like the target host")
            whl.replace(dest / whl.name)


def has_wheel(requirement: str, python_version: str, platform: str) -> bool:
    with tempfile.TemporaryDirectory() as d:
        return pip("download", "-q", "--no-deps", "-d", d, *target_args(python_version, platform), requirement,
                   capture=True).returncode == 0


def resolve(project: Path, extras: list[str], dest: Path, tmp: Path, python_version: str,
            platform: str, pins: list[str] = ()) -> list[dict]:
    """The install report of the project for the target (with ``pins``, ``name==version`` constraints), building
    source-only dependencies as they turn up."""
    spec = f"{project}[{','.join(extras)}]" if extras else str(project)
    for _ in range(10):
        report = tmp / "report.json"
        r = pip("install", "--dry-run", "--ignore-installed", "--target", str(tmp / "t"), "--report",
                str(report), "--find-links", str(dest), *target_args(python_version, platform), spec,
                *BUILD_TOOLS, *pins, capture=True)
        if r.returncode == 0:
            return json.loads(report.read_text())["install"]
        text = r.stdout + r.stderr
        wanted = re.findall(r"No matching distribution found for (\S+)", text)
        wanted += sorted(set(re.findall(r"depends on (\S+)", text)))
        missing = next((w for w in wanted if not has_wheel(w, python_version, platform)), None)
        if missing is None:
            pinned = f" with the venv's versions pinned ({' '.join(pins)})" if pins else ""
            sys.exit(f"error: pip could not resolve the project for Python {python_version} on {platform}{pinned}:\n"
                     f"{r.stderr[-3000:]}")
        build_source_only(missing, dest)
    sys.exit("error: too many source-only dependencies")


def venv_versions(venv: Path) -> dict[str, str] | None:
    """Canonical name -> version of every distribution installed in the virtual environment ``venv``; None when it
    has no Python."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions() if d.metadata['Name']}))")
    r = subprocess.run([str(python), "-c", code], text=True, capture_output=True)
    if r.returncode:
        sys.exit(f"error: cannot list the packages of {venv}:\n{r.stderr[-2000:]}")
    return {canonicalize_name(k): v for k, v in json.loads(r.stdout).items()}


def differences(items: list[dict], venv: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Packages whose resolved version is not the venv's: name -> (resolved, venv's). The project itself and packages
    the venv does not have are not compared."""
    out = {}
    for i in items:
        name, version = canonicalize_name(i["metadata"]["name"]), i["metadata"]["version"]
        have = venv.get(name)
        if have is not None and name != "llm-pipeline" and Version(version) != Version(have):
            out[name] = (version, have)
    return out


def keep(items: list[dict], exclude: set[str], env: dict[str, str]) -> list[dict]:
    """Packages the project reaches without passing through an excluded one (requested roots always)."""
    by_name = {canonicalize_name(i["metadata"]["name"]): i for i in items}
    todo = [(canonicalize_name(i["metadata"]["name"]), tuple(i.get("requested_extras") or ()))
            for i in items if i.get("requested")]
    seen: dict[str, set[str]] = {}
    while todo:
        name, extras = todo.pop()
        if name in exclude or name not in by_name:
            continue
        done = seen.setdefault(name, set())
        new = set(extras) | {""}
        if new <= done and done:
            continue
        done |= new
        for line in by_name[name]["metadata"].get("requires_dist") or []:
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in done):
                continue
            todo.append((canonicalize_name(req.name), tuple(req.extras)))
    return [by_name[n] for n in by_name if n in seen]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, required=True)
    ap.add_argument("--python-version", required=True, help="e.g. 3.12")
    ap.add_argument("--platform", required=True, help="e.g. manylinux_2_28_x86_64")
    ap.add_argument("--exclude", default="", help="space/comma separated: packages the host already has")
    ap.add_argument("--extras", default="", help="project extras, e.g. cpu-server")
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv",
                    help="the project's virtual environment, whose versions the wheelhouse must carry")
    a = ap.parse_args()
    exclude = {canonicalize_name(n) for n in re.split(r"[\s,]+", a.exclude) if n}
    extras = [e for e in re.split(r"[\s,]+", a.extras) if e]
    a.dest.mkdir(parents=True, exist_ok=True)
    venv = venv_versions(a.venv)
    if venv is None:
        print(f"wheelhouse: no virtual environment at {a.venv} (make setup): versions are not compared with one")
    env = marker_env(a.python_version, a.platform)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        project = build_project(tmp)
        items = keep(resolve(project, extras, a.dest, tmp, a.python_version, a.platform), exclude, env)
        differ = differences(items, venv or {})
        if differ:
            print("wheelhouse: pinning to the venv's versions: " + ", ".join(
                f"{n} {got} -> {want}" for n, (got, want) in sorted(differ.items())))
            pins = [f"{n}=={want}" for n, (_, want) in sorted(differ.items())]
            items = keep(resolve(project, extras, a.dest, tmp, a.python_version, a.platform, pins), exclude, env)
            differ = differences(items, venv or {})
        if differ:
            sys.exit("error: the wheelhouse would carry other versions than the project's venv (" + "; ".join(
                f"{n} {got}, the venv has {want}" for n, (got, want) in sorted(differ.items())) + "); fix the "
                "dependency pip cannot take for this target, or leave the package out with EXCLUDE if the host has "
                "it")
    pins = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in items
            if canonicalize_name(i["metadata"]["name"]) != "llm-pipeline"]
    r = pip("download", "-q", "--no-deps", "--find-links", str(a.dest), "-d", str(a.dest),
            *target_args(a.python_version, a.platform), *pins)
    if r.returncode:
        sys.exit("error: pip download failed (above)")
    (a.dest / "requirements.txt").write_text("".join(f"{p}\n" for p in sorted(pins, key=str.lower)))
    left_out = sorted(exclude)
    size = sum(p.stat().st_size for p in a.dest.glob("*.whl")) / 1e6
    print(f"wheelhouse: {len(pins)} wheels in {a.dest} ({size:.0f} MB) for CPython {a.python_version} on "
          f"{a.platform}{'; extras ' + ','.join(extras) if extras else ''}"
          f"{'; left out (the host has them): ' + ' '.join(left_out) if left_out else ''}")


if __name__ == "__main__":
    main()
