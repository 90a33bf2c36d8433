"""The Triton-layout registry covers the config's layouts and runtimes and agrees with NVIDIA's recorded interface:
every entry point has the request tensors the registry names (with upstream's data types) and the text output."""
from __future__ import annotations

import pytest

from pipeline import schema, upstream
from pipeline.stages import package
from pipeline.triton import layouts
from pipeline.triton.render import MODELS_DIR


def coverage_problems(registry: dict) -> list[str]:
    out = []
    want = {lay.value for lay in schema.Layout} - {"auto"}
    if set(registry) != want or set(registry) != set(upstream.LAYOUTS):
        out.append(f"layouts: registry {sorted(registry)}, schema {sorted(want)}, upstream {sorted(upstream.LAYOUTS)}")
    served = {r for lay in registry.values() for r in lay.models}
    if served != {r.value for r in schema.RuntimeName}:
        out.append(f"runtimes served: {sorted(served)}")
    for lay in registry.values():
        for runtime, templates in lay.models.items():
            for t in templates:
                if not (MODELS_DIR / t / "config.pbtxt.tmpl").is_file():
                    out.append(f"{lay.name}/{runtime}: no template {t}")
        for line in upstream.lines():
            if lay.name not in upstream.record(line)["layouts"]:
                continue  # main ships only the llmapi layout
            iface = upstream.interface(line, lay.name)
            for entry in lay.entry_points:
                if entry not in iface:
                    out.append(f"{line} {lay.name}: no entry point {entry}")
                    continue
                ins = {t["name"] for t in iface[entry]["inputs"]}
                outs = {t["name"] for t in iface[entry]["outputs"]}
                for name in (*lay.text_tensors, lay.exclude_input, *lay.sampling.values()):
                    if name not in ins:
                        out.append(f"{line} {lay.name}/{entry}: upstream has no input {name}")
                if lay.output not in outs:
                    out.append(f"{line} {lay.name}/{entry}: upstream has no output {lay.output}")
    return out


def test_registry_covers_schema_runtimes_and_upstream():
    assert coverage_problems(layouts.LAYOUTS) == []


def test_planted_wrong_registry_fails():
    ifb = layouts.LAYOUTS[layouts.IFB]
    import dataclasses

    wrong_tensor = {**layouts.LAYOUTS, layouts.IFB: dataclasses.replace(ifb, max_tokens="max_new_tokens")}
    assert any("no input max_new_tokens" in p for p in coverage_problems(wrong_tensor))
    missing = {k: v for k, v in layouts.LAYOUTS.items() if k != layouts.LLMAPI}
    assert any(p.startswith("layouts:") for p in coverage_problems(missing))
    assert any(p.startswith("runtimes served") for p in coverage_problems(missing))


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
    assert package.MODELS[("trtllm_llmapi", layouts.LLMAPI)] == ("tensorrt_llm.llmapi",)
    assert layouts.default_for("trtllm_llmapi") == layouts.LLMAPI
    assert layouts.default_for("reference") == layouts.default_for("trtllm_engine") == layouts.IFB
    assert set(layouts.REFERENCE_TEMPLATES) == {"tensorrt_llm.reference", "tensorrt_llm.llmapi_reference"}
    with pytest.raises(Exception, match="unknown Triton layout"):
        layouts.get("disaggregated")
