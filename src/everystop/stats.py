"""Summary statistics shared by the bench, the telemetry report, the guardrails and the scripts.

One convention everywhere: `q` is a percentage (0..100); None and NaN values are skipped; when
nothing is left the answer is `empty` (None by default; run reports that print NaN pass
`empty=math.nan`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal, overload

import numpy as np

# numpy's names: "linear" interpolates between closest ranks (numpy's default);
# "inverted_cdf" is the nearest-rank rule (p99 of 50 samples is the largest).
Method = Literal["linear", "inverted_cdf"]


@overload
def percentile(values: Iterable[float | None], q: float, *, method: Method = ...,
               empty: None = None) -> float | None: ...
@overload
def percentile(values: Iterable[float | None], q: float, *, method: Method = ...,
               empty: float) -> float: ...
def percentile(values: Iterable[float | None], q: float, *, method: Method = "linear",
               empty: float | None = None) -> float | None:
    """The q-th percentile (0..100) of `values`."""
    data = [v for v in values if v is not None and not math.isnan(v)]
    if not data:
        return empty
    return float(np.percentile(data, q, method=method))


def cost_per_million(tokens_per_s: float, price_per_hour: float) -> float:
    """Dollars per 1M output tokens for a node at `price_per_hour` producing `tokens_per_s`
    (infinite when it produces nothing)."""
    if tokens_per_s <= 0:
        return math.inf
    return price_per_hour / 3600.0 / tokens_per_s * 1e6
