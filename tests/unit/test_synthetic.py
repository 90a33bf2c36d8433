"""Synthetic weights: seeded, identical whatever the chunking (and device: tests/gpu/test_gpu.py compares CPU and CUDA).
Negative controls: another seed or tensor name gives other values (tests/e2e/test_synthetic.py: the checkpoint)."""
from __future__ import annotations

import torch

from pipeline import synthetic


def test_values_do_not_depend_on_the_chunk_size():
    key = synthetic.tensor_key(0, "w")
    whole = synthetic.noise(key, (300, 77), 0.25, torch.bfloat16, "cpu")
    for chunk in (1, 97, 4096):
        assert torch.equal(whole, synthetic.noise(key, (300, 77), 0.25, torch.bfloat16, "cpu", chunk=chunk))


def test_seed_and_name_change_the_values_and_the_spread_is_the_configured_one():
    a = synthetic.noise(synthetic.tensor_key(0, "w"), (20000,), 0.02, torch.float32, "cpu")
    assert not torch.equal(a, synthetic.noise(synthetic.tensor_key(1, "w"), (20000,), 0.02, torch.float32, "cpu"))
    assert not torch.equal(a, synthetic.noise(synthetic.tensor_key(0, "v"), (20000,), 0.02, torch.float32, "cpu"))
    assert abs(a.std().item() - 0.02) < 0.001 and abs(a.mean().item()) < 0.001
    assert a.abs().max().item() <= 0.02 * synthetic.IRWIN_HALL_MEAN / synthetic.IRWIN_HALL_STD + 1e-6  # bounded


def test_known_values_pin_the_generator():
    """Bits recorded once: a change to the generator (which would change every synthetic model) fails here."""
    v = synthetic.noise(synthetic.tensor_key(0, "model.embed_tokens.weight"), (6,), 1.0, torch.float32, "cpu")
    assert synthetic.tensor_key(0, "model.embed_tokens.weight") == KEY0
    assert [round(x, 6) for x in v.tolist()] == VALUES0


KEY0 = 2045469590490294478
VALUES0 = [-1.142948, -0.465705, -0.098395, 0.792473, -0.057827, -0.724207]
