"""The shipped ModelOpt PTQ recipes whose calibration has no CPU kernel (``recipes.CUDA_ONLY``: gptq, mse), run for
real on CUDA and held to plan's derivation.

``tests/e2e/test_recipes_modelopt.py`` runs every shipped ``general/ptq/`` recipe through ModelOpt's own flow on a CPU
(``mtq.quantize`` with calibration, then ``export_hf_checkpoint``) and compares the written ``hf_quant_config.json``
/ ``config.json`` / safetensors with ``recipes.derive(...)``; the CUDA_ONLY ones can only fail there. Here the same
helpers (imported from that file: ``_export``, ``_derived``, ``derivation_disagreements``,
``mapping_disagreements``) run them on the same one-layer stand-in, moved to the GPU, and the same comparisons
apply. Runs unchanged on any CUDA machine with SM >= 8.9 (ModelOpt's NVFP4 Triton kernels, which both calibrations
run); skipped, with the reason, elsewhere. A few seconds per recipe.

    pytest -m gpu tests/gpu/test_recipes_gpu.py
"""
from __future__ import annotations

import json

import pytest

from pipeline.quant import recipes
from tests.helpers.requires import requires_sm
from tests.e2e.test_recipes_modelopt import SHIPPED, _derived, _export, derivation_disagreements, mapping_disagreements

pytestmark = requires_sm(89, "ModelOpt's NVFP4 Triton kernels, which gptq and mse calibration run").marks

CUDA_RECIPES = [n for n in SHIPPED if recipes.algorithm(recipes.PREFIX + n) in recipes.CUDA_ONLY]


def _export_on_cuda(name: str, model_type: str, monkeypatch) -> tuple[dict | Exception, object, list[str]]:
    """The unit test's ``_export`` (same stand-in, same two calibration rows, same reading of the export) with the
    stand-in on CUDA: ``recipes.probe_model`` is wrapped to move the model there, and a forward pre-hook puts the
    calibration rows on its device. Returns the export (or ModelOpt's exception), the model that was calibrated and
    the device of its weights at each forward pass of the calibration loop."""
    import torch

    made, seen = [], []
    build = recipes.probe_model

    def to_device(m, args):
        dev = next(m.parameters()).device
        seen.append(dev.type)
        return tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args)

    def on_cuda(mt: str):
        model = build(mt).to("cuda")
        model.register_forward_pre_hook(to_device)
        made.append(model)
        return model

    monkeypatch.setattr(recipes, "probe_model", on_cuda)
    got = _export(name, model_type)
    assert len(made) == 1, "the unit test's _export no longer builds its stand-in with recipes.probe_model"
    return got, made[0], seen


def test_every_cuda_only_calibration_has_a_shipped_recipe_here():
    found = {recipes.algorithm(recipes.PREFIX + n) for n in CUDA_RECIPES}
    assert found == set(recipes.CUDA_ONLY), (found, CUDA_RECIPES)


@pytest.mark.parametrize("name", CUDA_RECIPES)
def test_cuda_only_recipe_exports_what_plan_derives(name, monkeypatch):
    import torch

    d = _derived(name)  # derived on the CPU, as plan does; an experts_only recipe on the MoE stand-in
    assert d.algorithm in recipes.CUDA_ONLY
    got, model, seen = _export_on_cuda(name, d.probe, monkeypatch)
    assert not isinstance(got, Exception), f"{name} ({d.algorithm}) fails in ModelOpt on CUDA: {got!r}"
    print(json.dumps({"recipe": name, "gpu": torch.cuda.get_device_name(0), "algorithm": d.algorithm,
                      "exported": got, "derived": d.to_json()}))
    assert derivation_disagreements(d, got) == []
    assert mapping_disagreements(recipes.to_formats(d), got) == []
    # the calibration did run on the GPU: every forward pass of its loop saw the weights there, and they stayed.
    # (Not read from the quantizers' amax: after export_hf_checkpoint a fused MoE experts module, transformers 5's
    # Qwen3MoeExperts, keeps no enabled quantizer with an amax, as seen on an H100.)
    assert seen and set(seen) == {"cuda"}, seen
    assert all(p.device.type == "cuda" for p in model.parameters())
