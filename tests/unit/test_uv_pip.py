"""`make setup`'s installs with uv (tools/uv_pip.py): pip's package sources on this machine handed to uv, and uv's
plan for torch checked before it installs anything (a CUDA torch on a machine without a GPU goes to pip, as
before), each with its negative control."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("uv_pip", REPO / "tools" / "uv_pip.py")
uv_pip = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(uv_pip)

PIP_CONFIG = """:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/elsewhere'
"""

CPU_PLAN = """Resolved 11 packages in 252ms
Would install 10 packages
 + networkx==3.6.1
 + sympy==1.14.0
 + torch==2.13.0+cpu
"""
CUDA_PLAN = """Resolved 30 packages in 1.1s
Would install 29 packages
 + nvidia-cublas==13.1.1.3
 + nvidia-cudnn-cu13==9.20.0.48
 + torch==2.13.0
 + triton==3.7.1
"""


def test_pips_sources_reach_uv_as_pip_would_use_them():
    cfg = uv_pip.parse_pip_config(PIP_CONFIG)
    assert cfg["find-links"] == ["/opt/wheels"]  # PIP_FIND_LINKS wins over the config file, as in pip
    flags, env = uv_pip.uv_args(cfg)
    assert flags == ["--index-strategy", "unsafe-best-match", "--extra-index-url", "file:///opt/pypi/simple",
                     "--extra-index-url", "file:///opt/pypi-more/simple",
                     "--find-links", "/opt/wheels", "--constraint", "/etc/xdg/pip/constraints.txt"]
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt", "UV_HTTP_TIMEOUT": "180"}
    # a machine whose pip has no configuration: uv's defaults (PyPI), best match across indexes as pip
    assert uv_pip.uv_args(uv_pip.parse_pip_config("")) == (["--index-strategy", "unsafe-best-match"], {})
    # negative control: without the find-links entry, uv would not see the local CPU build of torch
    assert "/opt/wheels" not in uv_pip.uv_args(uv_pip.parse_pip_config(PIP_CONFIG.replace(
        ":env:.find-links='/opt/wheels'\n", "")))[0]


def test_a_cuda_torch_in_uvs_plan_is_refused_on_a_machine_without_a_gpu():
    assert uv_pip.torch_problem(CPU_PLAN, gpu=False) is None
    problem = uv_pip.torch_problem(CUDA_PLAN, gpu=False)  # the negative control: what uv plans without find-links
    assert problem is not None and problem.startswith("uv would install torch 2.13.0 with nvidia-cublas")
    assert uv_pip.torch_problem(CUDA_PLAN, gpu=True) is None  # a GPU machine wants the CUDA build


def test_the_makefile_installs_through_uv_with_the_torch_check_and_the_constraints():
    text = (REPO / "Makefile").read_text()
    recipe = text[text.index("$(STAMP): pyproject.toml"):text.index("# The test extra")]
    assert "$(PY) -m pip install -q uv" in recipe
    assert re.search(r"\$\(UV_PIP\) --torch-or-pip -- .*torch==\$\(TORCH_VERSION\)", recipe)
    assert "$(UV_PIP) -- -c $(CONSTRAINTS) --excludes $(EXCLUDES) -e '.[cpu-server]'" in recipe
    assert "$(UV_PIP) -- -c $(CONSTRAINTS) --excludes $(EXCLUDES) -e '.[test,cpu-server]'" in text
    assert "pytablewriter>=1.2" in (REPO / "tools" / "constraints.txt").read_text()
    # xgrammar's triton (its GPU kernels' compiler) is left out of CPU installs
    excluded = [x for x in (REPO / "tools" / "excludes.txt").read_text().splitlines() if x and not x.startswith("#")]
    assert excluded == ["triton"] and "EXCLUDES := tools/excludes.txt" in text


def test_uvs_output_keeps_its_summary_and_the_sources_it_built_and_fresh_install_reads_them(tmp_path):
    out = ("Resolved 1 package in 1.05s\n   Building word2number==1.1\n      Built word2number==1.1\n"
           "Prepared 1 package in 833ms\nInstalled 1 package in 0.40ms\n + word2number==1.1\n")
    kept = [ln for ln in out.splitlines(keepends=True) if uv_pip.KEEP.match(ln)]
    assert kept == ["Resolved 1 package in 1.05s\n", "      Built word2number==1.1\n",
                    "Prepared 1 package in 833ms\n", "Installed 1 package in 0.40ms\n"]
    from benchmarks import fresh_install as fresh
    log = tmp_path / "make-build.log"
    log.write_text("".join(kept) + "      Built llm-pipeline @ file:///x\n")
    assert fresh.built_from_source(tmp_path / "no-pip.log", log) == ["word2number"]  # the project itself is not
    log.write_text(out.replace("Built", "Checked"))  # negative control: nothing built, nothing named
    assert fresh.built_from_source(tmp_path / "no-pip.log", log) == []


def test_a_failed_install_names_its_command_without_the_index_credentials(tmp_path, capsys):
    """pip's index URL with a token in it (``https://user:token@host/simple``) reaches uv, and a failure prints the
    command and uv's last lines with the token replaced; the planted token is the control."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n"
                      "if [ \"$2\" = pip ]; then echo \"global.index-url='https://me:s3cret-token@pkgs.example/simple'\"; "
                      "exit 0; fi\n"
                      "echo \"error: Failed to fetch https://me:s3cret-token@pkgs.example/simple/torch/\"; exit 1\n")
    python.chmod(0o755)
    assert uv_pip.main(["--python", str(python), "--", "torch==2.13.0"]) == 1
    err = capsys.readouterr().err
    assert "--index-url https://***@pkgs.example/simple" in err
    assert "Failed to fetch https://***@pkgs.example/simple/torch/" in err
    assert "s3cret-token" not in err
    assert uv_pip.redact("https://me:s3cret-token@pkgs.example/simple") == "https://***@pkgs.example/simple"


