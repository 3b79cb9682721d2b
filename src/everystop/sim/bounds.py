"""Physical bounds for the design's targets, from the same specs and cost model.

The roofline numbers use peak FLOPs and full HBM bandwidth with no communication or overhead:
no implementation can beat them. The "modeled" numbers add the efficiency assumptions, NVLink
all-reduces and per-iteration overhead of `cost_model.py`.
"""

from __future__ import annotations

from everystop.sim.capacity import kv_capacity
from everystop.sim.cost_model import CostModel, decode_shape, prefill_shape
from everystop.sim.specs import HardwareSpec, ModelSpec

TARGET_TOK_S = 8000.0
TARGET_CONCURRENCY = 128
TARGET_TPOT_P50_S = 0.016
TARGET_TTFT_P50_S = 0.080
TARGET_TTFT_P99_S = 0.200
TARGET_PROMPT = 1024


def _min_batch_for(rate: float, step_s, limit: int) -> int | None:
    """Smallest decode batch whose steps produce `rate` tokens/s, or None up to `limit`."""
    for b in range(1, limit + 1):
        if b / step_s(b) >= rate:
            return b
    return None


def _max_prompt_within(seconds: float, step_s) -> int:
    lo, hi = 0, 65536
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if step_s(mid) <= seconds else (lo, mid - 1)
    return lo


def target_bounds(model: ModelSpec, hw: HardwareSpec, tp: int, context_len: int = 1024) -> dict:
    """Every design target against the roofline and the modeled latency on (hw, tp).

    `context_len` is the average context of the decoding sequences (1,024 = a full-length
    prompt of the design's TTFT target, before any output)."""
    cost = CostModel.from_specs(model, hw, tp)
    cap = kv_capacity(model, hw, tp)
    ceiling = cap.max_seqs(context_len)

    def roof(b: int) -> float:
        return cost.roofline_s(decode_shape(b, context_len))

    def modeled(b: int) -> float:
        return cost.latency(decode_shape(b, context_len))

    weight_floor = model.pass_weight_bytes / tp / hw.hbm_bandwidth
    flops_per_token = 2 * model.num_params  # the linear layers alone, ignoring attention
    compute_ceiling = tp * hw.peak_flops / flops_per_token
    b128 = TARGET_CONCURRENCY
    return {
        "hardware": hw.key, "tp": tp, "model": model.key, "context_len": context_len,
        "kv_blocks": cap.num_blocks, "max_seqs_at_context": ceiling,
        "weight_bytes_per_gpu": model.weight_bytes / tp,
        "pass_weight_bytes_per_gpu": model.pass_weight_bytes / tp,
        "decode_weight_read_floor_ms": weight_floor * 1e3,
        "decode_step_ms_at_128": {"roofline": roof(b128) * 1e3, "modeled": modeled(b128) * 1e3},
        "decode_step_ms_at_1": {"roofline": roof(1) * 1e3, "modeled": modeled(1) * 1e3},
        "tok_s_at_128": {"roofline": b128 / roof(b128), "modeled": b128 / modeled(b128)},
        "linear_flops_ceiling_tok_s": compute_ceiling,
        "mfu_needed_for_8000_decode_only": TARGET_TOK_S / compute_ceiling,
        "min_batch_for_8000": {"roofline": _min_batch_for(TARGET_TOK_S, roof, ceiling),
                               "modeled": _min_batch_for(TARGET_TOK_S, modeled, ceiling)},
        "prefill_ms_1024_alone": {
            "roofline": cost.roofline_s(prefill_shape(TARGET_PROMPT)) * 1e3,
            "modeled": cost.latency(prefill_shape(TARGET_PROMPT)) * 1e3},
        "max_prompt_for_ttft_80ms_alone": {
            "roofline": _max_prompt_within(TARGET_TTFT_P50_S,
                                           lambda n: cost.roofline_s(prefill_shape(n))),
            "modeled": _max_prompt_within(TARGET_TTFT_P50_S,
                                          lambda n: cost.latency(prefill_shape(n)))},
        "verdict": {
            "tpot_p50_16ms": weight_floor < TARGET_TPOT_P50_S,
            "tok_s_8000_at_128": b128 / roof(b128) >= TARGET_TOK_S,
            "ttft_p99_200ms_prompt_1024": cost.roofline_s(
                prefill_shape(TARGET_PROMPT)) < TARGET_TTFT_P99_S,
        },
    }
