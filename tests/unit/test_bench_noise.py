"""The bench's noise estimate (pipeline.stages.bench.noise): bootstrap intervals of each level's headline figures, and
``pipeline diff`` marking a bench change within or outside the noise the two bundles recorded."""
from __future__ import annotations

import json

import numpy as np

from pipeline import bundle
from pipeline.results import BenchResult
from pipeline.stages.bench import bench_md, noise, summary_row
from pipeline.stages.bench.triton_client import RequestRecord, summarize
from tests.helpers.bundles import make_bundle, rewrite_manifest

MU, SIGMA = np.log(0.5), 0.3  # request latency ~ lognormal: median 0.5 s


def _records(seed: int, n: int = 48, slowdown: float = 1.0, concurrency: int = 4) -> tuple[list[RequestRecord], float]:
    """``n`` requests of a synthetic level: lognormal latencies, TTFT a fifth of each, 20-40 output tokens; the wall
    time as if ``concurrency`` ran at once. ``slowdown`` stretches every time."""
    rng = np.random.default_rng(seed)
    lat = rng.lognormal(MU, SIGMA, n) * slowdown
    tokens = rng.integers(20, 41, n)
    recs = [RequestRecord(i, sent=0.0, first=float(x) / 5, done=float(x), text="t", output_tokens=int(t))
            for i, (x, t) in enumerate(zip(lat, tokens))]
    return recs, float(lat.sum()) / concurrency


def _row(seed: int, **kw) -> dict:
    recs, wall = _records(seed, **kw)
    return summary_row({"concurrency": 4, **summarize(recs, wall), "noise": noise.of_records(recs, wall)})


def test_the_interval_covers_the_distributions_statistic_and_is_reproducible():
    true_median_ms = 1000 * np.exp(MU)
    covered = shifted = 0
    for seed in range(40):
        lat = np.random.default_rng(seed).lognormal(MU, SIGMA, 60)
        lo, hi = noise.interval([lat * 1000], np.median, seed=seed)
        covered += lo <= true_median_ms <= hi
        lo, hi = noise.interval([2 * lat * 1000], np.median, seed=seed)  # negative control: twice as slow
        shifted += lo <= true_median_ms <= hi
    assert covered >= 34, covered  # a 95% interval: about 38 of 40
    assert shifted == 0, shifted
    # the same requests give the same interval; another seed resamples differently
    recs, wall = _records(7)
    assert noise.of_records(recs, wall) == noise.of_records(recs, wall)
    assert noise.of_records(recs, wall)["ttft_p50_ms"] != noise.of_records(recs, wall, seed=1)["ttft_p50_ms"]


def test_each_figure_lies_in_its_interval_and_one_request_has_none():
    row = _row(3)
    n = row["noise"]
    assert n["confidence"] == 0.95 and n["requests"] == 48 and n["method"] == "bootstrap percentile"
    for key in noise.FIGURES:
        lo, hi = n[key]
        assert lo < row[key] < hi or (key == "latency_p95_ms" and lo <= row[key] <= hi), (key, row[key], n[key])
    # negative control: the interval is of this level's figure, not of a level twice as slow
    slow = _row(3, slowdown=2.0)
    assert not slow["noise"]["ttft_p50_ms"][0] <= row["ttft_p50_ms"] <= slow["noise"]["ttft_p50_ms"][1]
    recs, wall = _records(3, n=1)
    one = noise.of_records(recs, wall)
    assert [one[k] for k in noise.FIGURES] == [None, None, None] and one["requests"] == 1
    BenchResult.model_validate({"model": "m", "layout": "l", "answers_passed": 0, "answers": 0,
                                "workloads": {"chat": [row]}, "gates": {
                                    "verdict": "pass", "breaches": [], "regressions": [], "regressions_gated": False}})


def _bench(path, *rows) -> None:
    rewrite_manifest(path / "bundle.json", lambda d: d["bench"].update(workloads={"chat": list(rows)}))
    bundle.BundleManifest.model_validate(json.loads((path / "bundle.json").read_text()))


def _changes(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("chat c=4 "):
            out[cells[0].removeprefix("chat c=4 ")] = cells[3]
    return out


def test_diff_marks_changes_within_the_noise_and_a_planted_slowdown_outside(tmp_path):
    old, new = make_bundle(tmp_path / "a"), make_bundle(tmp_path / "b", version="v0000000000bb")
    _bench(old, _row(1))
    _bench(new, _row(2))  # another draw from the same distribution
    text = bundle.diff(str(old), str(new))
    same = _changes(text)
    assert set(same) == set(noise.FIGURES), text
    assert all(c.endswith("% (within noise)") for c in same.values()), same
    assert "(within noise): the two bundles' bootstrap percentile 95% intervals" in text
    assert "no noise recorded" not in text
    # negative control: every time twice as long
    _bench(new, _row(2, slowdown=2.0))
    text = bundle.diff(str(old), str(new))
    slow = _changes(text)
    assert set(slow) == set(noise.FIGURES) and not any("noise" in c for c in slow.values()), slow
    assert slow["output_tokens_per_s"].startswith("-") and slow["latency_p95_ms"].startswith("+")
    assert "an unmarked bench change lies outside the noise" in text


def test_diff_of_a_bundle_without_intervals_leaves_the_change_unmarked(tmp_path):
    old, new = make_bundle(tmp_path / "a"), make_bundle(tmp_path / "b", version="v0000000000bb")
    before = _row(1)
    del before["noise"]  # benched before the noise was recorded
    _bench(old, before)
    _bench(new, _row(2))
    text = bundle.diff(str(old), str(new))
    changes = _changes(text)
    assert changes and not any("noise" in c for c in changes.values()), changes
    assert "3 bench changes left unmarked: no noise recorded for them in the old bundle" in text
    assert "(within noise): " not in text  # no legend for a mark that is not used
    # the same rows with the noise recorded on both sides are marked (the note is about the missing intervals)
    _bench(old, _row(1))
    assert "no noise recorded" not in bundle.diff(str(old), str(new))


def test_the_bench_report_shows_each_levels_interval():
    recs, wall = _records(5)
    lv = {"concurrency": 4, **summarize(recs, wall), "noise": noise.of_records(recs, wall)}
    r = {"model": "ensemble", "layout": "inflight_batcher_llm", "launcher": "local", "answers": [],
         "gates": {"verdict": "pass", "breaches": [], "regressions": [], "baseline": None},
         "workloads": {"chat": {"prompt_words": 24, "max_tokens": 32, "levels": [lv]}}}
    md = bench_md.markdown("m", r)
    lo, hi = lv["noise"]["ttft_p50_ms"]
    assert "95% interval: TTFT p50 / latency p95 / tok/s" in md and f"[{lo:.1f}, {hi:.1f}]" in md, md
    assert bench_md.NOISE_LEGEND in md
    del lv["noise"]  # an older bench.json: no intervals, said so
    md = bench_md.markdown("m", r)
    assert "| not recorded |" in md and bench_md.NOISE_LEGEND not in md
