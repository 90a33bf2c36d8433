"""The CLI: every verb's --help and argument errors, Hydra overrides passed through, and ``validate`` on a small
config tree, broken and sound."""
from __future__ import annotations

import json
import re
import shutil

import pytest

from pipeline import config, hardware
from pipeline.cli.build import cmd_validate
from pipeline.errors import UserError

PROBLEMS = ("build.max_batch_size=-1 is out of range", "build.pp_size=0 is out of range")


def _small_tree(tmp_path, monkeypatch, *, broken: bool, quants: tuple[str, ...] = ()) -> list[str]:
    """A copy of conf/ cut to 1 model × 6 quants (or ``quants``) × 1 target × 1 runtime (``build`` broken twice when
    asked); returns each combination as validate names it."""
    conf = tmp_path / "conf"
    shutil.copytree(config.CONF_DIR, conf)
    for p in (conf / "quant").glob("*.yaml"):
        if quants and p.stem not in quants:
            p.unlink()
    for group, keep in (("model", "tiny-qwen3"), ("target", "cpu"), ("runtime", "reference")):
        for p in (conf / group).glob("*.yaml"):
            if p.stem != keep:
                p.unlink()
    if broken:
        (conf / "build" / "default.yaml").write_text("max_batch_size: -1\npp_size: 0\n")
    monkeypatch.setattr(config, "CONF_DIR", conf)
    return [" ".join(f"{k}={v}" for k, v in c.items()) for c in config.combinations()]


def _text(captured: str) -> str:
    return " ".join(captured.split())  # the console wraps long lines when it is not a terminal


def test_validate_reports_every_problem(tmp_path, monkeypatch, capsys):
    """A broken config tree: validate names every failing combination with each of its problems, not just the
    first, in the text report and in the JSON one."""
    names = _small_tree(tmp_path, monkeypatch, broken=True, quants=("fp8", "int4_awq", "none"))
    assert len(names) == 3  # one combination per quant preset kept, on the one target
    assert cmd_validate(as_json=False) == 2
    err = _text(capsys.readouterr().out)
    for name in names:
        for problem in PROBLEMS:
            assert f"✗ {name}: {problem}" in err, (name, problem, err[:2000])
    assert f"0/{len(names)} combinations compose;" in err and f"; {len(names)} with config errors" in err

    assert cmd_validate(as_json=True) == 2
    doc = json.loads(capsys.readouterr().out)
    assert (doc["combinations"], doc["failing"]) == (len(names), len(names))
    for r in doc["results"]:
        assert len(r["errors"]) == 2 and all(any(p in e for e in r["errors"]) for p in PROBLEMS), r

    results = []
    for combo in config.combinations():
        try:
            hardware.compose([f"{k}={v}" for k, v in combo.items()])
        except UserError as exc:
            results.append(exc.problems)
    assert len(results) == len(config.combinations())
    assert all(len(p) == 2 for p in results)


def test_validate_passes_a_sound_tree(tmp_path, monkeypatch, capsys):
    """The negative control of the test above: the same small tree unbroken exits 0 and reports no problem."""
    names = _small_tree(tmp_path, monkeypatch, broken=False, quants=("fp8", "none"))
    assert cmd_validate(as_json=False) == 0
    err = _text(capsys.readouterr().out)
    assert "✗" not in err and not any(p in err for p in PROBLEMS)
    assert re.search(rf"{len(names)}/{len(names)} combinations compose; \d+ refused by the compatibility rules; "
                     r"0 with config errors", err), err


