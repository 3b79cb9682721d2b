"""The preemption cost measurements are taken once per machine and model, then read back."""

from __future__ import annotations

from pathlib import Path

import pytest

from everystop.config import CACHE_ENV
from everystop.executor.measured_costs import cached_costs


def test_measured_once_then_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    calls: list[int] = []

    def measure() -> tuple[float, float]:
        calls.append(1)
        return 100.0 + len(calls), 1e9

    settings = {"dtype": "float32", "threads": 2}
    assert cached_costs(str(model), settings, measure) == (101.0, 1e9)
    assert cached_costs(str(model), settings, measure) == (101.0, 1e9)
    assert len(calls) == 1
    # Anything the numbers depend on is in the key: other settings, or a replaced file.
    assert cached_costs(str(model), {**settings, "threads": 1}, measure) == (102.0, 1e9)
    model.write_bytes(b"xy")
    assert cached_costs(str(model), settings, measure) == (103.0, 1e9)
    assert len(calls) == 3


def test_unwritable_cache_still_measures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker))  # a file where the directory should be
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    assert cached_costs(str(model), {}, lambda: (1.0, 2.0)) == (1.0, 2.0)
