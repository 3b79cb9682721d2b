"""Calibration (a)'s fits: the attention form recovers known coefficients, and on passes whose
attention runs slower than the GEMMs it beats the simulator's form, whose residuals then trend
with the attention share; the regime form (GEMVs up to a row limit, GEMMs above) recovers its
limit and coefficients, as the simulator's CostModel computes them."""

import json
import random

import numpy as np
import pytest

from everystop.sim.cost_model import (
    Coefficients,
    CostModel,
    IterationShape,
    decode_shape,
    prefill_shape,
)
from everystop.sim.pass_fit import (
    AttentionFit,
    error_stats,
    features,
    fit_attention,
    fit_regimes_choosing,
    predict,
    regime_features,
    repeatability,
    residual_by_attention_share,
    residual_by_pass_kind,
)
from everystop.sim.specs import load_model

TRUE = AttentionFit(sec_per_dense_flop=2e-11, sec_per_weight_byte=1e-10,
                    sec_per_attention_flop=2e-10, sec_per_kv_byte=0.0, overhead_s=2e-3,
                    overhead_per_seq_s=1e-4)


def _passes(n: int, seed: int) -> list[IterationShape]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        decodes, ctx = rng.randrange(0, 24), rng.randrange(16, 900)
        chunk, start = rng.choice((0, 0, rng.randrange(8, 256))), rng.randrange(0, 600)
        pairs = decodes * ctx + chunk * start + chunk * (chunk + 1) // 2
        if decodes + chunk == 0:
            decodes = 1
        out.append(IterationShape(decodes + bool(chunk), decodes, chunk,
                                  decodes * ctx + start + chunk, pairs, decodes + bool(chunk)))
    return out


def test_the_attention_form_recovers_its_coefficients_and_beats_the_base_form():
    model = load_model("smollm2-135m")
    train, test = _passes(300, 1), _passes(200, 2)
    rng = np.random.default_rng(0)

    def measure(shapes):
        x = np.array([features(model, s) for s in shapes])
        return list(TRUE.predict_features(x) * rng.normal(1.0, 0.01, len(shapes)))

    y_train, y_test = measure(train), measure(test)
    fit = fit_attention(model, train, y_train)
    assert abs(fit.sec_per_attention_flop / TRUE.sec_per_attention_flop - 1) < 0.1
    assert abs(fit.overhead_s / TRUE.overhead_s - 1) < 0.2
    pred = predict(model, fit, test)
    attn = error_stats(pred, y_test)
    assert attn["median_abs_rel_error"] < 0.02 and attn["p90_abs_rel_error"] < 0.04

    base_fit = fit_attention(model, train, y_train, attention=False)
    assert base_fit.sec_per_attention_flop == base_fit.sec_per_kv_byte == 0.0
    base_pred = predict(model, base_fit, test, attention=False)
    assert error_stats(base_pred, y_test)["median_abs_rel_error"] > attn["median_abs_rel_error"]
    bins = residual_by_attention_share(model, test, base_pred, y_test)
    assert len(bins) == 4 and bins[-1]["median_rel_residual"] > bins[0]["median_rel_residual"]


# A CPU whose linears run as GEMVs up to 32 tokens (each chunk of 8 rows reads the weights
# again, a chunk of 7-8 rows once more) and as GEMMs above (every weight converted once per
# pass), with attention apart.
TRUE_REGIMES = Coefficients(sec_per_flop=5e-12, sec_per_byte=0.0, overhead_s=1e-3,
                            overhead_per_seq_s=5e-4, attention_apart=True,
                            sec_per_attention_flop=1.5e-11, sec_per_kv_byte=2e-11,
                            gemv_max_tokens=32, gemv_chunk_rows=8,
                            sec_per_gemv_weight_byte=2e-11, gemv_narrow_rows=7,
                            sec_per_gemv_narrow_weight_byte=1.5e-11, sec_per_gemv_flop=6e-12,
                            sec_per_gemm_weight_byte=1e-10)


def test_regime_features_times_the_coefficients_are_the_cost_models_latency():
    model = load_model("smollm2-135m")
    c = TRUE_REGIMES
    coef = np.array([c.sec_per_gemv_weight_byte, c.sec_per_gemv_narrow_weight_byte,
                     c.sec_per_gemv_flop, c.sec_per_gemm_weight_byte, c.sec_per_flop,
                     c.sec_per_attention_flop, c.sec_per_kv_byte, c.overhead_s,
                     c.overhead_per_seq_s])
    cost = CostModel(model, 1, c)
    for s in _passes(200, 3):
        x = np.array(regime_features(model, s, c.gemv_max_tokens, c.gemv_narrow_rows,
                                     c.gemv_chunk_rows))
        assert float(x @ coef) == pytest.approx(cost.latency(s), rel=1e-12)


