"""The per-pass cost model respects physics and behaves monotonically."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from everystop.core.outputs import ScheduledSequence, SchedulerOutput
from everystop.sampling_params import SamplingParams
from everystop.sim.cost_model import (
    Coefficients,
    CostModel,
    IterationShape,
    decode_shape,
    gemv_chunks,
    prefill_shape,
)
from everystop.sim.specs import load_hardware, load_model

M70, A100 = load_model("llama-3-70b"), load_hardware("a100-80gb")
COST = CostModel.from_specs(M70, A100, 4)


@pytest.mark.parametrize("batch", [1, 8, 32, 128, 256])
@pytest.mark.parametrize("ctx", [1, 1024, 4096])
def test_decode_step_never_beats_reading_the_weights(batch, ctx):
    shape = decode_shape(batch, ctx)
    weight_floor = M70.pass_weight_bytes / 4 / A100.hbm_bandwidth
    kv_floor = batch * ctx * M70.kv_bytes_per_token / 4 / A100.hbm_bandwidth
    assert COST.roofline_s(shape) >= weight_floor + kv_floor
    assert COST.latency(shape) >= COST.roofline_s(shape)


def test_weight_floor_is_17ms_on_4xa100():
    # 70.55B params less the embedding table, BF16, over 4 GPUs at 2,039 GB/s.
    assert M70.pass_weight_bytes / 4 / A100.hbm_bandwidth == pytest.approx(0.01708, abs=2e-4)


def test_monotone_in_batch_and_context():
    lat = [COST.latency(decode_shape(b, 1024)) for b in (1, 2, 8, 32, 128, 256)]
    assert lat == sorted(lat) and lat[0] < lat[-1]
    per_token = [t / b for t, b in zip(lat, (1, 2, 8, 32, 128, 256))]
    assert per_token == sorted(per_token, reverse=True)
    ctx = [COST.latency(decode_shape(64, c)) for c in (128, 512, 2048, 8192)]
    assert ctx == sorted(ctx) and ctx[0] < ctx[-1]


def test_large_prefill_is_compute_bound_and_small_decode_memory_bound():
    big = COST.breakdown(prefill_shape(2048))
    assert big["compute_s"] > big["memory_s"]
    small = COST.breakdown(decode_shape(8, 512))
    assert small["memory_s"] > small["compute_s"]
    assert COST.breakdown(decode_shape(8, 512))["comm_s"] > 0
    assert CostModel.from_specs(M70, A100, 1).breakdown(decode_shape(8, 512))["comm_s"] == 0


def test_shape_from_scheduler_output():
    sp = SamplingParams(max_tokens=4)
    out = SchedulerOutput(scheduled=[
        ScheduledSequence("a", [5], 99, [0], True, sp),  # decode at context 100
        ScheduledSequence("b", list(range(10)), 20, [1, 2], False, sp, is_prefill=True),
    ], num_decode_tokens=1, num_prefill_tokens=10)
    s = IterationShape.from_scheduler_output(out)
    assert (s.num_seqs, s.num_tokens, s.num_sampled) == (2, 11, 1)
    assert s.context_tokens_read == 100 + 30
    assert s.attention_pairs == 100 + (10 * 20 + 55)


def test_latency_is_the_breakdown_summed_in_order():
    """latency() writes work()'s terms out (the fleet's hot path): the very same float as the
    breakdown summed in its order, tensor-parallel or not, swaps or not."""
    shapes = [decode_shape(1, 17), decode_shape(73, 900), prefill_shape(512, 384),
              IterationShape(num_seqs=74, num_decode_tokens=73, num_prefill_tokens=511,
                             context_tokens_read=70_001, attention_pairs=260_000,
                             num_sampled=73, num_swap_blocks=12)]
    for tp in (1, 2, 4, 8):
        model = CostModel.from_specs(M70, A100, tp)
        for shape in shapes:
            b = model.breakdown(shape)
            expected = (max(b["compute_s"], b["memory_s"]) + b["comm_s"] + b["overhead_s"]
                        + b["swap_s"])
            assert model.latency(shape) == expected


def test_the_roofline_form_is_the_default_and_prices_attention_inside_the_max():
    smol = load_model("smollm2-135m")
    c = Coefficients(sec_per_flop=1e-11, sec_per_byte=2e-11, overhead_s=1e-3,
                     overhead_per_seq_s=1e-4)
    for s in (decode_shape(5, 300), prefill_shape(200, start=40)):
        flops = (2 * smol.layer_params * s.num_tokens + 2 * smol.lm_head_params * s.num_sampled
                 + 4 * smol.num_layers * smol.num_heads * smol.head_dim * s.attention_pairs)
        nbytes = (smol.pass_weight_bytes
                  + (s.context_tokens_read + s.num_tokens) * smol.kv_bytes_per_token)
        expected = max(flops * 1e-11, nbytes * 2e-11) + 1e-3 + 1e-4 * s.num_seqs
        assert CostModel(smol, 1, c).latency(s) == pytest.approx(expected, rel=1e-12)


def test_the_regime_form_prices_gemv_chunks_gemm_conversions_and_attention_apart():
    smol = load_model("smollm2-135m")
    weights, kv_token = smol.pass_weight_bytes, smol.kv_bytes_per_token
    attn_per_pair = 4 * smol.num_layers * smol.num_heads * smol.head_dim
    per_row = 2 * smol.layer_params + 2 * smol.lm_head_params  # a decode row's dense FLOPs
    c = Coefficients(sec_per_flop=5e-12, sec_per_byte=1e-9, overhead_s=1e-3,
                     overhead_per_seq_s=5e-4, attention_apart=True, sec_per_attention_flop=2e-11,
                     sec_per_kv_byte=3e-11, gemv_max_tokens=32, gemv_chunk_rows=8,
                     sec_per_gemv_weight_byte=2e-11, gemv_narrow_rows=7,
                     sec_per_gemv_narrow_weight_byte=1e-11, sec_per_gemv_flop=7e-12,
                     sec_per_gemm_weight_byte=1e-10)
    cost = CostModel(smol, 1, c)

    def attention_and_overhead(s):
        return (attn_per_pair * s.attention_pairs * 2e-11
                + (s.context_tokens_read + s.num_tokens) * kv_token * 3e-11
                + 1e-3 + 5e-4 * s.num_seqs)

    for rows, chunks, narrow in ((1, 1, 0), (6, 1, 0), (7, 1, 1), (9, 2, 1), (15, 2, 2),
                                 (32, 4, 4)):
        s = decode_shape(rows, 200)
        expected = ((chunks * 2e-11 + narrow * 1e-11) * weights + rows * per_row * 7e-12
                    + attention_and_overhead(s))
        assert cost.latency(s) == pytest.approx(expected, rel=1e-12), rows
    # Past the GEMV limit: one conversion of every weight, then the max of the dense sides
    # (here the memory side binds: 1e-9 s per weight byte).
    s = prefill_shape(33)
    dense = 2 * smol.layer_params * 33 + 2 * smol.lm_head_params
    expected = (weights * 1e-10 + max(dense * 5e-12, weights * 1e-9)
                + attention_and_overhead(s))
    assert cost.latency(s) == pytest.approx(expected, rel=1e-12)
    parts = cost.breakdown(s)
    assert parts["weights_s"] == pytest.approx(weights * 1e-10)
    assert parts["memory_s"] > parts["compute_s"]
    assert parts["weights_s"] + parts["memory_s"] + parts["attention_s"] + parts["overhead_s"] \
        == pytest.approx(cost.latency(s), rel=1e-12)
    # The 9th row starts a second pass over the weights: the step the roofline form cannot draw.
    step = cost.latency(decode_shape(9, 200)) - cost.latency(decode_shape(8, 200))
    assert step > 3 * (cost.latency(decode_shape(6, 200)) - cost.latency(decode_shape(5, 200)))


@pytest.mark.parametrize(("rows", "narrow_rows", "expected"), [
    (1, 0, (1, 0)), (8, 0, (1, 0)), (9, 0, (2, 0)), (0, 7, (0, 0)), (6, 7, (1, 0)),
    (7, 7, (1, 1)), (16, 7, (2, 2)), (17, 7, (3, 2)), (23, 7, (3, 3)), (10, 3, (2, 1)),
    (11, 3, (2, 2))])
def test_gemv_chunks_counts_chunks_of_8_and_the_narrow_ones(rows, narrow_rows, expected):
    assert gemv_chunks(rows, 8, narrow_rows) == expected


@pytest.mark.parametrize("regime", [False, True])
def test_the_decode_fast_path_is_latency_of_the_decode_shape(regime):
    # A decode stretch plans each pass with decode_latency(n, context): the very same float
    # as latency() of the shape it stands for (roofline form written out; the regime form
    # falls back to latency itself).
    coeffs = Coefficients.from_hardware(A100)
    if regime:
        coeffs = Coefficients(sec_per_flop=5e-12, sec_per_byte=1e-9, overhead_s=1e-3,
                              attention_apart=True, sec_per_attention_flop=3e-12,
                              sec_per_kv_byte=2e-10)
    for model in (M70, load_model("smollm2-135m")):
        for tp in (1, 2, 4, 8):
            cost = CostModel(model, tp, coeffs, A100)
            for n, ctx in ((1, 1), (7, 901), (88, 53_117), (256, 1_048_576)):
                assert cost.decode_latency(n, ctx) == cost.latency(
                    IterationShape(n, n, 0, ctx, ctx, n)), (model.name, tp, n, ctx)


@settings(max_examples=300, deadline=None)
@given(seqs=st.integers(0, 512), decode=st.integers(0, 512), prefill=st.integers(0, 8192),
       context=st.integers(0, 1 << 22), pairs=st.integers(0, 1 << 26),
       sampled=st.integers(0, 512), swap=st.integers(0, 64), tp=st.sampled_from([1, 2, 4, 8]),
       hw=st.sampled_from(["a100-80gb", "h100-sxm"]),
       model=st.sampled_from(["llama-3-70b", "llama-3-8b", "smollm2-135m"]))
def test_no_pass_is_priced_below_the_floor(seqs, decode, prefill, context, pairs, sampled,
                                           swap, tp, hw, model):
    # The parallel fleet run applies a pass's end ahead of arrivals that come less than this
    # floor after its start (fleet_parallel): one pass priced below it, even by the last bit,
    # would reorder events.
    cost = CostModel.from_specs(load_model(model), load_hardware(hw), tp)
    floor = cost.min_latency_s()
    assert floor > 0
    shape = IterationShape(seqs, decode, prefill, context, pairs, sampled, swap)
    assert cost.latency(shape) >= floor
    assert cost.decode_latency(max(1, decode), context) >= floor


def test_the_extended_form_claims_no_floor():
    coeffs = Coefficients(sec_per_flop=5e-12, sec_per_byte=1e-9, overhead_s=1e-3,
                          attention_apart=True, sec_per_attention_flop=3e-12,
                          sec_per_kv_byte=2e-10)
    assert CostModel(M70, 4, coeffs, A100).min_latency_s() == 0.0
