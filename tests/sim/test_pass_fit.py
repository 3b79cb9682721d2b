"""Calibration (a)'s fit: the attention form recovers known coefficients, and on passes whose
attention runs slower than the GEMMs it beats the simulator's form, whose residuals then trend
with the attention share."""

import random

import numpy as np

from everystop.sim.cost_model import IterationShape
from everystop.sim.pass_fit import (
    AttentionFit,
    error_stats,
    features,
    fit_attention,
    predict,
    residual_by_attention_share,
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
