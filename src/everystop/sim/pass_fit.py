"""Per-pass latency fits for calibration (a): the cost model's own form, and the same form with
the attention work on a coefficient of its own, judged on passes the fit did not see.

    base        t = max(a * flops, b * bytes) + c0 + c1 * seqs            (fit.py's form)
    attention   t = max(a * dense_flops, b * weight_bytes)
                    + e * attention_flops + f * kv_bytes + c0 + c1 * seqs

In the base form attention's FLOPs ride in `flops` at the GEMMs' rate and its KV reads in
`bytes`, inside the max: on a CPU the paged-attention kernel runs far below the GEMMs'
efficiency and does not overlap with them, so the residuals grew with the attention share of a
pass. The attention form prices it apart, outside the max.

    dense_flops      2 * layer_params * tokens + 2 * lm_head_params * sampled
    attention_flops  4 * layers * heads * head_dim * attention_pairs
    weight_bytes     the weights read once per pass
    kv_bytes         (context read + tokens written) * KV bytes per token

A third form, `fit_regimes`, is the cost model's extended form (cost_model.py): attention apart
as above, and the linears' kernel regime by the pass's token count (GEMVs that read the weights
once per 8 rows, or GEMMs that convert them once per pass). It is linear in its coefficients
once the GEMV row limit is fixed; the limit is chosen among the kernels' limits on the fitted
passes, and so is the chunk size from which a GEMV chunk runs narrower. Its result is a
`Coefficients` the simulator's `CostModel` takes as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from everystop.sim.cost_model import Coefficients, IterationShape, gemv_chunks
from everystop.sim.fit import _nnls
from everystop.sim.specs import ModelSpec
from everystop.stats import percentile

FEATURES = ("dense_flops", "weight_bytes", "attention_flops", "kv_bytes", "one", "seqs")


def features(model: ModelSpec, s: IterationShape) -> tuple[float, ...]:
    """The attention form's terms of one pass, in `FEATURES` order."""
    m = model
    return (2.0 * m.layer_params * s.num_tokens + 2.0 * m.lm_head_params * s.num_sampled,
            float(m.pass_weight_bytes),
            4.0 * m.num_layers * m.num_heads * m.head_dim * s.attention_pairs,
            float((s.context_tokens_read + s.num_tokens) * m.kv_bytes_per_token),
            1.0, float(s.num_seqs))


@dataclass(frozen=True)
class AttentionFit:
    """The attention form's coefficients (seconds per unit of each feature)."""

    sec_per_dense_flop: float
    sec_per_weight_byte: float
    sec_per_attention_flop: float
    sec_per_kv_byte: float
    overhead_s: float
    overhead_per_seq_s: float

    def predict_features(self, x: np.ndarray) -> np.ndarray:
        """Predicted seconds of passes given as rows of `features`."""
        return (np.maximum(self.sec_per_dense_flop * x[:, 0], self.sec_per_weight_byte * x[:, 1])
                + self.sec_per_attention_flop * x[:, 2] + self.sec_per_kv_byte * x[:, 3]
                + self.overhead_s + self.overhead_per_seq_s * x[:, 5])

    def to_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}


