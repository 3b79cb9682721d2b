"""ModelRunner on the default model: KV reuse across block tables, chunked prefill, swaps,
sampling only where asked, pool sizing."""

from __future__ import annotations

import pytest
import torch

from everystop.config import CacheConfig, ModelConfig
from everystop.core.outputs import ScheduledSequence, SchedulerOutput
from everystop.executor.model_runner import ModelRunner
from everystop.sampling_params import SamplingParams

from .conftest import GREEDY

pytestmark = pytest.mark.model

PROMPT = list(range(1000, 1040))  # 40 tokens: 2 full blocks + 8 tokens


def _seq(rid: str, tokens: list[int], start: int, blocks: list[int], sample: bool = True,
         params: SamplingParams = GREEDY, output_index: int = 0) -> ScheduledSequence:
    return ScheduledSequence(rid, tokens[start:], start, blocks, sample, params, output_index)


def _logits(runner, seqs: list[ScheduledSequence]) -> torch.Tensor:
    return runner.forward_logits(seqs)[1]


def test_prefix_reuse_equals_recompute(default_runner):
    runner = default_runner
    other = PROMPT[:32] + list(range(2000, 2013))  # shares the 2 full blocks of PROMPT
    _logits(runner, [_seq("a", PROMPT, 0, [0, 1, 2])])
    reused = _logits(runner, [_seq("b", other, 32, [0, 1, 5])])
    scratch = _logits(runner, [_seq("c", other, 0, [10, 11, 12])])
    assert torch.allclose(reused, scratch, atol=1e-4)
    assert not torch.allclose(scratch, _logits(runner, [_seq("a2", PROMPT, 0, [20, 21, 22])]))


def test_chunked_prefill_equals_one_shot(default_runner):
    runner = default_runner
    one_shot = _logits(runner, [_seq("a", PROMPT, 0, [30, 31, 32])])
    sampled, _ = runner.forward_logits([
        ScheduledSequence("b", PROMPT[:19], 0, [40, 41, 42], False, GREEDY)])
    assert sampled == []  # a non-final chunk samples nothing
    last = _logits(runner, [_seq("b", PROMPT, 19, [40, 41, 42])])
    assert torch.allclose(one_shot, last, atol=1e-4)


def test_execute_samples_only_flagged_sequences_and_decodes(default_runner):
    runner = default_runner
    out = runner.execute(SchedulerOutput(scheduled=[
        ScheduledSequence("chunk", PROMPT[:16], 0, [50], False, GREEDY),
        _seq("full", PROMPT, 0, [60, 61, 62])]))
    assert set(out.sampled_token_ids) == {"full"} and out.execute_time_s > 0
    first = out.sampled_token_ids["full"]
    # Decode step next to a prefill chunk in the same batch.
    out2 = runner.execute(SchedulerOutput(scheduled=[
        ScheduledSequence("full", [first], 40, [60, 61, 62], True, GREEDY, output_index=1),
        ScheduledSequence("chunk", PROMPT[16:], 16, [50, 51, 52], True, GREEDY)]))
    assert out2.sampled_token_ids["chunk"] == first  # same prompt, same greedy token
    ref = _logits(runner, [_seq("ref", PROMPT + [first], 0, [70, 71, 72])])
    assert out2.sampled_token_ids["full"] == int(ref.argmax())


def test_logprobs_returned_when_asked(default_runner):
    params = SamplingParams(temperature=0.0, logprobs=3)
    out = default_runner.execute(SchedulerOutput(scheduled=[_seq("lp", PROMPT, 0, [80, 81, 82],
                                                                params=params)]))
    lp = out.logprobs["lp"]
    assert lp.token_id == out.sampled_token_ids["lp"] and len(lp.top) == 3
    assert lp.top[0][0] == lp.token_id and lp.logprob == pytest.approx(lp.top[0][1])


def test_swap_out_and_in_preserves_kv(default_runner):
    runner = default_runner
    _logits(runner, [_seq("a", PROMPT, 0, [90, 91, 92])])
    expected = _logits(runner, [_seq("x", PROMPT + [7], 40, [90, 91, 92])])
    runner.execute(SchedulerOutput(blocks_to_swap_out=[(90, 0), (91, 1), (92, 2)]))
    runner.kv_caches[0][0][90:93].fill_(float("nan"))  # device copies gone
    runner.execute(SchedulerOutput(blocks_to_swap_in=[(0, 100), (1, 101), (2, 90)]))
    after = _logits(runner, [_seq("x", PROMPT + [7], 40, [100, 101, 90])])
    assert torch.allclose(expected, after, atol=1e-5)