def test_validate_keeps_the_options_asked_for_and_refuses_one_not_shipped(tmp_path, monkeypatch, capsys):
    """``validate quant=none``: the combinations of that option alone; an option or axis that is not shipped is one
    line naming the choices (the negative control: the same call unfiltered validates both quants)."""
    _small_tree(tmp_path, monkeypatch, broken=False, quants=("fp8", "none"))
    assert cmd_validate(as_json=True) == 0
    assert {r["combination"]["quant"] for r in json.loads(capsys.readouterr().out)["results"]} == {"fp8", "none"}
    assert cmd_validate(as_json=True, only=["quant=none"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["combinations"] == 1 and doc["results"][0]["combination"]["quant"] == "none"
    for bad, says in ((["quant=int3"], "quant=int3 is not a shipped quant; choose from fp8, none"),
                      (["flavour=x"], "flavour= is not an axis"), (["quant"], "is not AXIS=OPTION")):
        with pytest.raises(UserError, match=says):
            cmd_validate(as_json=True, only=bad)


# ------------------------------------------------------------------------------------------------ argument parsing
HELP = {  # each verb's options and positionals, as its --help must name them
    "build": ("--json", "-m, --multirun", "OVERRIDE"),
    "plan": ("--json", "-m, --multirun", "OVERRIDE"),
    "validate": ("--json",),
    "render": ("DIR", "OVERRIDE"),
    "lint": ("REPO", "--trtllm-version X", "--container IMAGE", "--repo-mount PATH", "--no-engine"),
    "serve": ("REPO_OR_BUNDLE", "OVERRIDE"),
    "verify": ("BUNDLE_DIR_OR_URL", "--container IMAGE", "--public-key PEM", "--certificate-chain PEM",
               "--require-signature", "--json"),
    "diff": ("OLD_BUNDLE", "NEW_BUNDLE"),
    "matrix": ("NAME", "--outdated", "OVERRIDE"),
    "outdated": ("NAME", "--entry", "--json", "OVERRIDE"),
    "gc": ("--dry-run", "--json", "OVERRIDE"),
}


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    from pipeline.cli import main

    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.mark.parametrize("verb", sorted(HELP))
def test_every_verb_has_help_naming_its_options(capsys, verb):
    code, out, err = _main(capsys, verb, "--help")
    assert code == 0 and err == ""
    assert out.startswith(f"usage: python -m pipeline {verb} ")
    for option in HELP[verb]:
        assert option in out, (verb, option, out)
    assert "-h, --help" in out


def test_the_top_level_help_lists_every_verb_and_no_verb_is_an_error(capsys):
    code, out, _ = _main(capsys, "--help")
    assert code == 0
    listed = re.findall(r"^    (\w+)\s", out, flags=re.M)
    assert listed == list(HELP), out
    code, out, _ = _main(capsys)
    assert code == 2 and out.startswith("usage: python -m pipeline")


def test_lint_help_is_help_not_a_repository(capsys):
    code, out, err = _main(capsys, "lint", "--help")
    assert code == 0 and "--trtllm-version" in out and "no such directory" not in out + err


@pytest.mark.parametrize("argv, expected", [
    (["frobnicate", "model=x"], "error: unknown verb 'frobnicate'; choose one of: " + ", ".join(HELP)),
    (["verify", "--container"], "error: python -m pipeline verify: argument --container: expected one argument"),
    (["diff", "only-one"], "error: python -m pipeline diff: the following arguments are required: NEW_BUNDLE"),
    (["build", "--bogus"], "error: python -m pipeline build: unrecognized arguments: --bogus"),
])
def test_bad_arguments_are_one_line_and_exit_2(capsys, argv, expected):
    code, out, err = _main(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith(expected), err


def test_hydra_overrides_pass_through_untouched():
    """Options may sit anywhere among the overrides; every override form reaches the verb as written."""
    from pipeline.cli import parser

    _, verbs = parser()
    overrides = ["model=tiny-qwen3", "+bench.extra=1", "~publish.sign", "hydra/launcher=submitit_local",
                 "quant=fp8,none", "force=[quantize]", "model.name=a-b"]
    args = verbs["build"].parse_intermixed_args([overrides[0], "--json", *overrides[1:4], "-m", *overrides[4:]])
    assert (args.json, args.multirun, args.args) == (True, True, overrides)
    args = verbs["plan"].parse_intermixed_args(overrides)
    assert (args.json, args.multirun, args.args) == (False, False, overrides)
    args = verbs["matrix"].parse_intermixed_args(["nightly", "--outdated", "publish.dest=s3://b/x"])
    assert (args.outdated, args.args) == (True, ["nightly", "publish.dest=s3://b/x"])
    args = verbs["verify"].parse_intermixed_args(["b", "--certificate-chain", "a.pem", "--certificate-chain",
                                                  "b.pem"])
    assert (args.bundle, args.certificate_chain, args.require_signature) == ("b", ["a.pem", "b.pem"], False)


def test_validate_summarises_expected_refusals_in_one_line_per_target():
    from pipeline.cli.build import refusal_summary

    refused = [{"combination": {"model": m, "quant": q, "target": t}, "refused": [why]}
               for m, q, t, why in [("a", "nvfp4", "h100", "NVFP4 needs sm100 [Blackwell]"),
                                    ("b", "nvfp4", "h100", "NVFP4 needs sm100 [Blackwell]"),
                                    ("a", "int4_awq", "h100", "other"), ("a", "fp8", "a10g", "FP8 needs sm89")]]
    assert refusal_summary(refused) == [
        "target=a10g: 1 combination refused by the compatibility rules (1× FP8 needs sm89; validate --json lists "
        "each)",
        "target=h100: 3 combinations refused by the compatibility rules (2× NVFP4 needs sm100 [Blackwell]; 1 other "
        "reason; validate --json lists each)"]


@pytest.mark.parametrize("override, key", [("build.max_batch_size=${0}", "build.max_batch_size"),
                                           ("bench.concurrency=[1,${oops}]", "bench.concurrency[1]")])
def test_an_interpolation_to_a_missing_key_is_one_problem_naming_the_key(override, key):
    with pytest.raises(UserError) as exc:
        hardware.compose([override])
    msg = str(exc.value)
    assert msg.startswith(f"cannot resolve config key {key}: Interpolation key ")
    assert "must name a config key that exists" in msg and "\n" not in msg
    # negative control: an interpolation to a key that exists resolves
    assert hardware.compose(["build.max_batch_size=${build.workers}"]).build.max_batch_size > 0
