"""The comparison of the recorded upstream interface with an upstream checkout (``python -m pipeline.upstream
verify --checkout``, ``pipeline.upstream.refresh``): one planted difference at a time, in every field it compares,
must be named; an identical model gives nothing. A small record and checkout written here stand in for NVIDIA's."""
from __future__ import annotations

import copy

import pytest

from pipeline.errors import UserError
from pipeline.upstream import refresh

MODEL = {
    "name": "m", "backend": "python", "max_batch_size": 8, "decoupled": True,
    "instance_group": {"count": 1, "kind": "KIND_CPU"}, "dynamic_batching": {"max_queue_delay_microseconds": 0},
    "inputs": [{"name": "a", "data_type": "TYPE_INT32", "dims": [1], "optional": True, "allow_ragged_batch": True},
               {"name": "b", "data_type": "TYPE_STRING", "dims": [-1], "reshape": []}],
    "outputs": [{"name": "o", "data_type": "TYPE_FP32", "dims": [-1]}],
    "parameters": {"p": "${p}"},
}
ENSEMBLE = {"name": "e", "platform": "ensemble", "max_batch_size": 8, "inputs": [], "outputs": [], "parameters": {},
            "steps": [{"model_name": "m", "input_map": {"a": "x"}, "output_map": {"o": "y"}},
                      {"model_name": "n", "input_map": {"c": "y"}, "output_map": {"d": "z"}}]}


def _diff(recorded, change) -> list[str]:
    found = copy.deepcopy(recorded)
    change(found)
    return refresh.diff_model("L/m", recorded, found)


def test_an_identical_model_has_no_difference():
    assert refresh.diff_model("L/m", MODEL, copy.deepcopy(MODEL)) == []
    assert refresh.diff_model("L/e", ENSEMBLE, copy.deepcopy(ENSEMBLE)) == []


def _set(kind, i, key, value):
    def change(m):
        if value is None:
            m[kind][i].pop(key)
        else:
            m[kind][i][key] = value
    return change


@pytest.mark.parametrize("change, expected", [
    (lambda m: m["inputs"].append({"name": "c", "data_type": "TYPE_BOOL", "dims": [1]}),
     "L/m: upstream input 'c' is not recorded"),
    (lambda m: m["outputs"].pop(), "L/m: recorded output 'o' is not upstream"),
    (_set("inputs", 0, "data_type", "TYPE_INT64"), "L/m: input 'a' data_type recorded 'TYPE_INT32', upstream 'TYPE_INT64'"),
    (_set("inputs", 0, "dims", [2]), "L/m: input 'a' dims recorded [1], upstream [2]"),
    (_set("inputs", 0, "optional", None), "L/m: input 'a' optional recorded True, upstream False"),
    (_set("inputs", 0, "allow_ragged_batch", None),
     "L/m: input 'a' allow_ragged_batch recorded True, upstream False"),
    (_set("inputs", 1, "reshape", None), "L/m: input 'b' reshape recorded [], upstream None"),
    (_set("outputs", 0, "data_type", "TYPE_FP16"), "L/m: output 'o' data_type recorded 'TYPE_FP32', upstream 'TYPE_FP16'"),
    (lambda m: m["parameters"].update(q=""), "L/m: upstream parameter 'q' is not recorded"),
    (lambda m: m["parameters"].clear(), "L/m: recorded parameter 'p' is not upstream"),
    (lambda m: m.update(backend="pytorch"), "L/m: backend recorded 'python', upstream 'pytorch'"),
    (lambda m: m.update(platform="ensemble"), "L/m: platform recorded None, upstream 'ensemble'"),
    (lambda m: m.update(max_batch_size=16), "L/m: max_batch_size recorded 8, upstream 16"),
    (lambda m: m.update(decoupled=False), "L/m: decoupled recorded True, upstream False"),
    (lambda m: m.update(instance_group={"count": 2, "kind": "KIND_CPU"}),
     "L/m: instance_group recorded {'count': 1, 'kind': 'KIND_CPU'}, upstream {'count': 2, 'kind': 'KIND_CPU'}"),
    (lambda m: m.pop("dynamic_batching"),
     "L/m: dynamic_batching recorded {'max_queue_delay_microseconds': 0}, upstream None"),
])
def test_each_planted_difference_is_named_alone(change, expected):
    assert _diff(MODEL, change) == [expected]


def test_an_outputs_optional_flags_are_not_compared():
    """Triton has no optional outputs: a flag there is noise of the parser, not a difference."""
    assert _diff(MODEL, _set("outputs", 0, "optional", True)) == []
    assert _diff(MODEL, _set("outputs", 0, "allow_ragged_batch", True)) == []