def fit_attention(model: ModelSpec, shapes: list[IterationShape], seconds: list[float],
                  max_rounds: int = 50, *, attention: bool = True) -> AttentionFit:
    """Least squares (coefficients >= 0) of relative errors: each pass weighs 1/its time, so
    a 6 ms decode counts as much as a 600 ms prefill (the goal is per pass). The max is fitted
    as fit.py fits it: assign each pass to the side that binds, solve, reassign until stable,
    from several starting splits; the lowest error wins.

    `attention=False` fits the simulator's own form on the same terms: attention FLOPs inside
    the compute side of the max, KV bytes inside the memory side (returned with e = f = 0 and
    the pooled sides, to predict through `predict_pooled`)."""
    x = np.array([features(model, s) for s in shapes])
    y = np.asarray(seconds, dtype=float)
    w = 1.0 / y
    if attention:
        compute_side, memory_side, extra = x[:, 0], x[:, 1], x[:, 2:4]
    else:
        compute_side, memory_side = x[:, 0] + x[:, 2], x[:, 1] + x[:, 3]
        extra = np.zeros((len(y), 2))
    best: tuple[float, np.ndarray] | None = None
    for q in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
        # Start: the passes above the q-quantile of the compute side are compute bound.
        compute = (compute_side > np.quantile(compute_side, q) if q < 1.0
                   else np.zeros(len(y), dtype=bool))
        coef = np.zeros(6)
        for _ in range(max_rounds):
            cols = np.column_stack([np.where(compute, compute_side, 0.0),
                                    np.where(compute, 0.0, memory_side), extra,
                                    x[:, 4], x[:, 5]])
            coef = _nnls(cols * w[:, None], y * w)
            if coef[0] <= 0 or coef[1] <= 0:
                break
            new = coef[0] * compute_side >= coef[1] * memory_side
            if (new == compute).all():
                break
            compute = new
        pred = (np.maximum(coef[0] * compute_side, coef[1] * memory_side) + extra @ coef[2:4]
                + coef[4] + coef[5] * x[:, 5])
        err = float((((pred - y) * w) ** 2).sum())
        if best is None or err < best[0]:
            best = (err, coef)
    assert best is not None
    return AttentionFit(*map(float, best[1]))


def predict(model: ModelSpec, fit: AttentionFit, shapes: list[IterationShape], *,
            attention: bool = True) -> list[float]:
    """Seconds per pass of a fit made with the same `attention` flag."""
    x = np.array([features(model, s) for s in shapes])
    if not attention:  # the pooled sides of the simulator's form
        x = x.copy()
        x[:, 0], x[:, 1] = x[:, 0] + x[:, 2], x[:, 1] + x[:, 3]
        x[:, 2] = x[:, 3] = 0.0
    return [float(t) for t in fit.predict_features(x)]


def error_stats(predicted: list[float], measured: list[float]) -> dict:
    """|predicted - measured| / measured over passes: median, p90, mean; and the signed total."""
    rel = [abs(p - m) / m for p, m in zip(predicted, measured)]
    return {"num_passes": len(rel), "median_abs_rel_error": round(percentile(rel, 50), 4),
            "p90_abs_rel_error": round(percentile(rel, 90), 4),
            "mean_abs_rel_error": round(sum(rel) / len(rel), 4),
            "total_rel_error": round((sum(predicted) - sum(measured)) / sum(measured), 4)}


