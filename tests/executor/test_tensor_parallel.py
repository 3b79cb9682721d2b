"""Tensor parallelism on CPU with gloo: TP=2 must produce the same greedy tokens as TP=1 through
the continuous-batching engine (first-step logits equal within float tolerance), for the
default model (9 heads / 3 KV heads: an uneven 2 + 1 KV-head split), a tiny model with 2 KV
heads, and one with 1 KV head (replicated). A killed worker stops the engine within seconds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import torch

from everystop import LLM, SamplingParams
from everystop.core.outputs import ScheduledSequence, SchedulerOutput
from everystop.executor.layers.parallel import HeadShard, shard_heads, shard_range
from everystop.executor.models.loader import ModelLoadError, default_model_path
from everystop.executor.tp_executor import TensorParallelError, TensorParallelExecutor
from tests.tiny_llama import tiny_llama_dir

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
WORDS = ("every station the train stops and a few careful passengers step onto the platform "
         "while the small model writes notes about the weather").split()
# fp32 activations and KV: sharded and unsharded logits are compared to 2e-4, tighter than
# 16-bit rounding of values that differ in their last fp32 bits (16-bit caches:
# test_kv_cache_dtype.py; `--dtype auto` would pick bf16 for the tiny float models here).
SMALL = dict(kv_cache_memory=48 << 20, swap_space_gib=0.01, max_model_len=512,
             max_num_batched_tokens=256, chunk_size=64, max_num_seqs=8, kv_cache_dtype="float32",
             dtype="float32")


# --- the head split (no processes) --------------------------------------------------------

def test_shard_range_covers_everything_once():
    for n in (1, 5, 9, 49152):
        for world in (1, 2, 3, 4):
            ranges = [shard_range(n, world, r) for r in range(world)]
            assert sum(size for _, size in ranges) == n
            assert all(a[0] + a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_shard_heads():
    # SmolLM2-135M: 3 GQA groups of 3 query heads over 2 ranks -> 2 groups + 1 group.
    assert shard_heads(9, 3, 2, 0) == HeadShard(0, 6, 0, 2)
    assert shard_heads(9, 3, 2, 1) == HeadShard(6, 3, 2, 1)
    # Llama-3-70B at TP=4: 16 query heads and 2 KV heads per rank.
    assert shard_heads(64, 8, 4, 3) == HeadShard(48, 16, 6, 2)
    # One KV head, 2 ranks: replicated, the 4 query heads split 2 + 2.
    assert [shard_heads(4, 1, 2, r) for r in (0, 1)] == [HeadShard(0, 2, 0, 1),
                                                        HeadShard(2, 2, 0, 1)]
    # 2 KV heads on 4 ranks: each replicated twice.
    assert [shard_heads(8, 2, 4, r).kv_start for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="replicated evenly"):
        shard_heads(9, 3, 4, 0)


# --- end to end ----------------------------------------------------------------------------

def _prompts(n: int, vocab: int | None = None) -> list:
    out = []
    for i in range(n):
        length = 2 + (i * 29) % 70  # 2 .. 71, mixed prefill lengths
        if vocab is None:
            out.append(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(length)))
        else:
            out.append([(7 * i + 13 * j) % vocab for j in range(length)])
    return out


def _first_step(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of one packed prefill of `prompts` on fresh blocks (the engine is idle)."""
    bs, per = llm.config.cache.block_size, 8
    top = llm.engine.executor.num_gpu_blocks
    seqs = [ScheduledSequence(str(i), p, 0, list(range(top - per * (i + 1), top - per * i)),
                              True, GREEDY) for i, p in enumerate(prompts)]
    assert all(len(p) <= bs * per for p in prompts)
    executor = llm.engine.executor
    if isinstance(executor, TensorParallelExecutor):
        return executor.forward_logits(SchedulerOutput(scheduled=seqs))
    return executor.runner.forward_logits(seqs)[1]


def _compare(model: str | None, tokenizer: str | None, vocab: int | None,
             **options: object) -> None:
    prompts = _prompts(8, vocab)
    params = [SamplingParams(max_tokens=NEW_TOKENS - i % 3 * 4, temperature=0.0,
                             ignore_eos=True) for i in range(len(prompts))]
    results, logits = [], []
    for tp in (1, 2):
        llm = LLM(model, tokenizer=tokenizer, tensor_parallel_size=tp, **SMALL, **options)
        try:
            results.append([o.token_ids for o in llm.generate(prompts, params,
                                                                use_tqdm=False)])
            ids = [llm.get_tokenizer().encode(p) if isinstance(p, str) else p
                   for p in prompts[:4]]
            logits.append(_first_step(llm, [p[:100] for p in ids]))
        finally:
            llm.engine.shutdown()
        if tp == 2:
            assert not any(p.is_alive() for p in llm.engine.executor._procs)
    assert results[0] == results[1]
    assert all(len(r) == p.max_tokens for r, p in zip(results[1], params))
    assert logits[0].shape == logits[1].shape
    torch.testing.assert_close(logits[1], logits[0], atol=2e-4, rtol=1e-4)


@pytest.mark.model
def test_default_model_tp2_matches_tp1():
    # fp32 activations: the all-reduce sums a row-parallel output in another order, and int8
    # rounding of the next layer's input would turn those last bits into ~0.1 in a logit.
    _compare(None, None, None, int8_decode_dot="off")


