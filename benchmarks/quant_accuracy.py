"""How closely the default model held quantized follows the same model in fp32, in one run;
writes JSON (tests/executor/test_quantized.py runs the same measurement on fewer prompts).

The reference is the default GGUF's weights dequantized to fp32 (`quantization="none"`); each
variant is the same file held as blocks: its own Q4_1 as it is ("auto"), or the fp32 values
quantized at load to Q8_0 or Q4_0. Two rates per variant:

- greedy_equal: the share of prompts whose first `num_new` greedy tokens equal fp32's;
- top1_agreement: teacher-forced on fp32's greedy continuation, the share of positions where
  the variant's most likely next token is fp32's (one divergence does not count twice).

    PYTHONPATH=src python benchmarks/quant_accuracy.py --out benchmarks/results/quant_accuracy.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from everystop.config import CacheConfig, ModelConfig
from everystop.core.outputs import ScheduledSequence
from everystop.executor.model_runner import ModelRunner
from everystop.results import write_result
from everystop.sampling_params import SamplingParams
from everystop.tokenizer import load_tokenizer

VARIANTS = {"q4_1_file": "auto", "q8_0": "q8_0", "q4_0": "q4_0"}
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 10)
_TOPICS = ["the history of Rome", "how a CPU cache works", "baking sourdough bread",
           "the water cycle", "learning to play the guitar", "black holes", "the French "
           "Revolution", "writing a binary search in Python", "why the sky is blue",
           "planting tomatoes", "the rules of chess", "how vaccines work", "a trip to Japan",
           "the stock market", "photosynthesis", "the first moon landing"]


def prompts(count: int) -> list[list[int]]:
    """`count` prompts, chat and raw text alternating, over varied topics."""
    tok = load_tokenizer()
    out = []
    for i in range(count):
        topic = _TOPICS[i % len(_TOPICS)]
        if i % 2 == 0:
            out.append(tok.apply_chat_template(
                [{"role": "user", "content": f"Tell me about {topic}."}]))
        else:
            out.append(tok.encode(f"Here is a short essay on {topic}. It begins:"))
    return out


def make_runner(quantization: str, num_seqs: int, per_seq: int) -> ModelRunner:
    return ModelRunner(ModelConfig(quantization=quantization),
                       CacheConfig(num_gpu_blocks_override=num_seqs * per_seq,
                                   kv_cache_dtype="float32"), max_model_len=per_seq * 16)


def decode(runner: ModelRunner, prompt_ids: list[list[int]], num_new: int, per_seq: int,
           forced: list[list[int]] | None = None) -> list[list[int]]:
    """The most likely next token at each of `num_new` steps per prompt, all prompts packed
    in one batch. Greedy (each step fed its own choice), or with `forced` fed those tokens
    instead (teacher forcing)."""
    tokens = [list(p) for p in prompt_ids]
    computed = [0] * len(tokens)
    chosen: list[list[int]] = [[] for _ in tokens]
    for step in range(num_new):
        seqs = [ScheduledSequence(str(i), tokens[i][computed[i]:], computed[i],
                                  list(range(i * per_seq, (i + 1) * per_seq)), True, _GREEDY,
                                  output_index=step) for i in range(len(tokens))]
        with torch.inference_mode():
            _, logits = runner.forward_logits(seqs)
        assert logits is not None
        best = logits.argmax(-1).tolist()
        for i in range(len(tokens)):
            chosen[i].append(best[i])
            computed[i] = len(tokens[i])
            tokens[i].append(forced[i][step] if forced is not None else best[i])
    return chosen


def measure(variants: dict[str, str], prompt_ids: list[list[int]], num_new: int
            ) -> dict[str, Any]:
    """Rates of each variant (name -> quantization policy) against fp32 on these prompts."""
    per_seq = -(-(max(map(len, prompt_ids)) + num_new) // 16)
    n = len(prompt_ids)
    t0 = time.perf_counter()
    ref = make_runner("none", n, per_seq)
    print(f"reference loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    t0 = time.perf_counter()
    reference = decode(ref, prompt_ids, num_new, per_seq)
    out: dict[str, Any] = {"prompts": n, "new_tokens": num_new,
                           "reference": {"weight_bytes": ref.weight_bytes,
                                         "seconds": round(time.perf_counter() - t0, 2)}}
    del ref
    for name, quantization in variants.items():
        t0 = time.perf_counter()
        runner = make_runner(quantization, n, per_seq)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        greedy = decode(runner, prompt_ids, num_new, per_seq)
        forced = decode(runner, prompt_ids, num_new, per_seq, forced=reference)
        agree = sum(a == b for f, r in zip(forced, reference) for a, b in zip(f, r))
        out[name] = {
            "quantization": quantization,
            "bytes_per_param": round(runner.weight_bytes / runner.num_params, 3),
            "greedy_equal": sum(g == r for g, r in zip(greedy, reference)) / n,
            "top1_agreement": agree / (n * num_new),
            "load_seconds": round(load_s, 2),
            "seconds": round(time.perf_counter() - t0, 2)}
        print(name, out[name], flush=True)
        del runner
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    result = measure(VARIANTS, prompts(args.prompts), args.new_tokens)
    write_result({"benchmark": "quant_accuracy", "model": "SmolLM2-135M-Instruct (default GGUF)",
          **result}, args.out)


if __name__ == "__main__":
    main()
