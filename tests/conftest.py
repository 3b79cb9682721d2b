"""Suite-wide fixtures."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest


def _hypothesis_profile() -> None:
    """Property tests draw the same examples on every run (derandomize: a seed from each test's
    source) with no per-example deadline and no "data generation too slow" health check: what
    a run finds must not hang on the run's luck or on how loaded the host is. `pytest
    --hypothesis-profile explore` draws fresh examples, to look for new counterexamples."""
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # PyPy's run of the fleet tests (tests/sim/test_fleet_pypy.py)
        return
    settings.register_profile("everystop", deadline=None, derandomize=True,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("explore", settings.get_profile("everystop"), derandomize=False)
    settings.load_profile("everystop")


_hypothesis_profile()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection imported (torch, transformers, every test module: ~1M objects), so
    the per-test collection below walks only what tests allocate: a full pass over the imports
    took 0.5-8 s, after every one of ~2,000 tests. Frozen objects are still freed by reference
    counting; only cycles among them would stay. PyPy (tests/sim/test_fleet_pypy.py runs this
    suite's fleet tests there) has no permanent generation: nothing to freeze."""
    if hasattr(gc, "freeze"):
        gc.collect()
        gc.freeze()


HEAVY_MARKS = ("model", "slow", "server")  # in order: the default model, long runs, a server


def _weight(item: pytest.Item) -> int:
    return next((i for i, mark in enumerate(HEAVY_MARKS) if item.get_closest_marker(mark)),
                len(HEAVY_MARKS))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Heavy modules first, then the rest by size, largest first: `make test` hands whole modules
    to two workers in this order (--dist loadfile --no-loadscope-reorder), so the quick modules
    fill in at the end and neither worker waits long on a model test at the other's finish."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(modules.values(), key=lambda group: (min(map(_weight, group)), -len(group)))
    items[:] = [item for group in order for item in group]


@pytest.fixture(autouse=True)
def _release_engines() -> Iterator[None]:
    """Engines hold KV pools of hundreds of MiB; collect any left in reference cycles after each
    test so a long suite's memory stays flat on a 24 GiB machine. Then freeze again if the test
    unfroze the heap (the fleet simulator does, and the runtime-stats test): otherwise every
    later test in the module walked it all again. What this freezes is only what is still alive
    (the module's fixtures: no module that runs the simulator holds an engine in one)."""
    yield
    gc.collect()
    if hasattr(gc, "freeze") and gc.get_freeze_count() == 0:
        gc.freeze()


@pytest.fixture(scope="session")
def hf_float32_model() -> Any:
    """transformers' own model on the default GGUF's weights, float32: the reference the
    server-side logprob tests compare with. Loaded once per session (parsing and
    dequantizing the GGUF takes transformers tens of seconds on a busy CPU)."""
    import os

    import torch
    import transformers

    from everystop.executor.models.loader import default_model_path

    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
