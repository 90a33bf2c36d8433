"""Adding a layout is one folder: a copy of the project with only ``pipeline/triton/layouts/toy/`` added (the folder
in ``tests/e2e/toy_layout/``: one python model serving the reference runtime behind tensors of its own, with its own
interface file) composes ``serve.layout=toy``, packages and lints it, serves it on a real Triton server and answers
OpenAI's SDK through the toy's codec; a defect planted in the folder is refused with a message naming it."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, run_cli
from tests.helpers.serving import Serve

# a copy of the project building, packaging and serving through its new layout (~22 s on 2 cores)
pytestmark = [pytest.mark.e2e, pytest.mark.slow]
TOY = Path(__file__).resolve().parent / "toy_layout"
BUILD = ["model=tiny-qwen3", "quant=none", "quant.kv_cache=none", "serve.layout=toy"]
PROMPT = "The capital of France is"


def _project(dest: Path) -> Path:
    """The project's code and config copied to ``dest`` (no caches), with the toy layout's folder added."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("pipeline", "conf", "hydra_plugins"):
        shutil.copytree(REPO / part, dest / part, ignore=skip)
    shutil.copy2(REPO / "pyproject.toml", dest / "pyproject.toml")
    shutil.copytree(TOY, dest / "pipeline" / "triton" / "layouts" / "toy", ignore=skip)
    return dest


def _env(project: Path, root: Path) -> dict[str, str]:
    return cli_env(root, PYTHONPATH=str(project))


def _plant(project: Path, rel: str, old: str | None, new: str | None = None) -> None:
    """The toy folder fresh from the test's copy, then one defect: ``rel`` removed (``old`` None) or ``old`` -> ``new``
    in it."""
    folder = project / "pipeline" / "triton" / "layouts" / "toy"
    shutil.rmtree(folder)
    shutil.copytree(TOY, folder, ignore=shutil.ignore_patterns("__pycache__"))
    path = folder / rel
    if old is None:
        path.unlink()
        return
    text = path.read_text()
    assert old in text, (rel, old)
    path.write_text(text.replace(old, new))


def _reference_greedy(checkpoint: Path, prompt: str, n: int) -> str:
    """The reference runtime's own greedy text for ``prompt`` (a lone request: what the toy's model must return)."""
    from transformers import AutoTokenizer

    from pipeline.runtime import reference

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    model = reference.load(checkpoint, dtype=reference.compute_dtype("auto", "cpu"))  # as served
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) - {None}
    ids = [t for t in reference.generate(model, tok(prompt)["input_ids"], n, eos) if t not in eos]
    return tok.decode(ids, skip_special_tokens=True)


def test_a_layout_added_as_one_folder_is_packaged_served_and_refused_when_broken(tmp_path):
    project = _project(tmp_path / "project")
    root = tmp_path / "out"
    env = _env(project, root)

    # the copy's own code: the layout is known there, and nowhere else
    built = run_cli("build", *BUILD, "until=package", root=root, env=env)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
    repo = next(root.glob("triton_repo/*-package-*/manifest.json")).parent
    cfg = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert 'name: "prompt"' in cfg and 'name: "completion"' in cfg
    assert {p.name for p in (repo / "tensorrt_llm" / "1").iterdir()} >= {
        "model.py", "reference_runtime.py", "reference_decode_engine.py", "reference_common.py"}
    assert not (repo / "LINT.txt").exists()
    refused = run_cli("build", *BUILD, "until=package", root=tmp_path / "plain")  # the project without the folder
    assert refused.returncode == 2 and "toy" in refused.stderr, refused.stderr[-2000:]

    import openai

    with Serve(repo, "serve.openai.port=0", "serve.openai.model_name=toy-model", f"paths.root={root}", cwd=root,
               env=env) as s:
        try:
            assert any(line.startswith(f"serving {repo} (toy layout; entry points: tensorrt_llm)") for line in s.lines)
            c = openai.OpenAI(base_url=s.url, api_key="none", max_retries=0, timeout=120)
            assert c.models.retrieve("toy-model").model_extra["metadata"]["layout"] == "toy"
            comp = c.completions.create(model="toy-model", prompt=PROMPT, max_tokens=6, temperature=0)
            want = _reference_greedy(repo / "tensorrt_llm" / "1" / "engine", PROMPT, 6)
            assert comp.choices[0].text == want and comp.choices[0].finish_reason in ("stop", "length")
            msgs = [{"role": "user", "content": "Name a colour."}]
            chunks = list(c.chat.completions.create(model="toy-model", messages=msgs, max_tokens=6, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
            streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            whole = c.chat.completions.create(model="toy-model", messages=msgs, max_tokens=6, temperature=0)
            assert streamed == whole.choices[0].message.content and len(chunks) >= 3
            assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 0
            # what the toy's codec cannot send is refused by name
            with pytest.raises(openai.BadRequestError, match="top_p is not supported by the toy layout"):
                c.completions.create(model="toy-model", prompt=PROMPT, max_tokens=2, top_p=0.5)
        finally:
            assert s.stop() == 0

    # negative controls, each a defect planted in the toy folder alone: refused before anything is served
    plants = [
        ("models/tensorrt_llm.toy/config.pbtxt.tmpl", None, None, "plan",
         "models/tensorrt_llm.toy/config.pbtxt.tmpl is missing"),
        ("__init__.py", 'text_input="prompt"', 'text_input="prompt_text"', "plan",
         "its interface (interface.yaml) has no input prompt_text"),
        ("models/tensorrt_llm.toy/config.pbtxt.tmpl", '{ name: "prompt" ', '{ name: "prompt_text" ', "build",
         'the toy layout input "prompt" is missing'),
    ]
    for rel, old, new, verb, words in plants:
        _plant(project, rel, old, new)
        args = ("plan", *BUILD) if verb == "plan" else ("build", *BUILD, "until=package")
        proc = run_cli(*args, root=root, env=env)
        assert proc.returncode != 0 and words in proc.stdout + proc.stderr, (rel, proc.stdout[-2000:],
                                                                             proc.stderr[-2000:])
