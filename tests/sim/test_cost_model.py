"""The per-pass cost model respects physics and behaves monotonically."""

import pytest

from everystop.core.outputs import ScheduledSequence, SchedulerOutput
from everystop.sampling_params import SamplingParams
from everystop.sim.cost_model import CostModel, IterationShape, decode_shape, prefill_shape
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
