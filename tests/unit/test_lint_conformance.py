"""lint's comparison of one model's config with upstream's recorded interface (``lint.conformance``), on small
hand-written configs and a hand-written record in the record's form: the clean config has no finding; each planted
difference (a tensor missing or extra, its data type, dims, reshape, optional or ragged flag, the backend, an
ensemble's steps, a required parameter absent or empty) is named alone, with the upstream source it came from."""
from __future__ import annotations

import pytest

from pipeline.triton import lint
from pipeline.triton.render import parse_model_config

CONFIG = """name: "m"
backend: "python"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_STRING dims: [ 1 ] reshape: { shape: [ ] } },
        { name: "LEN" data_type: TYPE_INT32 dims: [ 1 ] optional: true allow_ragged_batch: true } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
parameters { key: "tokenizer_dir" value: { string_value: "/models/tok" } }
parameters { key: "skip" value: { string_value: "" } }
"""
SOURCE = {"repo": "triton-inference-server/tensorrtllm_backend", "path": "all_models/x/m/config.pbtxt",
          "commit": "0c8de69a1b2c3d4e5f"}
WHERE = "triton-inference-server/tensorrtllm_backend all_models/x/m/config.pbtxt @ 0c8de69a1b"


def record(**changes) -> dict:
    rec = {"name": "m", "backend": "python", "max_batch_size": "${mbs}", "source": dict(SOURCE),
           "inputs": [{"name": "IN", "data_type": "TYPE_STRING", "dims": [1], "optional": False, "reshape": []},
                      {"name": "LEN", "data_type": "TYPE_INT32", "dims": [1], "optional": True,
                       "allow_ragged_batch": True}],
           "outputs": [{"name": "OUT", "data_type": "${out_type}", "dims": [-1]}]}
    rec.update(changes)
    return rec


READS = {"required": ["tokenizer_dir"], "source": {"path": "all_models/x/m/1/model.py"}}


def findings(config: str = CONFIG, rec: dict | None = None, reads: dict | None = None, name: str = "m") -> list[str]:
    return lint.conformance(name, parse_model_config(config), record() if rec is None else rec,
                            READS if reads is None else reads)


def test_a_config_that_matches_the_record_has_no_finding():
    assert findings() == []
    assert findings(reads={}) == []


@pytest.mark.parametrize("old, new, expected", [
    ('{ name: "LEN" data_type: TYPE_INT32 dims: [ 1 ] optional: true allow_ragged_batch: true }',
     '{ name: "LEN" data_type: TYPE_INT64 dims: [ 1 ] optional: true allow_ragged_batch: true }',
     'm/config.pbtxt: input "LEN" is TYPE_INT64, upstream has TYPE_INT32'),
    ('data_type: TYPE_INT32 dims: [ 1 ] optional', 'data_type: TYPE_INT32 dims: [ 2 ] optional',
     'm/config.pbtxt: input "LEN" dims [2], upstream has [1]'),
    ("reshape: { shape: [ ] }", "", 'm/config.pbtxt: input "IN" reshape None, upstream has []'),
    ("optional: true allow", "allow", 'm/config.pbtxt: input "LEN" optional=false, upstream has optional=true'),
    (" allow_ragged_batch: true", "",
     'm/config.pbtxt: input "LEN" allow_ragged_batch=false, upstream has allow_ragged_batch=true'),
    ('dims: [ -1 ] } ]', 'dims: [ -1 ] reshape: { shape: [ 1 ] } } ]',
     'm/config.pbtxt: output "OUT" reshape [1], upstream has None'),
    ('output [ { name: "OUT"', 'output [ { name: "OUT2"',
     'm/config.pbtxt: upstream output "OUT" is missing (clients of ' + WHERE + ' send/expect it); add it with '
     'data_type ${out_type} dims [-1]'),
    ('backend: "python"', 'backend: "tensorrtllm"', 'm/config.pbtxt: backend "tensorrtllm", upstream has "python"'),
    ('value: { string_value: "/models/tok" }', 'value: { string_value: " " }',
     'm/config.pbtxt: required parameter "tokenizer_dir" is empty; the python model uses its value as given '
     '(all_models/x/m/1/model.py); set it'),
    ('parameters { key: "tokenizer_dir" value: { string_value: "/models/tok" } }', "",
     'm/config.pbtxt: required parameter "tokenizer_dir" is missing; the python model reads it unconditionally '
     '(all_models/x/m/1/model.py); set it'),
])
def test_each_planted_difference_is_named_alone(old, new, expected):
    assert old in CONFIG
    got = findings(CONFIG.replace(old, new))
    extra = [f for f in got if f != expected]
    if "OUT2" in new:  # the renamed output is also one upstream does not have
        assert extra == [f'm/config.pbtxt: output "OUT2" is not in upstream\'s interface ({WHERE}); remove it']
    else:
        assert extra == []
    assert expected in got


