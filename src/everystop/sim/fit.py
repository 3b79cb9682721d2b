"""Fit the cost model's coefficients to measured iterations of a real engine.

Same form as `cost_model.py` (no tensor parallelism on one CPU, so no comm term):

    latency = max(a * flops, b * bytes) + c0 + c1 * num_seqs

`max` makes this piecewise linear. We fit it by alternating: assign each record to the term that
binds under the current (a, b), solve a non-negative linear least-squares problem for
(a, b, c0, c1) with that assignment, and repeat until the assignment is stable; several starting
ratios are tried and the lowest squared error wins.

Record format (a JSON list; `IterationShape.from_scheduler_output` + the measured seconds gives
every field, only the first four are required):
    {"num_decode_tokens", "num_prefill_tokens", "context_tokens_read", "latency_s",
     "num_seqs", "attention_pairs", "num_sampled"}
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from everystop.sim.cost_model import Coefficients, CostModel, IterationShape
from everystop.sim.specs import ModelSpec


def load_records(path: str | Path) -> list[dict]:
    data = json.loads(Path(path).read_text())
    return data["iterations"] if isinstance(data, dict) else data


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: drop the most negative column and refit."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


def fit_coefficients(model: ModelSpec, records: list[dict], tp: int = 1,
                     max_rounds: int = 50) -> tuple[Coefficients, dict]:
    """Least-squares coefficients for `model` from measured `records`; also fit statistics."""
    cost = CostModel(model, tp, Coefficients(0.0, 0.0, 0.0))
    shapes = [IterationShape.from_record(r) for r in records]
    flops = np.array([cost.work(s).flops for s in shapes])
    nbytes = np.array([cost.work(s).bytes for s in shapes])
    seqs = np.array([s.num_seqs for s in shapes], dtype=float)
    y = np.array([float(r["latency_s"]) for r in records])
    best: tuple[float, np.ndarray] | None = None
    base_ratio = float(np.median(nbytes / flops))
    for scale in (1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0, 1e3):
        # Starting guess a/b = scale * median(bytes/flops): scale 1 splits the records evenly.
        compute_bound = scale * base_ratio * flops >= nbytes
        coef = np.zeros(4)
        for _ in range(max_rounds):
            x = np.column_stack([np.where(compute_bound, flops, 0.0),
                                 np.where(compute_bound, 0.0, nbytes), np.ones_like(y), seqs])
            coef = _nnls(x, y)
            a, b = coef[0], coef[1]
            new = a * flops >= b * nbytes if (a > 0 and b > 0) else compute_bound
            if (new == compute_bound).all():
                break
            compute_bound = new
        pred = np.maximum(coef[0] * flops, coef[1] * nbytes) + coef[2] + coef[3] * seqs
        sse = float(((pred - y) ** 2).sum())
        if best is None or sse < best[0]:
            best = (sse, coef)
    assert best is not None
    sse, coef = best
    coeffs = Coefficients(sec_per_flop=float(coef[0]), sec_per_byte=float(coef[1]),
                          overhead_s=float(coef[2]), overhead_per_seq_s=float(coef[3]))
    pred = np.array([CostModel(model, tp, coeffs).latency(s) for s in shapes])
    rel = np.abs(pred - y) / y
    stats = {"num_records": len(records), "rmse_s": float(np.sqrt(sse / len(records))),
             "mean_abs_rel_error": float(rel.mean()), "max_abs_rel_error": float(rel.max()),
             "r2": float(1 - sse / float(((y - y.mean()) ** 2).sum() or 1.0)),
             "fraction_compute_bound": float(np.mean(coef[0] * flops >= coef[1] * nbytes))}
    return coeffs, stats


def profile_shapes() -> list[IterationShape]:
    """A handful of iteration shapes worth measuring on a real engine: pure decodes across batch
    sizes and contexts, lone prefill chunks, and mixed passes."""
    shapes = []
    for batch in (1, 4, 16, 32, 64):
        for ctx in (64, 512):
            shapes.append(IterationShape(batch, batch, 0, batch * ctx, batch * ctx, batch))
    for chunk in (32, 128, 512):
        shapes.append(IterationShape(1, 0, chunk, chunk, chunk * (chunk + 1) // 2, 1))
    for batch, chunk in ((16, 256), (32, 512)):
        shapes.append(IterationShape(batch + 1, batch, chunk, batch * 256 + chunk,
                                     batch * 256 + chunk * (chunk + 1) // 2, batch + 1))
    return shapes
