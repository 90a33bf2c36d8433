"""Every `python -m pipeline plan ...` line of the README and of the usage page it links (docs/usage.md) plans as
written. The lines are read from those files when the test runs, so an
example added or changed there is checked as it stands. Placeholders a reader replaces are replaced here: usage
brackets (`[--json]`, `[overrides...]`) are dropped, a `model.source=` path, Hub repository or GGUF file becomes a
small local checkpoint of the right kind of shape, and a Slurm launcher is left out (it would submit jobs)."""
from __future__ import annotations

import json
import re
import shlex

import pytest

from tests.conftest import REPO

# hidden and intermediate sizes that the AWQ block size (128) divides, so int4_awq examples plan on it
CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128, "intermediate_size": 384,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "vocab_size": 300, "tie_word_embeddings": False, "max_position_embeddings": 4096}


DOCS = ("README.md", "docs/usage.md")


def readme_lines() -> list[str]:
    out = []
    for line in [x for doc in DOCS for x in (REPO / doc).read_text().splitlines()]:
        m = re.match(r"\s+python -m pipeline (plan)\s(.*)", line)
        if m:
            out.append(f"{m.group(1)} {m.group(2).split('#', 1)[0].strip()}".strip())
    return out


def as_plan(line: str, ckpt) -> list[str] | None:
    verb, *args = shlex.split(line)
    out = ["plan"]
    for a in args:
        if a.startswith("[") or a.startswith("hydra/launcher=") or a == "--json":
            continue
        if a.startswith("model.source="):
            a = f"model.source={ckpt}"
        if "<" in a:
            return None  # a placeholder the reader fills in that no local stand-in replaces
        out.append(a)
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    import torch
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("readme") / "my-finetune"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(d / "tokenizer.json"))
    save_file({"w": torch.zeros(4, 4)}, str(d / "model.safetensors"))
    return d


def _plan(argv: list[str], root, capsys) -> tuple[int, str]:
    from pipeline import cli

    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, f"paths.root={root}"])
        raise SystemExit(0)
    err = capsys.readouterr().err
    return exc.value.code or 0, err


def test_the_readme_has_plan_examples():
    lines = readme_lines()
    assert len(lines) >= 2, lines


@pytest.mark.parametrize("line", readme_lines())
def test_a_readme_example_plans_as_written(line, ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = as_plan(line, ckpt)
    if argv is None:
        pytest.skip(f"placeholder in {line!r}")
    code, err = _plan(argv, tmp_path, capsys)
    assert code == 0, f"{line}: {err}"


def test_a_refused_example_would_be_seen(ckpt, tmp_path, capsys, monkeypatch):
    """Negative control: an example the rules refuse (FP8 KV cache with a format without FP8 context FMHA, on a
    TensorRT engine) fails this check with its one-line reason."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = as_plan(f"build model.source=/data/x quant=int4_awq target=h100 runtime=trtllm_engine [overrides...]", ckpt)
    code, err = _plan(argv, tmp_path, capsys)
    assert code == 2 and "paged context FMHA" in err, err
