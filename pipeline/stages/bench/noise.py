"""How much a bench level's headline figures move by chance: a bootstrap interval of each figure over the level's
own requests (``scipy.stats.bootstrap``, percentile method, a seeded generator: the same requests give the same
interval), which ``bench.json``, ``bundle.json`` (each row's ``noise``), ``bench.md`` and ``pipeline diff`` show.

The figures and what is resampled (the level's successful requests, with replacement):

- ``ttft_p50_ms``: the median time to first token;
- ``latency_p95_ms``: the 95th percentile of request latency;
- ``output_tokens_per_s``: the level's output tokens over its wall time, written as (output tokens / request time
  of the resampled requests) x the level's occupancy (the recorded requests' total request time / wall time, kept
  fixed), so the interval is centred on the figure and moves with how long each request took.

A level of one request has no interval (``None``). With the few requests of a CPU smoke level the intervals are
wide: they say how little such a level pins down."""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0
METHOD = "bootstrap percentile"
FIGURES = ("ttft_p50_ms", "latency_p95_ms", "output_tokens_per_s")


def interval(data: Sequence[Sequence[float]], statistic, *, seed: int = SEED, confidence: float = CONFIDENCE,
             resamples: int = RESAMPLES) -> list[float] | None:
    """The bootstrap ``confidence`` interval ``[low, high]`` of ``statistic`` over ``data`` (one sequence, or several
    of equal length resampled together: paired), percentile method, ``seed`` fixing the resamples. ``statistic``
    takes the arrays and ``axis``. ``None`` with fewer than two observations."""
    from scipy import stats

    arrays = tuple(np.asarray(d, dtype=float) for d in data)
    if not arrays or len(arrays[0]) < 2:
        return None
    res = stats.bootstrap(arrays, statistic, n_resamples=resamples, paired=len(arrays) > 1, vectorized=True,
                          confidence_level=confidence, method="percentile", rng=np.random.default_rng(seed))
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if math.isnan(low) or math.isnan(high):
        return None
    return [round(low, 4), round(high, 4)]


def _median(x, axis=-1):
    return np.median(x, axis=axis)


def _p95(x, axis=-1):
    return np.percentile(x, 95, axis=axis)


def level_noise(ttft_s: Sequence[float], latency_s: Sequence[float], output_tokens: Sequence[int],
                wall_s: float, *, seed: int = SEED) -> dict[str, Any]:
    """The intervals of one level's figures from its successful requests' TTFTs and latencies (seconds; one entry per
    request that has one) and output tokens (per request, paired with ``latency_s``), and the level's wall time."""
    tokens = np.asarray(output_tokens, dtype=float)
    lat = np.asarray(latency_s, dtype=float)
    out: dict[str, Any] = {"method": METHOD, "confidence": CONFIDENCE, "resamples": RESAMPLES, "seed": seed,
                           "requests": len(lat)}
    ttft = interval([np.asarray(ttft_s, dtype=float) * 1000.0], _median, seed=seed)
    p95 = interval([lat * 1000.0], _p95, seed=seed)
    tps = None
    if wall_s > 0 and len(tokens) == len(lat) and lat.sum() > 0:
        occupancy = lat.sum() / wall_s

        def rate(t, s, axis=-1):
            return occupancy * t.sum(axis=axis) / s.sum(axis=axis)

        tps = interval([tokens, lat], rate, seed=seed)
    return {**out, "ttft_p50_ms": ttft, "latency_p95_ms": p95, "output_tokens_per_s": tps}


def of_records(records, wall_s: float, *, seed: int = SEED) -> dict[str, Any]:
    """:func:`level_noise` of a level's request records (``triton_client.RequestRecord``; the output tokens counted)."""
    ok = [r for r in records if r.error is None]
    timed = [r for r in ok if r.latency is not None]
    return level_noise([r.ttft for r in ok if r.ttft is not None], [r.latency for r in timed],
                       [r.output_tokens or 0 for r in timed], wall_s, seed=seed)

