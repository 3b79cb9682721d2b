"""What one forward pass costs here: a linear model of its shape, fitted online.

    step_s = fixed + per_prefill_token * prefill_tokens + per_decode_row * decode_rows
                   + per_context_token * context_tokens

`context_tokens` is the sum of the scheduled rows' context lengths after the step (the KV that
attention reads). The coefficients are fitted by recursive least squares with a forgetting
factor, so the model follows the machine (thermal limits, a noisy neighbour, a new kernel) with
an effective memory of about 1 / (1 - forgetting) steps. Before any step has run it predicts
from a prior seeded by the start-up prefill measurement (`PreemptionCostModel`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from everystop.core.outputs import SchedulerOutput

FEATURES = ("fixed", "prefill_token", "decode_row", "context_token")
# Typical magnitude of each feature: the fit runs on features divided by these, so that one
# prior variance suits all four (raw magnitudes span 1 to 1e5).
_SCALES = (1.0, 256.0, 64.0, 16384.0)
# The start-up measurement runs one prompt of this many tokens (ModelRunner's default).
SEED_PROMPT_TOKENS = 64


@dataclass(frozen=True)
class StepShape:
    """The features of one forward pass."""

    num_prefill_tokens: int = 0
    num_decode_rows: int = 0
    context_tokens: int = 0

    @classmethod
    def from_output(cls, out: SchedulerOutput) -> "StepShape":
        return cls(out.num_prefill_tokens, out.num_decode_tokens,
                   sum(e.seq_len for e in out.scheduled))

    def features(self) -> tuple[float, float, float, float]:
        return (1.0, float(self.num_prefill_tokens), float(self.num_decode_rows),
                float(self.context_tokens))


@dataclass(frozen=True)
class StepCoefficients:
    """Seconds per unit of each feature."""

    fixed: float
    prefill_token: float
    decode_row: float
    context_token: float

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (self.fixed, self.prefill_token, self.decode_row, self.context_token)

    def to_dict(self) -> dict[str, float]:
        return dict(zip(FEATURES, self.as_tuple()))


class StepCostModel:
    """Exponentially weighted recursive least squares over the four features.

    Coefficients are kept non-negative (a step never gets cheaper by adding work; projecting
    keeps the budget arithmetic monotone), and the covariance is capped at the prior's, so a
    feature that stays constant for a long time (no prefill all night) cannot wind it up.
    """

    def __init__(self, prior: StepCoefficients, *, forgetting: float = 0.98,
                 prior_variance: float = 1.0) -> None:
        if not 0.5 < forgetting <= 1.0:
            raise ValueError("forgetting must be in (0.5, 1]")
        self.prior = prior
        self.forgetting = forgetting
        # theta and P live in scaled units (see _SCALES).
        self._theta = [c * s for c, s in zip(prior.as_tuple(), _SCALES)]
        self._p = [[prior_variance if i == j else 0.0 for j in range(4)] for i in range(4)]
        self._p_trace_cap = 4 * prior_variance
        self.num_observations = 0
        self.last_predicted_s = 0.0
        self.last_measured_s = 0.0

    @classmethod
    def from_prefill_rate(cls, prefill_tokens_per_s: float, **kwargs: float) -> "StepCostModel":
        """A prior from one measured prompt of SEED_PROMPT_TOKENS tokens: a quarter of its time
        taken as fixed per-step cost, the rest per token; a decode row priced like a prefill
        token; a context token at 1/1000 of one (attention reads are cheap next to the
        matmuls). Rough by design: the fit replaces it within a few dozen steps."""
        t = SEED_PROMPT_TOKENS / max(prefill_tokens_per_s, 1e-9)
        per_token = 0.75 * t / SEED_PROMPT_TOKENS
        return cls(StepCoefficients(0.25 * t, per_token, per_token, per_token / 1000), **kwargs)

    @property
    def coefficients(self) -> StepCoefficients:
        c = [t / s for t, s in zip(self._theta, _SCALES)]
        return StepCoefficients(c[0], c[1], c[2], c[3])

    def predict(self, shape: StepShape) -> float:
        return sum(c * x for c, x in zip(self.coefficients.as_tuple(), shape.features()))

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Fold one measured step in (RLS update with forgetting)."""
        if not seconds > 0 or math.isinf(seconds):
            return
        self.last_predicted_s = self.predict(shape)
        self.last_measured_s = seconds
        x = [f / s for f, s in zip(shape.features(), _SCALES)]
        p, lam = self._p, self.forgetting
        px = [sum(p[i][j] * x[j] for j in range(4)) for i in range(4)]
        denom = lam + sum(x[i] * px[i] for i in range(4))
        gain = [v / denom for v in px]
        err = seconds - sum(t * v for t, v in zip(self._theta, x))
        self._theta = [max(0.0, t + g * err) for t, g in zip(self._theta, gain)]
        self._p = [[(p[i][j] - gain[i] * px[j]) / lam for j in range(4)] for i in range(4)]
        trace = sum(self._p[i][i] for i in range(4))
        if trace > self._p_trace_cap:
            scale = self._p_trace_cap / trace
            self._p = [[v * scale for v in row] for row in self._p]
        self.num_observations += 1

