"""The one stats module: percentiles (numpy's rules, one convention for no data) and cost."""

from __future__ import annotations

import math

import pytest

from everystop.stats import cost_per_million, percentile


def test_percentile_interpolates_between_closest_ranks_with_q_in_percent() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # unsorted input is fine
    assert percentile([float(i) for i in range(11)], 90) == 9.0
    assert percentile([10.0, 20.0], 25) == 12.5
    assert percentile([7.0], 99) == 7.0


def test_percentile_of_nothing_is_none_or_what_the_caller_asks() -> None:
    assert percentile([], 50) is None and percentile([None, math.nan], 50) is None
    assert math.isnan(percentile([], 50, empty=math.nan))


def test_nearest_rank_percentile() -> None:
    xs = [float(i) for i in range(1, 51)]  # p99 of 50 samples is the largest
    assert percentile(xs, 99, method="inverted_cdf") == 50.0
    assert percentile(xs, 50, method="inverted_cdf") == 25.0 and percentile(xs, 0) == 1.0


def test_cost_per_million() -> None:
    assert cost_per_million(8000, 8.20) == pytest.approx(0.28472, abs=1e-4)
    assert cost_per_million(0, 8.20) == math.inf