def residual_by_attention_share(model: ModelSpec, shapes: list[IterationShape],
                                predicted: list[float], measured: list[float],
                                bins: int = 4) -> list[dict]:
    """Median signed (measured - predicted) / predicted per quantile bin of the passes'
    attention share of FLOPs: a model that misprices attention shows a trend across the bins
    (the median: a pass slowed 10x by another process must not swing its bin)."""
    share = []
    for s in shapes:
        f = features(model, s)
        share.append(f[2] / (f[0] + f[2]) if f[0] + f[2] else 0.0)
    order = sorted(range(len(shapes)), key=share.__getitem__)
    out = []
    for k in range(bins):
        idx = order[k * len(order) // bins:(k + 1) * len(order) // bins]
        if not idx:
            continue
        res = [(measured[i] - predicted[i]) / predicted[i] for i in idx]
        out.append({"attention_share_from": round(share[idx[0]], 4),
                    "attention_share_to": round(share[idx[-1]], 4), "num_passes": len(idx),
                    "median_rel_residual": round(percentile(res, 50), 4)})
    return out


# The regime form: the cost model's extended form (cost_model.py's docstring) with attention
# apart and the linears' kernel picked by the pass's token count, as the CPU engine picks it
# (layers/linear.py): GEMVs up to a row limit, 8 rows per chunk, each chunk reading every weight
# once; GEMMs above it, converting every (block-quantized) weight once per pass. Measured on the
# default model (1 torch thread): a decode pass costs ~3 ms more per row, and ~10 ms
# more at 7 rows than at 6 and at 9 than at 8 (csrc/quant_linear.cpp's kQCols: from 7 rows on
# AVX-512, 3 on AVX2, a chunk's accumulators leave registers for one output column per step);
# passes of 33+ tokens pay ~60 ms up front and ~1.3 ms per token.
GEMV_CHUNK_ROWS = 8  # csrc/quant_linear.cpp's kMaxSmallRows: the GEMV's rows per weight pass
# Where the GEMVs may stop (layers/linear.py: 8 for fp32 weights, 16 beside bf16 tiles, 32 for
# block and 16-bit weights; 64 in the ops); 0: one regime, every pass priced as a GEMM's.
GEMV_LIMITS = (0, 8, 16, 32, 64)
# Where a chunk turns narrow (kQCols: 7 with AVX-512, 3 with AVX2); 0: no narrow term.
GEMV_NARROW_ROWS = (0, 3, 7)
REGIME_TERMS = ("gemv_weight_reads", "gemv_narrow_weight_reads", "gemv_flops",
                "gemm_weight_bytes", "gemm_flops", "attention_flops", "kv_bytes", "one", "seqs")


def regime_features(model: ModelSpec, s: IterationShape, gemv_max_tokens: int,
                    narrow_rows: int = 0, chunk_rows: int = GEMV_CHUNK_ROWS
                    ) -> tuple[float, ...]:
    """The regime form's terms of one pass, in `REGIME_TERMS` order: the form is linear in its
    coefficients once the GEMV limit and the narrow chunks' rows are fixed."""
    dense, weights, attention, kv, one, seqs = features(model, s)
    if s.num_tokens <= gemv_max_tokens:
        chunks, narrow = gemv_chunks(s.num_tokens, chunk_rows, narrow_rows)
        return (chunks * weights, narrow * weights, dense, 0.0, 0.0, attention, kv, one, seqs)
    # With no GEMV regime the GEMMs' weight term is the constant column again: left out.
    return (0.0, 0.0, 0.0, weights if gemv_max_tokens else 0.0, dense, attention, kv, one, seqs)


def fit_regimes(model: ModelSpec, shapes: list[IterationShape], seconds: list[float],
                gemv_max_tokens: int, narrow_rows: int = 0, chunk_rows: int = GEMV_CHUNK_ROWS
                ) -> tuple[Coefficients, float]:
    """Least squares (coefficients >= 0) of relative errors, as `fit_attention`, of the regime
    form with the GEMVs up to `gemv_max_tokens` tokens; the cost model's coefficients and the
    fit's sum of squared relative errors."""
    x = np.array([regime_features(model, s, gemv_max_tokens, narrow_rows, chunk_rows)
                  for s in shapes])
    y = np.asarray(seconds, dtype=float)
    w = 1.0 / y
    coef = _nnls(x * w[:, None], y * w)
    sse = float((((x @ coef - y) * w) ** 2).sum())
    g_w, g_n, g_f, h_w, h_f, e, f, c0, c1 = map(float, coef)
    coeffs = Coefficients(sec_per_flop=h_f, sec_per_byte=0.0, overhead_s=c0,
                          overhead_per_seq_s=c1, attention_apart=True,
                          sec_per_attention_flop=e, sec_per_kv_byte=f,
                          gemv_max_tokens=gemv_max_tokens, gemv_chunk_rows=chunk_rows,
                          sec_per_gemv_weight_byte=g_w, gemv_narrow_rows=narrow_rows,
                          sec_per_gemv_narrow_weight_byte=g_n, sec_per_gemv_flop=g_f,
                          sec_per_gemm_weight_byte=h_w)
    return coeffs, sse


def fit_regimes_choosing(model: ModelSpec, shapes: list[IterationShape], seconds: list[float],
                         limits: tuple[int, ...] = GEMV_LIMITS,
                         narrow: tuple[int, ...] = GEMV_NARROW_ROWS
                         ) -> tuple[Coefficients, dict[str, float]]:
    """`fit_regimes` at each GEMV row limit of `limits` and narrow-chunk rows of `narrow`; the
    fit with the lowest error on these passes (the passes judged later take no part in the
    choice), and every pair's error, keyed "limit/narrow rows"."""
    fits = {(limit, rows): fit_regimes(model, shapes, seconds, limit, rows)
            for limit in limits for rows in narrow}
    best = min(fits, key=lambda key: fits[key][1])
    return fits[best][0], {f"{limit}/{rows}": round(sse, 4)
                           for (limit, rows), (_, sse) in fits.items()}


# Pass kinds for the residual table: the GEMV's chunks of 8 rows, and prefill-carrying passes on
# either side of the default GEMV limit (32 rows).
PASS_KINDS = (("decode, 1-8 rows", lambda s: not s.num_prefill_tokens and s.num_tokens <= 8),
              ("decode, 9-32 rows",
               lambda s: not s.num_prefill_tokens and 8 < s.num_tokens <= 32),
              ("decode, 33+ rows", lambda s: not s.num_prefill_tokens and s.num_tokens > 32),
              ("with prefill, <= 32 tokens",
               lambda s: s.num_prefill_tokens > 0 and s.num_tokens <= 32),
              ("with prefill, 33-128 tokens",
               lambda s: s.num_prefill_tokens > 0 and 32 < s.num_tokens <= 128),
              ("with prefill, 129+ tokens",
               lambda s: s.num_prefill_tokens > 0 and s.num_tokens > 128))


def residual_by_pass_kind(shapes: list[IterationShape], predicted: list[float],
                          measured: list[float]) -> list[dict]:
    """Per kind of pass (`PASS_KINDS`, the empty ones left out): how many, the median signed
    (measured - predicted) / predicted and the median |error| / measured."""
    out = []
    for name, is_kind in PASS_KINDS:
        idx = [i for i, s in enumerate(shapes) if is_kind(s)]
        if not idx:
            continue
        res = [(measured[i] - predicted[i]) / predicted[i] for i in idx]
        err = [abs(predicted[i] - measured[i]) / measured[i] for i in idx]
        out.append({"kind": name, "num_passes": len(idx),
                    "median_rel_residual": round(percentile(res, 50), 4),
                    "median_abs_rel_error": round(percentile(err, 50), 4)})
    return out


def repeatability(shapes: list[IterationShape], seconds: list[float], min_group: int = 10,
                  context_bucket: int = 128) -> dict:
    """How far the same work's time strayed within the run, with no model: pure decode passes
    grouped by rows and context per row (within `context_bucket` tokens), groups of at least
    `min_group` passes; each pass's |time / its group's median - 1|, median and p90 over them.
    On a shared machine this, not the model's form, bounds the per-pass error from below."""
    groups: dict[tuple[int, int], list[float]] = {}
    for s, t in zip(shapes, seconds):
        if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0:
            key = (s.num_decode_tokens,
                   s.context_tokens_read // s.num_decode_tokens // context_bucket)
            groups.setdefault(key, []).append(t)
    dev = []
    for times in groups.values():
        if len(times) >= min_group:
            mid = percentile(times, 50)
            dev += [abs(t / mid - 1.0) for t in times]
    if not dev:
        return {"num_passes": 0, "num_groups": 0}
    return {"num_passes": len(dev),
            "num_groups": sum(len(v) >= min_group for v in groups.values()),
            "median_abs_rel_deviation": round(percentile(dev, 50), 4),
            "p90_abs_rel_deviation": round(percentile(dev, 90), 4)}
