"""``python -m pipeline render DIR``: the files a bundle will carry, without a GPU or TensorRT-LLM. Held to what the
package stage really wrote for the shared tiny build (every file of its repository outside the build output, byte for
byte), to ``lint`` (the rendered GPU repositories pass; the same repository without ``--no-engine`` is refused for
the missing engine, the negative control), and to the serving plan it came from."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import TINY, run_cli

pytestmark = pytest.mark.e2e

ENGINE_REL = "tensorrt_llm/1/engine"


def _files(repo: Path) -> dict[str, bytes]:
    return {p.relative_to(repo).as_posix(): p.read_bytes() for p in sorted(repo.rglob("*"))
            if p.is_file() and not p.relative_to(repo).as_posix().startswith(ENGINE_REL + "/")}


def test_render_writes_what_the_package_stage_wrote(tiny_build, tmp_path):
    packaged = next((tiny_build / "triton_repo").glob("tiny-qwen3.fp8-kvfp8.cpu.reference-package-*"))
    proc = run_cli("render", str(tmp_path / "r"), *TINY, root=tiny_build)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rendered = _files(tmp_path / "r" / "triton_repo")
    ours = _files(packaged)
    ours.pop("manifest.json", None)  # the stage's record of its output, not a file of the repository
    # made from the build's tokenizer at package time: the one file a repository rendered before its build lacks
    assert ours.pop("tensorrt_llm/1/xgrammar_tokenizer_info.json")
    assert rendered.keys() == ours.keys() and rendered == ours
    plan = json.loads((tmp_path / "r" / "serving_plan.json").read_text())
    built = json.loads(next((tiny_build / "engines").glob("tiny-qwen3.fp8-kvfp8.cpu.reference-build-*"))
                       .joinpath("build.json").read_text())
    assert {k: built["build_settings"][k] for k in plan["settings"]} == plan["settings"]
    # negative control: another serving setting renders another preprocessing config
    proc = run_cli("render", str(tmp_path / "r2"), *TINY, "serve.preprocessing_instance_count=2", root=tiny_build)
    assert proc.returncode == 0, proc.stderr[-2000:]
    other = _files(tmp_path / "r2" / "triton_repo")
    assert other["preprocessing/config.pbtxt"] != ours["preprocessing/config.pbtxt"]
    # an existing directory is refused, in one line, and left as it was
    proc = run_cli("render", str(tmp_path / "r"), *TINY, root=tiny_build)
    assert proc.returncode == 2 and "exists; give a new directory" in proc.stderr
    assert _files(tmp_path / "r" / "triton_repo") == rendered


def test_render_writes_a_gpu_bundles_configs_on_this_cpu_machine(tmp_path):
    llmapi, engine = tmp_path / "llmapi", tmp_path / "engine"
    proc = run_cli("render", str(llmapi), "model=qwen32b", "quant=fp8", "target=h200", "runtime=trtllm_llmapi",
                   root=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    model_yaml = yaml.safe_load((llmapi / "triton_repo" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    options = json.loads((llmapi / "llmapi.json").read_text())
    plan = json.loads((llmapi / "serving_plan.json").read_text())
    assert model_yaml["max_seq_len"] == options["max_seq_len"] == plan["settings"]["max_seq_len"] == 40960
    assert model_yaml["max_batch_size"] == plan["settings"]["max_batch_size"] >= 32
    assert model_yaml["enable_chunked_prefill"] is True and model_yaml["model"] == "/models/" + ENGINE_REL
    assert plan["predictions"]["ctx_tokens"] == model_yaml["max_num_tokens"]
    proc = run_cli("render", str(engine), "model=qwen32b", "quant=fp8", "target=h100", "runtime=trtllm_engine",
                   "runtime.trtllm_version=1.2.1", root=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    script = (engine / "trtllm-build.sh").read_text()
    settings = json.loads((engine / "serving_plan.json").read_text())["settings"]
    assert f"--max_seq_len {settings['max_seq_len']}" in script and '--checkpoint_dir "$CHECKPOINT_DIR"' in script
    assert "--use_fp8_context_fmha enable" in script
    for repo, version in ((llmapi, []), (engine, ["--trtllm-version", "1.2.1"])):
        ok = run_cli("lint", str(repo / "triton_repo"), "--no-engine", *version, root=tmp_path)
        assert ok.returncode == 0 and "ok:" in ok.stdout, ok.stderr[-1000:]
    # negative control: the engine directory is the build's, and without --no-engine lint looks for it
    bad = run_cli("lint", str(engine / "triton_repo"), "--trtllm-version", "1.2.1", root=tmp_path)
    assert bad.returncode == 2 and "gpt_model_path /models/tensorrt_llm/1/engine does not exist" in bad.stderr