def test_a_tensor_upstream_lacks_is_named_with_the_source_of_the_record():
    got = findings(CONFIG.replace('output [ {', 'output [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] }, {'))
    assert got == [f'm/config.pbtxt: output "X" is not in upstream\'s interface ({WHERE}); remove it']
    missing = findings(CONFIG.replace(
        '{ name: "LEN" data_type: TYPE_INT32 dims: [ 1 ] optional: true allow_ragged_batch: true } ]', "]")
        .replace('reshape: { shape: [ ] } },', 'reshape: { shape: [ ] } }'))
    assert missing == [f'm/config.pbtxt: upstream input "LEN" is missing (clients of {WHERE} send/expect it); add it '
                       f'with data_type TYPE_INT32 dims [1]']
    # a record without a repository says "upstream"; one without a source at all still names what it can
    no_repo = record(source={"path": "p/config.pbtxt", "commit": "abc"}, outputs=[])
    assert findings(rec=no_repo) == ["m/config.pbtxt: output \"OUT\" is not in upstream's interface "
                                     "(upstream p/config.pbtxt @ abc); remove it"]
    # a part the source lacks is left out of the message, not shown as a blank or a dangling "@"
    assert findings(rec=record(source={"repo": "r", "commit": "abc"}, outputs=[])) == [
        "m/config.pbtxt: output \"OUT\" is not in upstream's interface (r @ abc); remove it"]
    assert findings(rec=record(source={"repo": "r", "path": "p"}, outputs=[])) == [
        "m/config.pbtxt: output \"OUT\" is not in upstream's interface (r p); remove it"]
    assert findings(rec=record(source={"repo": "r", "path": "p", "commit": None}, outputs=[])) == [
        "m/config.pbtxt: output \"OUT\" is not in upstream's interface (r p); remove it"]
    assert findings(rec=record(source=None, outputs=[])) == [
        "m/config.pbtxt: output \"OUT\" is not in upstream's interface (upstream); remove it"]


def test_every_missing_tensor_is_named_not_only_the_first():
    two = record(inputs=record()["inputs"] + [{"name": "X", "data_type": "TYPE_INT32", "dims": [1]},
                                              {"name": "Y", "data_type": "TYPE_FP32", "dims": [2]}])
    assert findings(rec=two) == [
        f'm/config.pbtxt: upstream input "X" is missing (clients of {WHERE} send/expect it); add it with data_type '
        f'TYPE_INT32 dims [1]',
        f'm/config.pbtxt: upstream input "Y" is missing (clients of {WHERE} send/expect it); add it with data_type '
        f'TYPE_FP32 dims [2]']


def test_a_record_without_outputs_makes_every_output_one_upstream_lacks():
    """A recorded model may list no outputs (or no inputs): the config's are then all extra, not an error."""
    no_outputs = {k: v for k, v in record().items() if k != "outputs"}
    assert findings(rec=no_outputs) == [
        f'm/config.pbtxt: output "OUT" is not in upstream\'s interface ({WHERE}); remove it']
    no_inputs = {k: v for k, v in record().items() if k != "inputs"}
    assert findings(rec=no_inputs) == [
        f'm/config.pbtxt: input "{t}" is not in upstream\'s interface ({WHERE}); remove it' for t in ("IN", "LEN")]


