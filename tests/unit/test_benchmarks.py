"""The benchmarks as one instrument (``python -m benchmarks``): the committed docs/benchmarks.md is what the raw
records render, no benchmark edits ``sys.path``, and a run writes one one-line record with its provenance."""
from __future__ import annotations

import ast
import json
import shutil
import sys
import types
from pathlib import Path

import pytest

from benchmarks import _instrument as instrument

REPO = Path(__file__).resolve().parents[2]


def test_the_committed_page_is_what_the_records_render(tmp_path):
    doc = REPO / "docs" / "benchmarks.md"
    page = instrument.page()
    assert doc.read_text() == page, "docs/benchmarks.md differs from its records: run `python -m benchmarks render`"
    # negative controls: a hand edit of the page is drift; so is a figure changed in a record (its section, rendered
    # from a copy of the records holding the change, is no longer the page's)
    edited = tmp_path / "benchmarks.md"
    edited.write_text(page.replace("| bfloat16 | 4.594 |", "| bfloat16 | 3.594 |"))
    assert edited.read_text() != page and not instrument.is_current(edited)
    results = tmp_path / "results"
    results.mkdir()
    for p in instrument.RESULTS.glob("cpu_dtype-*.json"):
        shutil.copy(p, results / p.name)
    module = instrument.load("cpu_dtype")
    assert instrument.section("cpu_dtype", module, results) in page
    rec = results / "cpu_dtype-2026-12-03-81c6a71.json"
    data = json.loads(rec.read_text())
    data["median_s"]["bfloat16"] = 3.594
    rec.write_text(json.dumps(data) + "\n")
    assert instrument.section("cpu_dtype", module, results) not in page


def test_every_benchmark_module_has_the_interface_and_one_section():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    for name in instrument.names():
        module = instrument.load(name)  # raises on a module without add_arguments/run/render/docstring
        assert f"(`python -m benchmarks {name}`)" in text, name
        assert "\nsys.path" not in module.__doc__
    # the current figure per benchmark, the history in the raw JSON: the page stays short enough to read
    assert len(text.splitlines()) <= 450, "docs/benchmarks.md grew past 450 lines: shorten a benchmark's render()"


