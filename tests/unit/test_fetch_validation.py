"""fetch refuses what would fail later, naming the file: a safetensors file whose size or header disagrees with
the format (8-byte header length, JSON header with each tensor's dtype, shape and data_offsets), a config or
tokenizer that does not parse; a sound checkpoint passes (negative control). A .gguf path without gguf:// gets the
form to use."""
from __future__ import annotations

import json
import struct

import pytest

from pipeline.errors import UserError
from pipeline.stages import fetch


@pytest.fixture()
def ckpt(tmp_path):
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({"w": torch.ones(16, 8, dtype=torch.bfloat16), "b": torch.zeros(8)}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(d / "tokenizer.json"))
    return d


def test_a_sound_checkpoint_passes(ckpt):
    assert fetch.safetensors_problem(ckpt / "model.safetensors") is None
    fetch.validate_checkpoint(ckpt, "src")


def test_a_truncated_safetensors_file_is_named(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(UserError) as e:
        fetch.validate_checkpoint(ckpt, str(ckpt))
    assert str(e.value).startswith(f"{ckpt}: model.safetensors is damaged: the header describes ")
    assert "(truncated)" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("damage, expected", [
    (lambda b: b + b"\0" * 4, "trailing bytes"),
    (lambda b: struct.pack("<Q", 1 << 40) + b[8:], "its header claims"),
    (lambda b: b[:8] + b"X" + b[9:], "its header does not parse"),
    (lambda b: b[:20], "its header"),
])
def test_a_damaged_safetensors_file_is_named(ckpt, damage, expected):
    f = ckpt / "model.safetensors"
    f.write_bytes(damage(f.read_bytes()))
    assert expected in (fetch.safetensors_problem(f) or "")


def test_a_tensor_whose_offsets_disagree_with_its_shape_is_named(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header["w"]["shape"] = [16, 9]
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(raw) == n
    f.write_bytes(data[:8] + raw + data[8 + n:])
    assert "tensor 'w' (BF16 [16, 9]) spans 256 bytes, not 288" == fetch.safetensors_problem(f)


def test_a_tokenizer_or_config_that_does_not_parse_is_named(ckpt):
    (ckpt / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(UserError, match=r"src: tokenizer.json does not load"):
        fetch.validate_checkpoint(ckpt, "src")
    (ckpt / "config.json").write_text("{")
    with pytest.raises(UserError, match=r"src: config.json is not valid JSON"):
        fetch.validate_checkpoint(ckpt, "src")


def test_plan_names_a_damaged_local_checkpoint_before_anything_runs(ckpt, tmp_path):
    from pipeline import hardware

    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1])
    problems = fetch.check(hardware.compose([f"model.source={ckpt}", f"paths.root={tmp_path / 'root'}"]))
    assert len(problems) == 1 and "model.safetensors is damaged" in problems[0]


def test_a_gguf_path_without_the_scheme_gets_the_form_to_use(tmp_path):
    from pipeline import hardware

    path = tmp_path / "m.gguf"
    problems = fetch.check(hardware.compose([f"model.source={path}"]))
    assert problems == [f"model.source={path}: a GGUF file is given as model.source=gguf://{path} (or "
                        f"gguf://PACKAGE/FILE.gguf for one a package ships)"]


def test_an_unwritable_root_is_one_line(tmp_path):
    import subprocess
    import sys

    from tests.conftest import cli_env

    proc = subprocess.run([sys.executable, "-m", "pipeline", "build", "model=tiny-qwen3",
                           "paths.root=/proc/pipeline-nowhere"], cwd=tmp_path, env=cli_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("error: paths.root=/proc/pipeline-nowhere: cannot write there "
                                                    "(No such file or directory); give a writable directory "
                                                    "(paths.root=DIR)")
