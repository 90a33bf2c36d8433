"""The Triton-layout registry covers the config's layouts and runtimes and agrees with NVIDIA's recorded interface:
every layout folder holds what its record names (templates, python models, its part modules), and every entry point
has the request tensors the record names (with upstream's data types) and the text output."""
from __future__ import annotations

import dataclasses

import pytest

from pipeline import schema, upstream
from pipeline.triton import layouts, repository


def coverage_problems(registry: dict) -> list[str]:
    out = []
    want = {lay.value for lay in schema.Layout} - {"auto"}
    nvidia = {name for name, lay in registry.items() if lay.upstream}
    if set(registry) != want or nvidia != set(upstream.LAYOUTS):
        out.append(f"layouts: registry {sorted(registry)}, schema {sorted(want)}, upstream {sorted(upstream.LAYOUTS)}")
    served = {r for lay in registry.values() for r in lay.models}
    if served != {r.value for r in schema.RuntimeName}:
        out.append(f"runtimes served: {sorted(served)}")
    for lay in registry.values():
        out += lay.problems()  # its templates, python models and part modules; its tensors in its interface
    return out


def test_registry_covers_schema_runtimes_and_upstream():
    assert coverage_problems(layouts.LAYOUTS) == []
    assert layouts.problems() == []
    assert list(layouts.LAYOUTS) == sorted(layouts.LAYOUTS)  # the folders' order, on every machine
    assert layouts.entry_point_names() == ("ensemble", "tensorrt_llm_bls", "tensorrt_llm")
    # the catalog (the bottom floor's view: folders alone) and the registry (the records) list the same layouts
    from pipeline import catalog

    assert catalog.layout_names() == tuple(layouts.LAYOUTS) == tuple(lay.value for lay in schema.Layout)[1:]


def test_planted_wrong_registry_fails(tmp_path):
    ifb = layouts.LAYOUTS[layouts.IFB]
    wrong_tensor = {**layouts.LAYOUTS, layouts.IFB: dataclasses.replace(ifb, max_tokens="max_new_tokens")}
    assert any("no input max_new_tokens" in p for p in coverage_problems(wrong_tensor))
    missing = {k: v for k, v in layouts.LAYOUTS.items() if k != layouts.LLMAPI}
    assert any(p.startswith("layouts:") for p in coverage_problems(missing))
    assert any(p.startswith("runtimes served") for p in coverage_problems(missing))
    # a template the record names that its folder lacks, and a part module it lacks
    no_template = dataclasses.replace(ifb, models={**ifb.models, "reference": (*ifb.models["reference"], "ghost")})
    assert any("models/ghost/config.pbtxt.tmpl is missing" in p for p in no_template.problems())
    (tmp_path / "models").mkdir()
    assert any("codec.py is missing" in p for p in dataclasses.replace(ifb, folder=tmp_path).problems())


@pytest.mark.parametrize("name", sorted(layouts.LAYOUTS))
def test_front_end_api(name):
    lay = layouts.get(name)
    types = lay.input_types()
    assert types[lay.text_input] == "TYPE_STRING" and types[lay.max_tokens] == "TYPE_INT32"
    assert types[lay.stream] == "TYPE_BOOL" and types[lay.exclude_input] == "TYPE_BOOL"
    assert types[lay.sampling["temperature"]] == "TYPE_FP32"
    assert lay.entry_points[0] in lay.templates(lay.runtimes[0])[0] or lay.entry_points[0] in {
        t.split(".")[0] for t in lay.templates(lay.runtimes[0])}


def test_package_reads_the_registry():
    assert repository.MODELS[("trtllm_llmapi", layouts.LLMAPI)] == ("tensorrt_llm.llmapi",)
    assert layouts.default_for("trtllm_llmapi") == layouts.LLMAPI
    assert layouts.default_for("reference") == layouts.default_for("trtllm_engine") == layouts.IFB
    assert set(layouts.REFERENCE_TEMPLATES) == {"tensorrt_llm.reference", "tensorrt_llm.llmapi_reference"}
    with pytest.raises(Exception, match="unknown Triton layout"):
        layouts.get("disaggregated")


def test_each_layout_detects_its_own_repositories(tmp_path):
    """``of_repository`` asks each layout's ``detect``: a ``tensorrt_llm`` with a ``1/model.yaml`` is ``llmapi``,
    preprocessing and the rest are ``inflight_batcher_llm``, and a repository no layout claims falls back to
    ``inflight_batcher_llm`` (lint then names the models it lacks)."""
    llm = tmp_path / "tensorrt_llm"
    (llm / "1").mkdir(parents=True)
    pre = tmp_path / "preprocessing"
    assert layouts.of_repository({"tensorrt_llm": llm, "preprocessing": pre}) == layouts.IFB
    (llm / "1" / "model.yaml").write_text("model: x\n")
    assert layouts.of_repository({"tensorrt_llm": llm}) == layouts.LLMAPI
    assert layouts.of_repository({"tensorrt_llm": llm, "preprocessing": pre}) == layouts.LLMAPI
    assert layouts.of_repository({"other": tmp_path / "other"}) == layouts.IFB
    # two layouts that claim one repository are refused
    both = {**layouts.LAYOUTS, "x": dataclasses.replace(layouts.LAYOUTS[layouts.LLMAPI], name="x")}
    import unittest.mock as um

    with um.patch.dict(layouts.LAYOUTS, both), pytest.raises(Exception, match="fit the layouts"):
        layouts.of_repository({"tensorrt_llm": llm})