def _sys_path_edits(source: str) -> list[int]:
    """Lines that touch ``sys.path`` (``sys.path.insert``, ``sys.path[:0] = ...``, ``sys.path = ...``)."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys"]


def test_no_benchmark_or_tool_edits_sys_path():
    sources = {f"{p.parent.name}/{p.name}": p.read_text() for d in ("benchmarks", "tools")
               for p in sorted((REPO / d).glob("*.py"))}
    found = {name: _sys_path_edits(text) for name, text in sources.items()}
    assert len(found) >= 25 and not {k: v for k, v in found.items() if v}
    # nor in the code a benchmark hands a child process as text (``python -c``)
    assert not [name for name, text in sources.items() if "sys.path" in text]
    # negative control: the check sees an edit, whichever way it is spelled
    assert _sys_path_edits("import sys\nsys.path.insert(0, 'x')\n") == [2]
    assert _sys_path_edits("import sys\nsys.path[:0] = ['x']\n") == [2]
    assert _sys_path_edits("import os\nos.path.join('a')\n") == []


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A benchmark module of the interface (its measurement stands in for a real one: the instrument is under test)
    and results/doc under tmp_path."""
    mod = types.ModuleType("benchmarks.fake")
    mod.__doc__ = "A planted benchmark.\n\n    python -m benchmarks fake [--value V]\n"
    mod.add_arguments = lambda p: p.add_argument("--value", type=float, default=1.5)
    mod.run = lambda args: {"value": args.value} | ({"error": "it failed"} if args.value < 0 else {})
    mod.render = lambda rec: [f"value {rec['value']} at {rec['commit']}"]
    real_load = instrument.load
    monkeypatch.setattr(instrument, "load", lambda name: mod if name == "fake" else real_load(name))
    monkeypatch.setattr(instrument, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(instrument, "DOC", tmp_path / "benchmarks.md")
    return mod


def test_a_run_writes_one_line_with_its_provenance_and_regenerates_the_page(fake, tmp_path, capsys):
    assert instrument.main(["fake", "run", "--value", "2.5", "--note", "why"]) == 0
    [path] = (tmp_path / "results").glob("*.json")
    text = path.read_text()
    assert text.count("\n") == 1
    rec = json.loads(text)
    assert set(instrument.PROVENANCE) <= set(rec) and rec["benchmark"] == "fake" and rec["value"] == 2.5
    assert rec["note"] == "why" and len(rec["source_sha256"]) == 64
    commit = (rec["commit"] or "nogit")[:7]
    assert path.name.startswith(f"fake-{rec['date'][:10]}-{commit}")
    assert "value 2.5" in capsys.readouterr().out
    assert (tmp_path / "benchmarks.md").read_text().startswith("# Benchmarks")
    # a second run the same day keeps the first record (history), under another name
    assert instrument.main(["fake", "--value", "3"]) == 0
    assert len(list((tmp_path / "results").glob("*.json"))) == 2
    # --no-record writes nothing; --out writes there and leaves the page alone
    before = (tmp_path / "benchmarks.md").read_text()
    assert instrument.main(["fake", "--no-record"]) == 0
    assert len(list((tmp_path / "results").glob("*.json"))) == 2
    assert instrument.main(["fake", "--out", str(tmp_path / "device")]) == 0
    assert len(list((tmp_path / "device").glob("fake-*.json"))) == 1
    assert (tmp_path / "benchmarks.md").read_text() == before
    # a run that returns one of the instrument's fields keeps it beside the instrument's own (nothing measured is lost)
    fake.run = lambda args: {"value": 4.0, "date": "yesterday"}
    assert instrument.main(["fake"]) == 0
    kept = [json.loads(p.read_text()) for p in (tmp_path / "results").glob("*.json")]
    [rec] = [r for r in kept if r.get("run_date")]
    assert rec["run_date"] == "yesterday" and rec["date"].startswith("20")
    fake.run = lambda args: {"value": args.value} | ({"error": "it failed"} if args.value < 0 else {})
    # a failed run is recorded and exits 1
    assert instrument.main(["fake", "--value", "-1"]) == 1
    assert any(json.loads(p.read_text()).get("error") for p in (tmp_path / "results").glob("*.json"))


def test_the_current_block_is_the_newest_record_per_variant_and_older_forms_are_listed(fake, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for day, value, extra in (("01", 1.0, {}), ("02", 2.0, {}), ("03", 3.0, {"error": "failed"}),
                              ("04", None, {})):  # 04: an older form render cannot read (no value)
        rec = {"date": f"2026-12-{day}T10:00:00+00:00", "commit": "a" * 40, **extra}
        if value is not None:
            rec["value"] = value
        (results / f"fake-2026-12-{day}-aaaaaaa.json").write_text(json.dumps(rec) + "\n")
    [(variant, current, lines)] = instrument.current("fake", fake, instrument.records("fake", fake))
    assert current.path.name == "fake-2026-12-02-aaaaaaa.json" and lines == [f"value 2.0 at {'a' * 40}"]
    text = instrument.section("fake", fake)
    assert "Older runs: [`fake-2026-12-04-aaaaaaa.json`]" in text and "fake-2026-12-01-aaaaaaa.json" in text
    # variants: the newest of each
    fake.variant = lambda rec: "odd" if rec["value"] % 2 else "even"
    got = {v: r.path.name for v, r, _ in instrument.current("fake", fake, instrument.records("fake", fake))}
    assert got == {"even": "fake-2026-12-02-aaaaaaa.json", "odd": "fake-2026-12-01-aaaaaaa.json"}
    # the page shows the current figure (the newest variant's record) in full, the other variants in one line
    text = instrument.section("fake", fake)
    assert "### even" in text and "value 2.0" in text and "value 1.0" not in text
    assert "Other variants, newest record each" in text and "odd (2026-12-01, [`fake-2026-12-01-aaaaaaa.json`]" in text
    # a heading a render gives its block is left to the page's own
    fake.render = lambda rec: ["## my own heading", "", f"value {rec['value']}"]
    assert "my own heading" not in instrument.section("fake", fake)


def test_bad_input_is_one_line_and_exit_2(capsys):
    assert instrument.main(["no_such_benchmark"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no benchmark named 'no_such_benchmark'" in err
    assert instrument.main(["render", "--bogus"]) == 2
    with pytest.raises(SystemExit) as exc:  # argparse's own: a benchmark's unknown option
        instrument.main(["cpu_dtype", "--no-such-option"])
    assert exc.value.code == 2


def test_python_dash_m_benchmarks_lists_them():
    import subprocess

    out = subprocess.run([sys.executable, "-m", "benchmarks"], cwd=REPO, capture_output=True, text=True, check=True)
    assert "openai_overhead" in out.stdout and "cpu_dtype" in out.stdout


def test_a_benchmarks_own_option_replaces_a_shared_one_of_that_name(fake):
    fake.add_arguments = lambda p: p.add_argument("--out", type=int, default=0)
    args = instrument.parser("fake", fake).parse_args(["--out", "3"])
    assert args.out == 3 and not hasattr(args, "out_dir")  # the shared --out DIR gave way
    assert instrument.parser("fake", fake).parse_args(["--no-record"]).no_record  # the others stay


def test_openai_overhead_compares_ttft_on_the_prompts_whose_first_token_is_whole():
    """A prompt whose first token is part of a character: the OpenAI stream's first chunk comes a token later (held
    back until the character is whole). The like-for-like figures leave that prompt's requests out on both paths;
    a planted wrong probe (every prompt called whole) brings the held-back wait into the TTFT comparison again."""
    from benchmarks import openai_overhead as oo
    from pipeline.stages.bench.triton_client import RequestRecord

    def rec(prompt, first_ms, tokens=8, itl_ms=2.0):
        r = RequestRecord(prompt, sent=0.0)
        r.first, r.output_tokens = first_ms / 1e3, tokens
        r.done = r.first + (tokens - 1) * itl_ms / 1e3
        return r

    def rounds(held_back_ms):
        return [[rec(0, 10.0), rec(1, 10.0 + held_back_ms), rec(0, 10.0), rec(1, 10.0 + held_back_ms)]
                for _ in range(4)], [1.0] * 4

    got = {"grpc": rounds(0.0), "openai": rounds(5.0)}  # 5 ms: the next token's arrival, not front-end overhead
    like = oo._like_for_like(got, [0])
    ttft = {p: like["summary"][p]["time_to_first_token"]["p50"] for p in got}
    assert ttft["openai"] - ttft["grpc"] == pytest.approx(0.0, abs=1e-6)
    assert like["summary"]["openai"]["requests"] == 8 and "ttft_p50_ms_added" in like["interval_95"]
    planted = oo._like_for_like(got, [0, 1])
    assert planted["summary"]["openai"]["time_to_first_token"]["p50"] \
        - planted["summary"]["grpc"]["time_to_first_token"]["p50"] > 2.0
    assert oo._like_for_like(got, []) == {"prompts": [], "summary": {}, "interval_95": {}}