def test_the_regime_form_recovers_its_limits_and_coefficients_and_beats_the_other_forms():
    model = load_model("smollm2-135m")
    train, test = _passes(400, 4), _passes(300, 5)
    rng = np.random.default_rng(1)
    cost = CostModel(model, 1, TRUE_REGIMES)

    def measure(shapes):
        return [cost.latency(s) * rng.normal(1.0, 0.01) for s in shapes]

    y_train, y_test = measure(train), measure(test)
    fit, sse = fit_regimes_choosing(model, train, y_train)
    assert (fit.gemv_max_tokens, fit.gemv_narrow_rows) == (32, 7) and len(sse) == 5 * 3
    assert min(sse.values()) == sse["32/7"] < min(sse["16/7"], sse["32/0"], sse["32/3"])
    for name in ("sec_per_gemv_weight_byte", "sec_per_gemv_narrow_weight_byte",
                 "sec_per_gemv_flop", "sec_per_gemm_weight_byte", "sec_per_flop",
                 "sec_per_attention_flop"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE_REGIMES, name), rel=0.15), name
    fitted = CostModel(model, 1, fit)
    pred = [fitted.latency(s) for s in test]
    regimes = error_stats(pred, y_test)
    assert regimes["median_abs_rel_error"] < 0.02 and regimes["p90_abs_rel_error"] < 0.04

    attn_fit = fit_attention(model, train, y_train)
    attn = error_stats(predict(model, attn_fit, test), y_test)
    assert attn["p90_abs_rel_error"] > 2 * regimes["p90_abs_rel_error"]
    # Where the single-regime form goes wrong: the GEMV passes just under the limit and the
    # GEMM passes just over it, priced on one line.
    kinds = {k["kind"]: k for k in residual_by_pass_kind(test, predict(model, attn_fit, test),
                                                        y_test)}
    by_regime = {k["kind"]: k for k in residual_by_pass_kind(test, pred, y_test)}
    assert set(kinds) == set(by_regime)
    assert max(k["median_abs_rel_error"] for k in by_regime.values()) < 0.02
    assert max(k["median_abs_rel_error"] for k in kinds.values()) > 0.05


def test_residual_by_pass_kind_sorts_passes_by_rows_and_prefill():
    decode = [decode_shape(b, 100) for b in (1, 8, 9, 32, 33)]
    prefill = [prefill_shape(n) for n in (16, 32, 33, 128, 129)]
    shapes = decode + prefill
    measured = [1.0] * len(shapes)
    predicted = [0.5] * 5 + [2.0] * 5
    kinds = residual_by_pass_kind(shapes, predicted, measured)
    assert [(k["kind"], k["num_passes"]) for k in kinds] == [
        ("decode, 1-8 rows", 2), ("decode, 9-32 rows", 2), ("decode, 33+ rows", 1),
        ("with prefill, <= 32 tokens", 2), ("with prefill, 33-128 tokens", 2),
        ("with prefill, 129+ tokens", 1)]
    assert kinds[0]["median_rel_residual"] == 1.0 and kinds[0]["median_abs_rel_error"] == 0.5
    assert kinds[-1]["median_rel_residual"] == -0.5 and kinds[-1]["median_abs_rel_error"] == 1.0


def test_a_regime_fit_reaches_the_simulator_through_its_json():
    # sim-pass-calibrate writes Coefficients.to_dict(); a simulation reads it back as is.
    model = load_model("smollm2-135m")
    shapes = _passes(120, 6)
    cost = CostModel(model, 1, TRUE_REGIMES)
    fit, _ = fit_regimes_choosing(model, shapes, [cost.latency(s) for s in shapes])
    read_back = Coefficients(**json.loads(json.dumps(fit.to_dict())))
    assert read_back == fit
    assert [CostModel(model, 1, read_back).latency(s) for s in shapes] == \
        [CostModel(model, 1, fit).latency(s) for s in shapes]


def test_repeatability_measures_the_spread_of_the_same_decode_passes_only():
    same = [decode_shape(4, 300)] * 10  # one group: rows 4, context 300 per row
    times = [1.0] * 8 + [1.5, 0.5]
    other = [decode_shape(4, 700)] * 3 + [prefill_shape(64)] * 20  # too few / not decodes
    rep = repeatability(same + other, times + [9.0] * 3 + [5.0] * 20)
    assert (rep["num_passes"], rep["num_groups"]) == (10, 1)
    assert rep["median_abs_rel_deviation"] == 0.0 and rep["p90_abs_rel_deviation"] == 0.5
    assert repeatability(other, [1.0] * 23) == {"num_passes": 0, "num_groups": 0}