def test_seeded_sampling_independent_of_batch(default_runner):
    params = SamplingParams(temperature=1.0, seed=7)
    alone = default_runner.execute(SchedulerOutput(scheduled=[
        _seq("s", PROMPT, 0, [110, 111, 112], params=params, output_index=3)]))
    batched = default_runner.execute(SchedulerOutput(scheduled=[
        _seq("o", list(range(3000, 3020)), 0, [120, 121], params=SamplingParams(temperature=1.0)),
        _seq("s", PROMPT, 0, [113, 114, 115], params=params, output_index=3)]))
    assert alone.sampled_token_ids["s"] == batched.sampled_token_ids["s"]


def test_block_table_too_short_is_an_error(default_runner):
    with pytest.raises(ValueError, match="needs 3 blocks"):
        default_runner.forward_logits([_seq("bad", PROMPT, 0, [0, 1])])


def test_capacity_and_measurements(default_runner):
    r = default_runner
    assert r.bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert r.bytes_per_block == r.bytes_per_token * 16
    assert (r.num_gpu_blocks, r.num_cpu_blocks) == (384, 64)
    assert "46080 B/token" in r.describe_capacity()
    assert r.measure_prefill_tokens_per_s(16) > 0
    assert r.measure_swap_bytes_per_s(2) > 0


def test_cpu_pool_sized_from_kv_cache_memory():
    runner = ModelRunner(ModelConfig(dtype="bfloat16"),
                         CacheConfig(kv_cache_memory=10 * 23040 * 16, swap_space_gib=0.0), 256)
    assert runner.bytes_per_token == 23040
    assert runner.num_gpu_blocks == 10 and runner.num_cpu_blocks == 0
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    out = runner.execute(SchedulerOutput(scheduled=[_seq("a", PROMPT, 0, [0, 1, 2])]))
    assert 0 <= out.sampled_token_ids["a"] < 49152


def test_cpu_pool_default_is_a_capped_share_of_available_memory(monkeypatch):
    from everystop.executor import model_runner

    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda: 1 << 30)
    runner = ModelRunner(ModelConfig(), CacheConfig(kv_cache_dtype="float16", swap_space_gib=0.0),
                         256)
    # 20% of 1 GiB is under the 256 MiB floor.
    assert runner.num_gpu_blocks == model_runner.CPU_KV_MIN_BYTES // runner.bytes_per_block
    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda: 100 << 30)
    monkeypatch.setattr(model_runner, "CPU_KV_MAX_BYTES", 300 << 20)
    runner = ModelRunner(ModelConfig(), CacheConfig(kv_cache_dtype="float16", swap_space_gib=0.0),
                         256)
    assert runner.num_gpu_blocks == (300 << 20) // runner.bytes_per_block


def test_last_layer_on_output_rows_only_matches_all_rows(default_runner):
    """The model given output rows runs its last layer on them alone: those rows' hidden
    states equal the full pass's, and every layer's K/V is still written for every row."""
    from everystop.executor.inputs import build_inputs

    runner = default_runner
    model, pool = runner.model, runner.pool
    seqs = [_seq("p", PROMPT, 0, [70, 71, 72], sample=True),
            ScheduledSequence("chunk", PROMPT[:21], 0, [73, 74], False, GREEDY),
            _seq("q", PROMPT[5:], 0, [75, 76, 77], sample=True)]
    inputs = build_inputs(seqs, runner.block_size, runner.device)
    blocks = list(range(70, 78))

    def run(rows):
        hidden = model(inputs.input_ids, inputs.positions, pool.kv_caches, inputs.meta, rows)
        return hidden, pool.device_pool[:, :, blocks].clone()

    full, kv_full = run(None)
    for rows in ([39, 60, 95], [0, 20, 39, 41, 70], [5], []):
        wanted = torch.tensor(rows, dtype=torch.long)
        part, kv_part = run(wanted)
        assert part.shape == (len(rows), full.shape[1])
        assert torch.allclose(part, full[wanted], atol=1e-4, rtol=1e-4), rows
        assert torch.equal(kv_part, kv_full)