def _wheel(where: Path, name: str = "tinypkg") -> Path:
    """A minimal pure-Python wheel: one module, its dist-info (METADATA, WHEEL, RECORD)."""
    import zipfile

    path = where / f"{name}-1.0-py3-none-any.whl"
    files = {f"{name}/__init__.py": "VALUE = 1\n",
             f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{name}-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{name}-1.0.dist-info/RECORD"] = "".join(f"{k},,\n" for k in [*files, f"{name}-1.0.dist-info/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return path


def test_an_install_compiles_the_bytecode_of_what_it_installs(tmp_path):
    """Where PYTHONDONTWRITEBYTECODE is set (as on the CI machines), no process writes bytecode later: the tool's
    install writes it, as pip's does by default. Negative control: uv's own install, without the flag, writes none."""
    import os
    import subprocess
    import sys

    wheel = _wheel(tmp_path)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "UV_CACHE_DIR": str(tmp_path / "uv-cache")}
    for venv, ours in ((tmp_path / "ours", True), (tmp_path / "plain", False)):
        subprocess.run([sys.executable, "-m", "uv", "venv", "-q", "--python", sys.executable, str(venv)], check=True,
                       env=env)
        py = str(venv / "bin" / "python")
        cmd = ([sys.executable, str(REPO / "tools" / "uv_pip.py"), "--python", py, "--uv", sys.executable, "--quiet",
                "--", "--no-index", str(wheel)] if ours else
               [sys.executable, "-m", "uv", "pip", "install", "-q", "--python", py, "--no-index", str(wheel)])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        [site] = list((venv / "lib").glob("python3*/site-packages"))
        assert (site / "tinypkg" / "__init__.py").is_file()
        assert bool(list((site / "tinypkg").glob("__pycache__/__init__.*.pyc"))) is ours, ours
