"""Batch-invariant mode (ModelConfig.batch_invariant): a row's result does not depend on what
else is in the pass. Checked bit for bit at three levels: one linear at every row count, one
sequence's logits under every batch composition the scheduler makes, and greedy requests
through the engine under KV pressure against the same requests run alone."""

from __future__ import annotations

import random

import pytest
import torch

from everystop.config import CacheConfig, ConfigError, ModelConfig
from everystop.core.outputs import ScheduledSequence
from everystop.executor.layers.cpu_kernels import load_cpu_kernels, runnable_isas
from everystop.executor.layers.linear import linear
from everystop.executor.layers.quant import FORMATS, quantize
from everystop.executor.model_runner import ModelRunner
from everystop.sampling_params import SamplingParams
from tests.tiny_llama import llama_config, save_random_llama

KERNELS = load_cpu_kernels("auto", batch_invariant=True)
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no CPU kernel build on this machine")

ROW_COUNTS = (1, 2, 3, 5, 8, 9, 33, 40, 100)


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "bfloat16-x", "q8_0", "q4_1",
                                     "q8_0-int8", "q4_0-int8", "q4_1-int8", "q4_1-int8-bf16x"])
def test_linear_row_sums_alike_at_every_row_count(weights: str, isa: str) -> None:
    """Each row of x @ W.T is bit-equal computed alone and inside any larger batch (100
    output columns: a remainder no column group divides), in every build this CPU runs; block
    weights with fp32 activations and with int8 ones (-int8: integer block dots where the build
    has them, at every row count)."""
    int8 = "-int8" in weights
    kernels = load_cpu_kernels(isa, int8_decode_dot=int8, batch_invariant=True)
    assert kernels is not None
    if weights.endswith("-bf16x"):
        weights = weights.removesuffix("-bf16x") + "-x"
    weights = weights.replace("-int8", "")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(100, 96, generator=gen)
    x = torch.randn(max(ROW_COUNTS), 96, generator=gen)
    fmt, k = "dense", 0
    if weights.removesuffix("-x") in FORMATS:
        q = quantize(w, weights.removesuffix("-x"))
        w, fmt, k = q.data, q.fmt, q.cols
        x = x.bfloat16() if weights.endswith("-x") else x
    elif weights.startswith("bfloat16"):
        w = w.bfloat16()
        x = x.bfloat16() if weights.endswith("-x") else x
    alone = torch.cat([linear(x[i:i + 1], w, kernels, fmt, k) for i in range(len(x))])
    for rows in ROW_COUNTS:
        assert torch.equal(linear(x[:rows], w, kernels, fmt, k), alone[:rows]), rows


GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
BLOCKS_PER_SEQ = 16


@pytest.fixture(scope="module", params=["on", "off"])
def runner(request: pytest.FixtureRequest) -> ModelRunner:
    """The default model (Q4_1 blocks, fp32 activations, the default 16-bit KV cache), with
    int8 activations (integer block dots; what auto picks here) and without."""
    return ModelRunner(ModelConfig(batch_invariant=True, int8_decode_dot=request.param),
                       CacheConfig(num_gpu_blocks_override=64 * BLOCKS_PER_SEQ,
                                   swap_space_gib=0.0), max_model_len=1024)


def _seq(i: int, tokens: list[int], start: int, sample: bool = True) -> ScheduledSequence:
    blocks = list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ))
    return ScheduledSequence(f"s{i}", tokens, start, blocks, sample, GREEDY)


def _logits(runner: ModelRunner, seqs: list[ScheduledSequence]) -> dict[str, torch.Tensor]:
    sampled, logits = runner.forward_logits(seqs)
    assert logits is not None
    return {s.request_id: logits[j].clone() for j, s in enumerate(sampled)}


