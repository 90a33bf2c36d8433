"""The CLI's in-process verbs: ``validate`` on a small config tree, broken and sound."""
from __future__ import annotations

import json
import re
import shutil

from pipeline import cli, config
from pipeline.errors import UserError

PROBLEMS = ("build.max_batch_size=0 is out of range", "build.pp_size=0 is out of range")


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
        (conf / "build" / "default.yaml").write_text("max_batch_size: 0\npp_size: 0\n")
    monkeypatch.setattr(config, "CONF_DIR", conf)
    return [" ".join(f"{k}={v}" for k, v in c.items()) for c in config.combinations()]


def _text(captured: str) -> str:
    return " ".join(captured.split())  # the console wraps long lines when it is not a terminal


def test_validate_reports_every_problem(tmp_path, monkeypatch, capsys):
    """A broken config tree: validate names every failing combination with each of its problems, not just the
    first, in the text report and in the JSON one."""
    names = _small_tree(tmp_path, monkeypatch, broken=True)
    assert len(names) == 6
    assert cli.cmd_validate(as_json=False) == 2
    err = _text(capsys.readouterr().err)
    for name in names:
        for problem in PROBLEMS:
            assert f"✗ {name}: {problem}" in err, (name, problem, err[:2000])
    assert f"0/{len(names)} combinations compose;" in err and f"; {len(names)} with config errors" in err

    assert cli.cmd_validate(as_json=True) == 2
    doc = json.loads(capsys.readouterr().out)
    assert (doc["combinations"], doc["failing"]) == (len(names), len(names))
    for r in doc["results"]:
        assert len(r["errors"]) == 2 and all(any(p in e for e in r["errors"]) for p in PROBLEMS), r

    results = []
    for combo in config.combinations():
        try:
            config.compose([f"{k}={v}" for k, v in combo.items()])
        except UserError as exc:
            results.append(exc.problems)
    assert len(results) == len(config.combinations())
    assert all(len(p) == 2 for p in results)


def test_validate_passes_a_sound_tree(tmp_path, monkeypatch, capsys):
    """The negative control of the test above: the same small tree unbroken exits 0 and reports no problem."""
    names = _small_tree(tmp_path, monkeypatch, broken=False, quants=("fp8", "none"))
    assert cli.cmd_validate(as_json=False) == 0
    err = _text(capsys.readouterr().err)
    assert "✗" not in err and not any(p in err for p in PROBLEMS)
    assert re.search(rf"{len(names)}/{len(names)} combinations compose; \d+ refused by the compatibility rules; "
                     r"0 with config errors", err), err