@pytest.fixture(scope="module")
def tiny_gqa(tmp_path_factory) -> str:
    return tiny_llama_dir(tmp_path_factory, "tiny_gqa", kv_heads=2)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_tiny_model_tp2_matches_tp1(tmp_path_factory, tiny_gqa, kv_heads):
    path = tiny_gqa if kv_heads == 2 else tiny_llama_dir(tmp_path_factory, "tiny_mqa", 1)
    # The tiny vocabulary (250) sits inside the default tokenizer's: prompts are token ids.
    _compare(path, default_model_path(), vocab=250)


def test_unsplittable_heads_fail_start_and_reap(tiny_gqa):
    with pytest.raises(ModelLoadError, match="replicated evenly"):
        LLM(tiny_gqa, tokenizer=default_model_path(), tensor_parallel_size=3, **SMALL)


def test_killed_worker_stops_the_engine_within_seconds(tiny_gqa):
    from everystop.engine.async_engine import AsyncEngine, EngineDead

    # A long collective timeout: only death detection can make this fast.
    llm = LLM(tiny_gqa, tokenizer=default_model_path(), tensor_parallel_size=2,
              collective_timeout_s=600, **SMALL)
    executor = llm.engine.executor
    engine = AsyncEngine(llm.engine)
    worker = executor._procs[0]
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    outcome: dict[str, object] = {}

    async def consume() -> None:
        count = 0
        try:
            async for _ in engine.generate(list(range(5, 40)), params):
                count += 1
                if count == 3:
                    os.kill(worker.pid, signal.SIGKILL)
                    outcome["killed_at"] = time.monotonic()
        except EngineDead as exc:
            outcome["error_at"] = time.monotonic()
            outcome["error"] = str(exc)
        with pytest.raises(EngineDead):  # what the server turns into a 503
            engine.submit(engine.make_request([1, 2, 3], params))

    runner = threading.Thread(target=lambda: asyncio.run(consume()))
    runner.start()
    runner.join(timeout=120)
    assert not runner.is_alive(), "the engine hung after a worker died"
    assert "error_at" in outcome, outcome
    assert outcome["error_at"] - outcome["killed_at"] < 30  # vs the 600 s collective timeout
    assert "rank 1" in outcome["error"] and "exited with code -9" in outcome["error"]
    with pytest.raises(TensorParallelError):
        executor.execute(SchedulerOutput())
    engine.shutdown()
    assert not worker.is_alive()


def test_idle_engine_notices_a_dead_executor():
    """No request in flight: the async loop's health check still stops the engine (the server's
    /health then answers 503)."""
    from everystop.engine.async_engine import AsyncEngine
    from tests.engine.toy_engine import make_toy_engine

    engine = make_toy_engine()
    dead = threading.Event()

    def check_health() -> None:
        if dead.is_set():
            raise TensorParallelError("tensor-parallel worker rank 1 exited with code -9")

    engine.executor.check_health = check_health
    front = AsyncEngine(engine)
    try:
        dead.set()
        front._thread.join(timeout=10)
        assert not front._thread.is_alive()
        assert isinstance(front.error, TensorParallelError)
    finally:
        front.shutdown()


class _CountingGroup:
    """Stands in for a process group: counts collectives and their bytes (values unchanged)."""

    def __init__(self) -> None:
        self.allreduce_bytes: list[int] = []
        self.gathers = 0

    def allreduce(self, tensors, opts=None):
        self.allreduce_bytes.append(tensors[0].numel() * tensors[0].element_size())
        return self

    def gather(self, outputs, inputs, opts=None):
        self.gathers += 1
        for out in (outputs[0] if outputs else []):
            out.copy_(inputs[0])
        return self

    def wait(self) -> None:
        pass


def test_one_all_reduce_per_row_parallel_layer():
    """Per forward pass: 2 all-reduces per layer (o_proj, down_proj) + 1 (embedding), each of
    [tokens, hidden] activations; one gather of the sampled rows' logits."""
    from everystop.executor.inputs import build_inputs
    from everystop.executor.kv_pool import KVPool
    from everystop.executor.layers.parallel import ParallelContext
    from everystop.executor.models.decoder import DecoderArgs, DecoderForCausalLM

    args = DecoderArgs(vocab_size=100, hidden_size=32, intermediate_size=48, num_layers=3,
                       num_heads=4, num_kv_heads=2, head_dim=8)
    group = _CountingGroup()
    model = DecoderForCausalLM(args, ParallelContext(0, 2, group, group))
    for p in model.parameters():
        torch.nn.init.normal_(p, 0.0, 0.1)
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == (4 * 8, 32)  # [q2; k1; v1]
    pool = KVPool(3, model.num_local_kv_heads, 8, 4, 8, 0, torch.float32, torch.device("cpu"))
    seqs = [ScheduledSequence("a", [1, 2, 3, 4, 5], 0, [0, 1], True, GREEDY),
            ScheduledSequence("b", [7], 3, [2], True, GREEDY)]
    inputs = build_inputs(seqs, 4, torch.device("cpu"))
    hidden = model(inputs.input_ids, inputs.positions, pool.kv_caches, inputs.meta)
    logits = model.compute_logits(hidden[inputs.sample_indices])
    assert group.allreduce_bytes == [6 * 32 * 4] * (2 * args.num_layers + 1)
    assert group.gathers == 1 and logits.shape == (2, 100)
