"""lint's ensemble rules on small hand-written configs: every step names a model of the repository, maps tensors that
exist with matching data types, feeds every required input, fits the step models' batch sizes; every ensemble
output is produced, with its data type. One planted fault per case, named alone; the clean ensemble has none."""
from __future__ import annotations

import pytest

from pipeline.triton import lint
from pipeline.triton.render import parse_model_config

MODEL = """name: "m"
backend: "python"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_STRING dims: [ 1 ] },
        { name: "OPT" data_type: TYPE_INT32 dims: [ 1 ] optional: true } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""
POST = """name: "p"
backend: "python"
max_batch_size: 8
input [ { name: "IDS" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] } ]
"""
ENSEMBLE = """name: "e"
platform: "ensemble"
max_batch_size: 8
input [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "m" model_version: -1 input_map { key: "IN" value: "text" } output_map { key: "OUT" value: "ids" } },
    { model_name: "p" model_version: -1 input_map { key: "IDS" value: "ids" } output_map { key: "TEXT" value: "text_output" } }
  ]
}
"""
REL = "e/config.pbtxt"


def findings(ensemble: str = ENSEMBLE, model: str = MODEL, post: str = POST) -> list[str]:
    configs = {"m": parse_model_config(model), "p": parse_model_config(post)}
    return lint.check_ensemble("e", parse_model_config(ensemble), configs)


def test_a_clean_ensemble_has_no_finding():
    assert findings() == []


@pytest.mark.parametrize("old, new, expected", [
    ('model_name: "p"', 'model_name: "q"', f'{REL}: step 1 uses model "q", which is not in the repository'),
    ('input_map { key: "IN"', 'input_map { key: "INPUT"', f'{REL}: step "m" maps input "INPUT", which the model '
                                                          f'does not have'),
    ('input_map { key: "IDS" value: "ids" }', 'input_map { key: "IDS" value: "idz" }',
     f'{REL}: step "p" reads "idz", which no ensemble input or earlier step provides'),
    ('output_map { key: "OUT"', 'output_map { key: "OUTS"', f'{REL}: step "m" maps output "OUTS", which the model '
                                                            f'does not have'),
    ('value: "text_output" }', 'value: "text_out" }', f'{REL}: output "text_output" is produced by no step'),
    ('max_batch_size: 8\ninput', 'max_batch_size: 16\ninput',
     f"{REL}: max_batch_size 16 exceeds step model \"m\"'s 8; lower the ensemble's or raise the model's"),
])
def test_a_planted_ensemble_fault_is_named(old, new, expected):
    assert old in ENSEMBLE
    got = findings(ENSEMBLE.replace(old, new, 1))
    assert expected in got, got


def test_only_the_fault_is_named():
    got = findings(ENSEMBLE.replace('model_name: "p"', 'model_name: "q"', 1))
    assert got == [f'{REL}: step 1 uses model "q", which is not in the repository',
                   f'{REL}: output "text_output" is produced by no step']


def test_every_bad_step_is_named_not_only_the_first():
    bad = ENSEMBLE.replace('model_name: "m"', 'model_name: "x"', 1).replace('model_name: "p"', 'model_name: "y"', 1)
    got = findings(bad)
    assert f'{REL}: step 0 uses model "x", which is not in the repository' in got
    assert f'{REL}: step 1 uses model "y", which is not in the repository' in got


def test_every_output_a_step_maps_but_its_model_lacks_is_named_not_only_the_first():
    two = ENSEMBLE.replace('output_map { key: "OUT" value: "ids" }',
                           'output_map { key: "A" value: "a" } output_map { key: "OUT" value: "ids" } '
                           'output_map { key: "B" value: "b" }', 1)
    got = findings(two)
    assert sorted(got) == [f'{REL}: step "m" maps output "{k}", which the model does not have' for k in "AB"], got


def test_a_data_type_mismatch_between_steps_and_outputs_is_named():
    post = POST.replace('{ name: "IDS" data_type: TYPE_INT32', '{ name: "IDS" data_type: TYPE_INT64')
    assert findings(post=post) == [f'{REL}: "ids" is TYPE_INT32 but "p" input "IDS" is TYPE_INT64']
    ens = ENSEMBLE.replace('output [ { name: "text_output" data_type: TYPE_STRING',
                           'output [ { name: "text_output" data_type: TYPE_INT32')
    assert findings(ens) == [f'{REL}: output "text_output" is TYPE_INT32 but its step produces TYPE_STRING']


def test_a_required_input_must_be_fed_and_an_optional_one_may_be_left_out():
    model = MODEL.replace('{ name: "OPT" data_type: TYPE_INT32 dims: [ 1 ] optional: true }',
                          '{ name: "OPT" data_type: TYPE_INT32 dims: [ 1 ] }')
    assert findings(model=model) == [f'{REL}: step "m" does not feed its required input "OPT"']


@pytest.mark.parametrize("model_bs, ensemble_bs, fine", [(8, 8, True), (16, 8, True), (4, 8, False), (0, 8, False),
                                                          (0, 0, True), (8, 0, True)])
def test_the_ensembles_batch_size_must_fit_every_step_model(model_bs, ensemble_bs, fine):
    """A step model without batching (0) cannot take a batching ensemble's requests."""
    model = MODEL.replace("max_batch_size: 8", f"max_batch_size: {model_bs}")
    ens = ENSEMBLE.replace("max_batch_size: 8", f"max_batch_size: {ensemble_bs}")
    post = POST.replace("max_batch_size: 8", f"max_batch_size: {max(ensemble_bs, 8)}")
    got = [f for f in findings(ens, model, post) if "max_batch_size" in f]
    assert (got == []) is fine, got


def test_a_step_model_of_batch_size_one_is_below_the_ensembles():
    one = MODEL.replace("max_batch_size: 8", "max_batch_size: 1")
    assert findings(model=one) == ['e/config.pbtxt: max_batch_size 8 exceeds step model "m"\'s 1; lower the '
                                   "ensemble's or raise the model's"]