def test_row_logits_alike_in_every_batch(runner: ModelRunner) -> None:
    """One sequence's next-token logits at position 70 are bit-equal decoded alone, beside 40
    decode rows, beside another prompt's chunk, as the last row of its own prompt chunk, and
    recomputed after a preemption (its context prefilled again in two chunks)."""
    vocab = runner.model.args.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (70,), generator=gen).tolist()
    token = int(torch.randint(0, vocab, (1,), generator=gen))
    decode = _seq(0, [token], len(prompt))

    _logits(runner, [_seq(0, prompt, 0, sample=False)])
    alone = _logits(runner, [decode])["s0"]
    others = []
    for i in range(1, 41):
        _logits(runner, [_seq(i, torch.randint(0, vocab, (20,), generator=gen).tolist(), 0)])
        others.append(_seq(i, [i], 20))
    cases = {
        "beside 40 decode rows": [decode, *others],
        "beside a prompt chunk": [decode, _seq(50, list(range(100)), 0)],
        "last row of its prompt chunk": [_seq(0, [*prompt, token], 0)],
    }
    for name, batch in cases.items():
        _logits(runner, [_seq(0, prompt, 0, sample=False)])  # the same cache contents again
        assert torch.equal(_logits(runner, batch)["s0"], alone), name
    _logits(runner, [_seq(0, prompt[:32], 0, sample=False)])
    recomputed = _logits(runner, [_seq(0, [*prompt[32:], token], 32), *others[:8]])["s0"]
    assert torch.equal(recomputed, alone), "recomputed in two chunks"


@pytest.mark.parametrize("options", [dict(cpu_kernels="off"), dict(attention_backend="torch"),
                                     dict(device="cuda")])
def test_batch_invariant_refused_where_it_cannot_hold(options: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="batch_invariant"):
        ModelConfig(batch_invariant=True, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("int8", ["auto", "on", "off"])
def test_batch_invariant_takes_int8_activations(int8: str) -> None:
    """Integer block dots sum each row alike at every row count, so the modes combine."""
    config = ModelConfig(batch_invariant=True, int8_decode_dot=int8)  # type: ignore[arg-type]
    assert config.int8_decode_dot == int8


def test_flag_sets_the_mode() -> None:
    import argparse

    from everystop.engine.args import add_engine_args, engine_config_from_args

    parser = add_engine_args(argparse.ArgumentParser())
    assert engine_config_from_args(parser.parse_args(["--batch-invariant"])).model.batch_invariant
    assert not engine_config_from_args(parser.parse_args([])).model.batch_invariant


@pytest.mark.parametrize("quantization", ["auto", "q4_0"])
def test_engine_outputs_alike_under_kv_pressure_and_batch_mixes(tiny_llama: str,
                                                                quantization: str) -> None:
    """48 greedy requests equal their alone outputs whatever the batch mix, under a KV pool
    that forces preemptions (recompute, swap, either), over three seeds. In bfloat16, where
    the default kernels' batch dependence is large enough to change 2-3 of the 48 requests
    per seed on this model. "q4_0": the weights quantized at load, so int8 activations (auto)
    and integer block dots at every row count."""
    from everystop import LLM
    from everystop.executor.models.loader import default_model_path

    gen = random.Random(0)
    prompts = [[gen.randrange(2, 500) for _ in range(gen.randrange(4, 120))] for _ in range(48)]
    params = [SamplingParams(temperature=0.0, max_tokens=gen.randrange(4, 16), ignore_eos=True)
              for _ in prompts]
    common = dict(tokenizer=default_model_path(), batch_invariant=True, dtype="bfloat16",
                  quantization=quantization, int8_decode_dot="auto",
                  enable_prefix_caching=False, block_size=16)
    llm = LLM(tiny_llama, max_num_seqs=1, **common)
    alone = [llm.generate([p], [s], use_tqdm=False)[0].token_ids
             for p, s in zip(prompts, params)]
    for seed, mode in enumerate(("recompute", "swap", "auto")):
        mix = random.Random(seed)
        order = list(range(len(prompts)))
        mix.shuffle(order)
        llm = LLM(tiny_llama, max_num_seqs=mix.choice([16, 32, 48]),
                  max_num_batched_tokens=mix.choice([64, 128, 256]),
                  num_gpu_blocks_override=16, swap_space_gib=0.01, preemption_mode=mode,
                  **common)
        outs = llm.generate([prompts[i] for i in order], [params[i] for i in order],
                            use_tqdm=False)
        assert [o.token_ids for o in outs] == [alone[i] for i in order], (seed, mode)
        sched = llm.engine.scheduler
        assert sum(sched.num_preemptions.values()) > 0, (seed, mode)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random Llama with head_dim 64 (the attention kernel's compiled layouts, the prefill
    tiles included), small enough for hundreds of engine steps in seconds."""
    path = tmp_path_factory.mktemp("tiny_llama_bi")
    save_random_llama(llama_config(vocab_size=512, hidden_size=256, intermediate_size=512),
                      path, std=0.05)
    return str(path)