def test_templated_record_values_are_not_compared_and_literal_ones_are():
    # the record's ${out_type} and a templated backend stand for any value
    assert findings(CONFIG.replace("TYPE_INT32 dims: [ -1 ]", "TYPE_FP32 dims: [ -1 ]")) == []
    assert findings(CONFIG.replace('backend: "python"', 'backend: "other"'), rec=record(backend="${backend}")) == []
    typed = record(outputs=[{"name": "OUT", "data_type": "TYPE_INT32", "dims": [-1]}])
    assert findings(CONFIG.replace("TYPE_INT32 dims: [ -1 ]", "TYPE_FP32 dims: [ -1 ]"), rec=typed) == [
        'm/config.pbtxt: output "OUT" is TYPE_FP32, upstream has TYPE_INT32']
    assert findings(rec=record(platform="ensemble")) == ['m/config.pbtxt: platform "", upstream has "ensemble"']


def test_required_parameters_empty_by_design_and_the_source_fallback():
    empty = CONFIG.replace('value: { string_value: "/models/tok" }', 'value: { string_value: "" }')
    allowed = {"required": ["tokenizer_dir"], "empty_means_unset": ["tokenizer_dir"]}
    assert findings(empty, reads=allowed) == []
    # without a reads source the message names the record's
    assert findings(empty, reads={"required": ["tokenizer_dir"]}) == [
        f'm/config.pbtxt: required parameter "tokenizer_dir" is empty; the python model uses its value as given '
        f'({WHERE}); set it']
    assert findings(reads={"required": ["nope"]}) == [
        f'm/config.pbtxt: required parameter "nope" is missing; the python model reads it unconditionally ({WHERE}); '
        f'set it']
    # the engine path: empty is its own finding, unless an encoder path is given
    engine = CONFIG.replace('key: "skip"', 'key: "gpt_model_path"')
    gpt = {"required": ["gpt_model_path"]}
    assert findings(engine, reads=gpt, name="tensorrt_llm", rec=record()) == [
        'tensorrt_llm/config.pbtxt: gpt_model_path is empty ("Both encoder and decoder model paths are empty"); set '
        'it to the engine directory']
    encoder = engine + 'parameters { key: "encoder_model_path" value: { string_value: "/e" } }\n'
    assert findings(encoder, reads=gpt, name="tensorrt_llm") == []
    assert findings(engine, reads=gpt, name="m") == []  # the rule is tensorrt_llm's


ENSEMBLE = """name: "e"
platform: "ensemble"
max_batch_size: 8
input [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "out" data_type: TYPE_STRING dims: [ -1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "a" model_version: -1 input_map { key: "IN" value: "text" } output_map { key: "OUT" value: "ids" } },
    { model_name: "b" model_version: -1 input_map { key: "IDS" value: "ids" } output_map { key: "TEXT" value: "out" } }
  ]
}
"""
STEPS = [{"model_name": "a", "input_map": {"IN": "text"}, "output_map": {"OUT": "ids"}},
         {"model_name": "b", "input_map": {"IDS": "ids"}, "output_map": {"TEXT": "out"}}]
ENSEMBLE_RECORD = {"name": "e", "platform": "ensemble", "source": SOURCE, "steps": STEPS,
                   "inputs": [{"name": "text", "data_type": "TYPE_STRING", "dims": [1]}],
                   "outputs": [{"name": "out", "data_type": "TYPE_STRING", "dims": [-1]}]}


@pytest.mark.parametrize("old, new, expected", [
    (None, None, []),
    ('model_name: "b"', 'model_name: "c"', ["e/config.pbtxt: steps run ['a', 'c'], upstream runs ['a', 'b']"]),
    ('input_map { key: "IDS" value: "ids" }', "",
     ["e/config.pbtxt: step 1 (b) lacks upstream's input_map IDS -> ids"]),
    ('output_map { key: "OUT" value: "ids" }', 'output_map { key: "OUT" value: "ids" } output_map { key: "N" '
                                               'value: "n" }',
     ["e/config.pbtxt: step 0 (a) has output_map N -> n, which upstream does not map"]),
    ('output_map { key: "TEXT" value: "out" }', 'output_map { key: "TEXT" value: "other" }',
     ["e/config.pbtxt: step 1 (b) maps output_map TEXT -> other, upstream -> out"]),
])
def test_an_ensembles_steps_are_compared_with_upstreams(old, new, expected):
    text = ENSEMBLE if old is None else ENSEMBLE.replace(old, new)
    assert old is None or old in ENSEMBLE
    assert lint.conformance("e", parse_model_config(text), ENSEMBLE_RECORD, {}) == expected
