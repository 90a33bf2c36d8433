"""``uv pip install`` into a virtual environment with the package sources pip is configured with here.

    python tools/uv_pip.py --python .venv/bin/python [--torch-or-pip] -- torch==2.13.0 ...

`make setup` installs with uv (resolution and wheel installs several times faster than pip's on 2 cores). uv does
not read pip's configuration, so the sources a machine gives pip (``pip config list``: its config files and
``PIP_*`` variables) are handed to uv explicitly, as pip would use them:

- ``index-url`` -> ``--index-url``, ``extra-index-url`` -> ``--extra-index-url``, ``find-links`` ->
  ``--find-links``, ``no-index`` -> ``--no-index``, ``constraint`` -> ``--constraint``, ``cert`` ->
  ``SSL_CERT_FILE``, ``timeout`` / ``default-timeout`` -> ``UV_HTTP_TIMEOUT``;
- ``--index-strategy unsafe-best-match``: like pip, the best version across every index and find-links directory
  (uv's default takes a package from the first index that has it). A local CPU build of torch in ``find-links``
  (``torch-2.13.0+cpu``) is what ``torch==2.13.0`` resolves to there, as with pip.

With ``--torch-or-pip`` uv resolves first (``--dry-run``) and installs only when its plan holds no CUDA torch on a
machine without an NVIDIA GPU (:func:`torch_problem`); otherwise the same arguments go to pip, which installs what it
always did (a machine whose pip has no CPU build to offer gets PyPI's torch from pip, as before, never from uv).

Each install compiles the bytecode of the packages it installs (``--compile-bytecode``), as pip does by default and
uv does not: where ``PYTHONDONTWRITEBYTECODE`` is set no process writes it later, and every process (each CLI call,
stage, server, test worker) would compile torch, transformers and ModelOpt from source again (~5 s each).

uv's own output is kept short: its summary lines and the source distributions it built (``Built NAME==VERSION``),
not one line per download or installed package (its last 40 lines when uv fails). uv runs from the environment
(``python -m uv``: ``pip install uv`` put it there). Nothing but the standard library is imported: it runs before
the project is installed.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

# pip option -> uv flag (each value of a multi-valued option is passed with the flag)
FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
# credentials in a URL (``https://user:token@host/simple``): never printed (the rule of pipeline.bundle.redact, which
# cannot be imported before the project is installed)
_CREDENTIALS = re.compile(r"(//)[^/@\s]+@")
KEEP = re.compile(r"^(Resolved|Prepared|Installed|Uninstalled|Audited|\s*Built |Using|warning|error|  ×|  ╰|  │|"
                  r"  help|hint)")


def pip_config(python: str) -> dict[str, list[str]]:
    """pip's settings on this machine (``pip config list`` of ``python``: config files, then ``PIP_*`` variables,
    which win), keyed by option name; a value holding several entries (``a b`` or one per line) is split."""
    return parse_pip_config(subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True,
                                           text=True).stdout)


def parse_pip_config(out: str) -> dict[str, list[str]]:
    """:func:`pip_config` from ``pip config list``'s output (``global.find-links='/opt/wheels'``,
    ``:env:.find-links='/opt/wheels'``)."""
    files: dict[str, list[str]] = {}
    env: dict[str, list[str]] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        scope, _, name = key.rpartition(".")
        value = value.strip().strip("'\"")
        (env if scope.startswith(":env:") else files)[name] = value.split()
    return {**files, **env}


def uv_args(cfg: dict[str, list[str]]) -> tuple[list[str], dict[str, str]]:
    """(uv flags, environment variables) carrying pip's sources ``cfg`` (:func:`pip_config`)."""
    flags = ["--index-strategy", "unsafe-best-match"]
    env: dict[str, str] = {}
    for name, flag in FLAGS.items():
        for value in cfg.get(name, []):
            flags += [flag, value]
    if any(v.lower() in ("1", "true", "yes", "on") for v in cfg.get("no-index", [])):
        flags.append("--no-index")
    if cfg.get("cert"):
        env["SSL_CERT_FILE"] = cfg["cert"][0]
    timeout = (cfg.get("timeout") or cfg.get("default-timeout") or [None])[0]
    if timeout:
        env["UV_HTTP_TIMEOUT"] = str(int(float(timeout)))
    return flags, env


def torch_problem(report: str, gpu: bool) -> str | None:
    """Why a planned install (uv's ``--dry-run`` output) must not go ahead: on a machine without an NVIDIA GPU, a
    torch that is not a CPU build (a CUDA build, several GB with its ``nvidia-*`` wheels). None when it may."""
    if gpu:
        return None
    m = re.search(r"^\s*\+ torch==(\S+)", report, re.M)
    cuda = re.findall(r"^\s*\+ (nvidia-[a-z0-9-]+)==", report, re.M)
    if (m and "+cpu" not in m.group(1)) or cuda:
        what = f"torch {m.group(1)}" if m else "CUDA libraries"
        return (f"uv would install {what}{' with ' + ', '.join(cuda[:3]) if cuda else ''} on a machine without an "
                f"NVIDIA GPU: give pip the CPU build of torch (pip config set global.find-links DIR holding "
                f"torch-<version>+cpu, or an index that has it)")
    return None


def redact(text: str) -> str:
    """``text`` with the credentials of every URL in it replaced by ``***``."""
    return _CREDENTIALS.sub(r"\1***@", text)


def has_gpu() -> bool:
    return Path("/proc/driver/nvidia/gpus").is_dir() or Path("/dev/nvidia0").exists()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", required=True, help="the environment's interpreter")
    ap.add_argument("--uv", help="the interpreter whose uv runs (default: --python's)")
    ap.add_argument("--quiet", action="store_true", help="print uv's errors only")
    ap.add_argument("--torch-or-pip", action="store_true",
                    help="resolve first (--dry-run); a CUDA torch on a machine without an NVIDIA GPU: install with pip")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="uv pip install's arguments (after --)")
    a = ap.parse_args(argv)
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    flags, extra_env = uv_args(pip_config(a.python))
    env = {**os.environ, **extra_env}
    cmd = [a.uv or a.python, "-m", "uv", "pip", "install", "--python", a.python, "--compile-bytecode", *flags, *args]
    if a.torch_or_pip:
        dry = subprocess.run([*cmd, "--dry-run"], capture_output=True, text=True, env=env)
        if dry.returncode:
            sys.stderr.write(redact(dry.stderr))
            return dry.returncode
        problem = torch_problem(dry.stderr + dry.stdout, has_gpu())
        if problem:
            print(f"note: {problem.split(': give pip')[0]}; installing with pip instead", file=sys.stderr)
            return subprocess.run([a.python, "-m", "pip", "install", "-q", *args]).returncode
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        if not a.quiet and KEEP.match(line):
            sys.stdout.write(redact(line))
            sys.stdout.flush()
    rc = proc.wait()
    if rc:
        print(f"uv pip install failed (exit {rc}): {redact(shlex.join(cmd))}", file=sys.stderr)
        sys.stderr.write(redact("".join(tail)))
    return rc


if __name__ == "__main__":
    sys.exit(main())
