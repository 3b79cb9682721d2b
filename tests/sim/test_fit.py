"""Fitting the cost model to measured iterations (synthetic measurements here)."""

import argparse
import random

import pytest

from everystop.sim import calibrate as sim_calibrate
from everystop.sim.cost_model import Coefficients, CostModel, IterationShape
from everystop.sim.fit import fit_coefficients, profile_shapes
from everystop.sim.specs import load_model
from everystop.workload import resolve_workload

SMOL = load_model("smollm2-135m")
TRUE = Coefficients(sec_per_flop=1 / 25e9, sec_per_byte=1 / 6e9, overhead_s=0.004,
                    overhead_per_seq_s=3e-4)


def _records(noise: float, seed: int = 0, minimal: bool = False) -> list[dict]:
    rng, cost = random.Random(seed), CostModel(SMOL, 1, TRUE)
    out = []
    for shape in profile_shapes() * 2:
        rec = {**shape.to_dict(), "latency_s": cost.latency(shape) * rng.uniform(1 - noise,
                                                                                1 + noise)}
        if minimal:
            rec = {k: rec[k] for k in ("num_decode_tokens", "num_prefill_tokens",
                                       "context_tokens_read", "latency_s")}
        out.append(rec)
    return out


def test_exact_records_recover_the_coefficients():
    coeffs, stats = fit_coefficients(SMOL, _records(0.0))
    assert coeffs.sec_per_flop == pytest.approx(TRUE.sec_per_flop, rel=1e-3)
    assert coeffs.sec_per_byte == pytest.approx(TRUE.sec_per_byte, rel=1e-3)
    assert coeffs.overhead_s == pytest.approx(TRUE.overhead_s, rel=1e-2)
    assert stats["max_abs_rel_error"] < 1e-3


def test_noisy_records_fit_within_noise():
    coeffs, stats = fit_coefficients(SMOL, _records(0.05, seed=1))
    assert coeffs.sec_per_flop == pytest.approx(TRUE.sec_per_flop, rel=0.1)
    assert coeffs.sec_per_byte == pytest.approx(TRUE.sec_per_byte, rel=0.1)
    assert stats["mean_abs_rel_error"] < 0.05 and stats["r2"] > 0.98


def test_minimal_record_format_is_accepted():
    _, stats = fit_coefficients(SMOL, _records(0.0, minimal=True))
    assert stats["r2"] > 0.95
    shape = IterationShape.from_record({"num_decode_tokens": 4, "num_prefill_tokens": 0,
                                        "context_tokens_read": 400})
    assert (shape.num_seqs, shape.attention_pairs) == (4, 400)


def test_calibration_pipeline_predicts_another_workload():
    model = SMOL
    args = argparse.Namespace(num_gpu_blocks=None, kv_cache_memory=float(1 << 30),
                                            max_num_seqs=16, max_num_batched_tokens=512,
                                            chunk_size=128, max_model_len=1024)
    setup = sim_calibrate.cpu_setup(model, args)
    workload = resolve_workload("n=24,prompt=uniform:16:200,output=uniform:4:40,"
                                              "rate=0.5,seed=4")
    truth = sim_calibrate.self_test(model, workload, setup, seed=3)
    coeffs, _ = fit_coefficients(model, truth["records"])
    errors = sim_calibrate.errors(sim_calibrate.predict(model, coeffs, workload, setup),
                                  truth["measured"])
    assert set(errors) >= {"output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms"}
    assert all(abs(e) < 0.10 for e in errors.values()), errors
