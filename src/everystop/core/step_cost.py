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
    def from_output(cls, out: SchedulerOutput) -> StepShape:
        context = out.bulk_context_tokens
        for e in out.scheduled:  # sum(e.seq_len ...) without a property call per row
            context += e.start_pos + len(e.token_ids)
        # A verified proposal runs as a prefill token does (one more query row of a sequence).
        return cls(out.num_prefill_tokens + out.num_draft_tokens, out.num_decode_tokens, context)

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
    """Exponentially weighted least squares over the four features, re-solved at every step.

    The normal equations decay by `forgetting` per step, plus a small damping toward the
    previous estimate: a direction the recent steps do not excite (no prefill all night, a
    decode batch that never changes size) keeps its last value instead of drifting or blowing
    up. Coefficients are kept non-negative by an active set (a step never gets cheaper by adding
    work, which keeps the budget arithmetic monotone).
    """

    def __init__(self, prior: StepCoefficients, *, forgetting: float = 0.98,
                 damping: float = 0.05) -> None:
        if not 0.5 < forgetting <= 1.0 or not damping > 0:
            raise ValueError("forgetting must be in (0.5, 1] and damping > 0")
        self.prior = prior
        self.forgetting = forgetting
        self.damping = damping
        # The estimate and the normal equations live in scaled units (see _SCALES).
        self._theta = [c * s for c, s in zip(prior.as_tuple(), _SCALES)]
        self._a = [[0.0] * 4 for _ in range(4)]
        self._b = [0.0] * 4
        self.num_observations = 0
        self.last_predicted_s = 0.0
        self.last_measured_s = 0.0

    @classmethod
    def from_prefill_rate(cls, prefill_tokens_per_s: float, **kwargs: float) -> StepCostModel:
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

    def prefill_tokens_per_s(self) -> float:
        """The rate the start-up measurement takes (one SEED_PROMPT_TOKENS prompt alone), as
        this fit predicts it: what the preemption cost model's figure should be now."""
        seconds = self.predict(StepShape(SEED_PROMPT_TOKENS, 0, SEED_PROMPT_TOKENS))
        return SEED_PROMPT_TOKENS / seconds if seconds > 0 else math.inf

    def predict(self, shape: StepShape) -> float:
        # `coefficients` without the dataclass (once per pass): the same divisions and sum.
        return sum([t / s * x for t, s, x in zip(self._theta, _SCALES, shape.features())])

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Fold one measured step in and re-solve."""
        if not seconds > 0 or math.isinf(seconds):
            return
        self.last_predicted_s = self.predict(shape)
        self.last_measured_s = seconds
        x = [f / s for f, s in zip(shape.features(), _SCALES)]
        lam = self.forgetting
        # Once per pass (the simulator's hot path): row by row, the same arithmetic.
        self._b = [lam * b + xi * seconds for b, xi in zip(self._b, x)]
        self._a = [[lam * a + xi * xj for a, xj in zip(row, x)] for row, xi in zip(self._a, x)]
        self._theta = self._solve()
        self.num_observations += 1

    def _solve(self) -> list[float]:
        """argmin over theta >= 0 of the damped least-squares objective (active set: a
        coefficient that comes out negative is pinned at 0 and the rest re-solved)."""
        d = self.damping
        a, b, prev = self._a, self._b, self._theta
        # The first round, with all four free (the usual answer), straight-line: once per pass.
        theta = _gauss_solve4([
            [a[0][0] + d, a[0][1] + 0.0, a[0][2] + 0.0, a[0][3] + 0.0, b[0] + d * prev[0]],
            [a[1][0] + 0.0, a[1][1] + d, a[1][2] + 0.0, a[1][3] + 0.0, b[1] + d * prev[1]],
            [a[2][0] + 0.0, a[2][1] + 0.0, a[2][2] + d, a[2][3] + 0.0, b[2] + d * prev[2]],
            [a[3][0] + 0.0, a[3][1] + 0.0, a[3][2] + 0.0, a[3][3] + d, b[3] + d * prev[3]]])
        free = [i for i in range(4) if not theta[i] < 0]
        while len(free) < 4:
            if not free:
                return theta
            sub_a = [[a[i][j] + (d if i == j else 0.0) for j in free] for i in free]
            sub_b = [b[i] + d * prev[i] for i in free]
            sol = _gauss_solve(sub_a, sub_b)
            theta = [0.0] * 4
            for k, i in enumerate(free):
                theta[i] = sol[k]
            negative = [i for i in free if theta[i] < 0]
            if not negative:
                return theta
            free = [i for i in free if i not in negative]
        return theta


def _gauss_solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve a small symmetric positive-definite system (Gaussian elimination, pivoting)."""
    # NOTE: runs once per pass; rows are bound once, the arithmetic is the textbook one.
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot, largest = col, abs(m[col][col])  # max(..., key=abs): the first largest
        for r in range(col + 1, n):
            v = abs(m[r][col])
            if v > largest:
                pivot, largest = r, v
        m[col], m[pivot] = m[pivot], m[col]
        top = m[col]
        for r in range(col + 1, n):
            row = m[r]
            f = row[col] / top[col]
            for c in range(col, n + 1):
                row[c] -= f * top[c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        row = m[r]
        done = 0.0  # summed left to right, as sum() of floats did before Python 3.12
        for c in range(r + 1, n):
            done += row[c] * x[c]
        x[r] = (row[n] - done) / row[r]
    return x


def _gauss_solve4(m: list[list[float]]) -> list[float]:
    """_gauss_solve of a 4x4 system given as its augmented rows (changed in place), written
    out: the same operations in the same order, so the same floats (a column's own entries
    below the pivot are left uncomputed: nothing reads them again)."""
    for col in range(3):
        pivot, largest = col, abs(m[col][col])
        for r in range(col + 1, 4):
            v = abs(m[r][col])
            if v > largest:
                pivot, largest = r, v
        m[col], m[pivot] = m[pivot], m[col]
        top = m[col]
        t = top[col]
        if col == 0:
            _, t1, t2, t3, t4 = top
            for row in (m[1], m[2], m[3]):
                f = row[0] / t
                row[1] -= f * t1
                row[2] -= f * t2
                row[3] -= f * t3
                row[4] -= f * t4
        elif col == 1:
            t2, t3, t4 = top[2], top[3], top[4]
            for row in (m[2], m[3]):
                f = row[1] / t
                row[2] -= f * t2
                row[3] -= f * t3
                row[4] -= f * t4
        else:
            row = m[3]
            f = row[2] / t
            row[3] -= f * top[3]
            row[4] -= f * top[4]
    m0, m1, m2, m3 = m
    x3 = (m3[4] - 0.0) / m3[3]
    x2 = (m2[4] - (0.0 + m2[3] * x3)) / m2[2]
    x1 = (m1[4] - (0.0 + m1[2] * x2 + m1[3] * x3)) / m1[1]
    x0 = (m0[4] - (0.0 + m0[1] * x1 + m0[2] * x2 + m0[3] * x3)) / m0[0]
    return [x0, x1, x2, x3]
