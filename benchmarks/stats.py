"""Summaries every section uses: medians with min-max, and compact latency distributions."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

#: the quantiles kept of a latency distribution (the committed JSON keeps these, not samples)
QUANTILES = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0)


def summary(samples: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of per-round figures, with the rounds themselves."""
    xs = [float(x) for x in samples]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def quantiles(values: Sequence[float]) -> dict[str, float]:
    """Nearest-rank quantiles of a latency sample, keyed ``"p50"``, ``"p99.9"``..."""
    s = sorted(values)
    out: dict[str, float] = {}
    for q in QUANTILES:
        k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
        out[f"p{q * 100:g}"] = float(s[k])
    return out


def ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The ratio of two medians (a / b)."""
    return float(a["median"]) / float(b["median"])
