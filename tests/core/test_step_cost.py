"""The online step-cost model: seeded prior, convergence, tracking a machine that changes."""

from __future__ import annotations

import random

import pytest

from everystop.core.step_cost import SEED_PROMPT_TOKENS, StepCoefficients, StepCostModel, StepShape

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