@pytest.mark.parametrize("change, expected", [
    (lambda m: m["steps"].reverse(), ["L/m: steps recorded ['m', 'n'], upstream ['n', 'm']"]),
    (lambda m: m["steps"][1]["input_map"].update(c="x"), ["L/m: step n input_map['c'] recorded 'y', upstream 'x'"]),
    (lambda m: m["steps"][0]["output_map"].pop("o"), ["L/m: step m output_map['o'] recorded 'y', upstream None"]),
    (lambda m: m["steps"][1]["output_map"].update(e="w"), ["L/m: step n output_map['e'] recorded None, upstream 'w'"]),
    (lambda m: m.pop("steps"), ["L/m: steps recorded ['m', 'n'], upstream []"]),
])
def test_an_ensembles_steps_are_compared_in_order_and_map_by_map(change, expected):
    assert _diff(ENSEMBLE, change) == expected


PBTXT = """name: "m"
backend: "python"
max_batch_size: 8
input [ { name: "a" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "o" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def _checkout(root, where: str, models: dict[str, str]):
    for name, text in models.items():
        (root / where / name).mkdir(parents=True)
        (root / where / name / "config.pbtxt").write_text(text)
    return root


@pytest.mark.parametrize("where", ["all_models/L", "triton_backend/all_models/L", "L"])
def test_a_checkout_is_found_in_each_upstream_tree_shape(tmp_path, where):
    root = _checkout(tmp_path, where, {"m": PBTXT})
    assert refresh.find_layout_dir(root, "L") == root / where
    parsed = refresh.parse_checkout(root, "L")
    assert list(parsed) == ["m"] and parsed["m"]["inputs"][0]["name"] == "a"


def test_a_tree_without_the_layout_is_refused_naming_where_it_looked(tmp_path):
    with pytest.raises(UserError, match=r"no L/ \(looked in \., all_models/, triton_backend/all_models/\)"):
        refresh.find_layout_dir(tmp_path, "L")
    _checkout(tmp_path, "L", {"m": "name: [broken"})
    with pytest.raises(UserError, match=r"L/m/config.pbtxt: not a Triton model config"):
        refresh.parse_checkout(tmp_path, "L")


def test_verify_checkout_names_missing_models_and_differences_and_skips_extra_ones(tmp_path, monkeypatch):
    recorded = refresh.parse_checkout(_checkout(tmp_path / "rec", "L", {"m": PBTXT}), "L")["m"]
    record = {"layouts": {"L": {"m": recorded, "z": recorded}}}
    monkeypatch.setattr(refresh.upstream, "record", lambda line: record)
    root = _checkout(tmp_path / "up", "L", {"a_extra": PBTXT, "m": PBTXT.replace("max_batch_size: 8",
                                                                                   "max_batch_size: 4")})
    assert refresh.verify_checkout(root, "1.2.1") == [
        "L/m: max_batch_size recorded 8, upstream 4",
        "L/z: recorded, but the checkout has no L/z/config.pbtxt"]


def test_a_templates_placeholders_are_listed_once_in_order():
    from pipeline.upstream.pbtxt import placeholders

    assert placeholders('max_batch_size: ${mbs}\nparameters { key: "${k}" }\n${mbs} ${other_1}') == \
        ["mbs", "k", "other_1"]
    assert placeholders("no placeholder, $notone {x}") == []


def test_every_finding_of_a_checkout_is_kept_in_model_order(tmp_path, monkeypatch):
    recorded = refresh.parse_checkout(_checkout(tmp_path / "rec", "L", {"m": PBTXT}), "L")["m"]
    record = {"layouts": {"L": {"a": recorded, "m": recorded, "n": recorded}}}
    monkeypatch.setattr(refresh.upstream, "record", lambda line: record)
    changed = PBTXT.replace("max_batch_size: 8", "max_batch_size: 4")
    root = _checkout(tmp_path / "up", "L", {"m": changed, "n": changed})
    assert refresh.verify_checkout(root, "1.2.1") == [
        "L/a: recorded, but the checkout has no L/a/config.pbtxt",
        "L/m: max_batch_size recorded 8, upstream 4", "L/n: max_batch_size recorded 8, upstream 4"]


def test_a_model_without_outputs_or_parameters_on_either_side_compares():
    bare = {"name": "m", "inputs": [{"name": "a", "data_type": "TYPE_INT32", "dims": [1]}]}
    assert refresh.diff_model("L/m", bare, copy.deepcopy(bare)) == []
    assert refresh.diff_model("L/m", bare, {**bare, "parameters": {"p": ""}}) == [
        "L/m: upstream parameter 'p' is not recorded"]
    assert refresh.diff_model("L/m", {**bare, "outputs": [{"name": "o", "data_type": "TYPE_FP32", "dims": [1]}],
                                      "parameters": {"q": ""}}, bare) == [
        "L/m: recorded output 'o' is not upstream", "L/m: recorded parameter 'q' is not upstream"]


def test_an_empty_layout_folder_does_not_hide_the_one_with_configs(tmp_path):
    (tmp_path / "all_models" / "L").mkdir(parents=True)  # present, but no model in it
    root = _checkout(tmp_path, "triton_backend/all_models/L", {"m": PBTXT})
    assert refresh.find_layout_dir(root, "L") == tmp_path / "triton_backend" / "all_models" / "L"
