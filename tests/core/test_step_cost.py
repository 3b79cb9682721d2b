"""The online step-cost model: seeded prior, convergence, tracking a machine that changes."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from everystop.core.step_cost import (
    SEED_PROMPT_TOKENS,
    StepCoefficients,
    StepCostModel,
    StepShape,
    _gauss_solve,
    _gauss_solve4,
)

TRUE = StepCoefficients(fixed=0.030, prefill_token=0.0012, decode_row=0.0004,
                        context_token=2e-6)


def cost(c: StepCoefficients, s: StepShape) -> float:
    return sum(a * x for a, x in zip(c.as_tuple(), s.features()))


def random_shape(rng: random.Random) -> StepShape:
    """A serving mix: decode-only steps and mixed steps with a prefill chunk."""
    prefill = rng.choice([0, 0, rng.randint(1, 512)])
    rows = rng.randint(0, 64)
    context = rows * rng.randint(10, 1500) + prefill + (rng.randint(0, 2000) if prefill else 0)
    return StepShape(prefill, rows, context)


def test_prior_predicts_the_startup_measurement_before_any_step() -> None:
    model = StepCostModel.from_prefill_rate(640.0)  # a 64-token prompt took 100 ms
    t = model.predict(StepShape(SEED_PROMPT_TOKENS, 0, SEED_PROMPT_TOKENS))
    assert t == pytest.approx(0.1, rel=0.01)
    assert model.num_observations == 0


@pytest.mark.parametrize("seed", range(4))
def test_fit_converges_on_a_noisy_linear_cost_within_5_percent(seed: int) -> None:
    rng = random.Random(seed)
    model = StepCostModel.from_prefill_rate(5000.0)  # a prior far from the truth
    for _ in range(600):
        s = random_shape(rng)
        model.observe(s, cost(TRUE, s) * (1 + rng.gauss(0, 0.02)))
    fitted = model.coefficients
    for name in ("fixed", "prefill_token", "context_token"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=0.05), name
    held_out = [random_shape(rng) for _ in range(200)]
    worst = max(abs(model.predict(s) - cost(TRUE, s)) / cost(TRUE, s) for s in held_out)
    assert worst < 0.05


def test_fit_follows_a_machine_that_slows_down() -> None:
    rng = random.Random(7)
    model = StepCostModel.from_prefill_rate(5000.0)
    for _ in range(300):
        s = random_shape(rng)
        model.observe(s, cost(TRUE, s))
    slow = StepCoefficients(*(2 * c for c in TRUE.as_tuple()))
    for _ in range(300):  # the effective memory is ~50 steps
        s = random_shape(rng)
        model.observe(s, cost(slow, s))
    held_out = [random_shape(rng) for _ in range(100)]
    assert max(abs(model.predict(s) - cost(slow, s)) / cost(slow, s) for s in held_out) < 0.05
    assert model.last_measured_s > 0 and model.last_predicted_s > 0


def test_unmeasured_steps_teach_nothing() -> None:
    model = StepCostModel.from_prefill_rate(1000.0)
    before = model.coefficients
    model.observe(StepShape(10, 2, 100), 0.0)  # an executor that does not time itself
    model.observe(StepShape(10, 2, 100), float("nan"))
    assert model.coefficients == before and model.num_observations == 0


def test_a_feature_idle_for_long_keeps_its_coefficient() -> None:
    """No prefill for thousands of steps must not wind the covariance up into wild jumps."""
    rng = random.Random(3)
    model = StepCostModel.from_prefill_rate(5000.0)
    for _ in range(300):
        s = random_shape(rng)
        model.observe(s, cost(TRUE, s))
    for _ in range(3000):
        rows = rng.randint(1, 64)
        s = StepShape(0, rows, rows * rng.randint(10, 1500))
        model.observe(s, cost(TRUE, s) * (1 + rng.gauss(0, 0.02)))
    chunk = StepShape(256, 16, 16 * 800 + 256)
    assert model.predict(chunk) == pytest.approx(cost(TRUE, chunk), rel=0.10)



def _solve_by_rounds(a, b, prev, d) -> list[float]:
    """The active set as the textbook loop: every round through the general solver."""
    free = list(range(4))
    while True:
        sol = _gauss_solve([[a[i][j] + (d if i == j else 0.0) for j in free] for i in free],
                           [b[i] + d * prev[i] for i in free])
        theta = [0.0] * 4
        for k, i in enumerate(free):
            theta[i] = sol[k]
        negative = [i for i in free if theta[i] < 0]
        if not negative:
            return theta
        free = [i for i in free if i not in negative]
        if not free:
            return theta


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 256), st.integers(0, 10**6),
                          st.floats(1e-4, 2.0), st.booleans()), min_size=1, max_size=40),
       st.sampled_from([0.05, 1e-6, 3.0]))
def test_the_fit_written_out_solves_to_the_textbook_floats(steps, damping) -> None:
    # The fit's first round is straight-line code (_gauss_solve4): at every step it must give
    # the general loop's floats bit for bit, with coefficients pinned at 0 too (`cheaper`:
    # prefill makes a step cheaper, so its coefficient would come out negative).
    model = StepCostModel(StepCoefficients(0.01, 1e-4, 1e-4, 1e-7), damping=damping)
    for prefill, rows, context, seconds, cheaper in steps:
        prev = list(model._theta)
        model.observe(StepShape(prefill, rows, context),
                      seconds / (1 + 50 * prefill) if cheaper else seconds)
        assert model._theta == _solve_by_rounds(model._a, model._b, prev, damping)


def test_a_feature_that_makes_steps_cheaper_is_pinned_at_zero() -> None:
    # The active set's later rounds (after the written-out first one) at work.
    model = StepCostModel(StepCoefficients(0.01, 1e-4, 1e-4, 1e-7))
    for k in range(60):
        model.observe(StepShape(64 * (k % 4), 8, 4000), 0.02 - 0.00005 * 64 * (k % 4))
    assert model.coefficients.prefill_token == 0.0 and model.coefficients.fixed > 0


@settings(max_examples=250, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_subnormal=False) | st.sampled_from([0.0, 1.0, -1.0]),
                min_size=20, max_size=20))
def test_the_written_out_elimination_is_the_general_one(entries) -> None:
    # Any 4x4 system, pivots in any row, ties in |pivot| included: the same floats (or the
    # same ZeroDivisionError) as the general elimination, overflow to inf and nan included.
    a = [entries[r * 4:r * 4 + 4] for r in range(4)]
    b = entries[16:]
    try:
        expected = _gauss_solve(a, b)
    except ZeroDivisionError:
        with pytest.raises(ZeroDivisionError):
            _gauss_solve4([row + [b[i]] for i, row in enumerate(a)])
        return
    got = _gauss_solve4([row + [b[i]] for i, row in enumerate(a)])
    assert list(map(repr, got)) == list(map(repr, expected))  # bits: nan, inf, -0.0 alike
