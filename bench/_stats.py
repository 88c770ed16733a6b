"""What every benchmark reports its latencies with."""

from __future__ import annotations

from collections.abc import Sequence


def pct(xs: Sequence[float], p: float) -> float:
    """Nearest-rank percentile ``p`` (0-100) of ``xs``; NaN for no samples."""
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))] if s else float("nan")
