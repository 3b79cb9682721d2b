"""How closely the default model held quantized follows the same model in fp32, in one run;
writes JSON (tests/executor/test_quantized.py runs the same measurement on fewer prompts).

The reference is the default GGUF's weights dequantized to fp32 (`quantization="none"`). NOTE:
the default model ships only as Q4_1, so "fp32" is the file's Q4_1 values and Q8_0/Q4_0 are a
second rounding of them; no better-sourced weights for it are reachable here. Each variant is
the same file held as blocks (its own Q4_1 as it is, "auto"; or the fp32 values quantized at
load to Q8_0 or Q4_0), plus the whole model run in bf16 (weights and activations), the floor
that tells this model's own sensitivity apart from the formats' error. Per variant:

- greedy_equal: the share of prompts whose first `num_new` greedy tokens equal fp32's;
- top1_agreement: teacher-forced on fp32's greedy continuation, the share of positions where
  the variant's most likely next token is fp32's (one divergence does not count twice);
- disagreement_margins: fp32's top-1 minus top-2 logit where they disagree (a near tie flips
  under any perturbation), and all of them (`values`);
- margin_shift: teacher-forced, how far the variant moves fp32's top-1 minus top-2 gap (|shift|
  median, p90): the size of perturbation a near tie must be smaller than to flip.

The `*_rounding` variants are the fp32 model whose weights are exactly the values the q8_0 /
q4_0 variant holds (`loader.round_as_held`), run by the fp32 kernels: the format's rounding
alone, apart from the block kernels' arithmetic. For a pair present in one run, `vs_rounding`
says how often the real variant agrees with its rounding (greedy, and teacher-forced top-1):
the kernels' own share of the difference. `--hf-check N` repeats the rounding on transformers'
own fp32 model of the file (N prompts): an implementation-independent check.

Prompts decode `--batch` at a time (default 1: single-stream decode, where the GEMV takes
integer dots; 2-8 rows widen blocks to fp32, more go through the prefill GEMM).

    everystop bench quant-accuracy --out benchmarks/results/quant_accuracy.json
    everystop bench quant-accuracy --variants q8_0,q8_0_rounding --hf-check 8
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch

from everystop.bench.hf_reference import default_model_location
from everystop.config import CacheConfig, ModelConfig
from everystop.core.outputs import ScheduledSequence
from everystop.executor.model_runner import ModelRunner
from everystop.executor.models.loader import load_model, round_as_held
from everystop.results import write_result
from everystop.sampling_params import SamplingParams
from everystop.tokenizer import load_tokenizer

# name -> ModelConfig fields of each variant, and `rounded_to`: weights rounded as that format
# holds them, kept fp32 (round_as_held)
VARIANTS: dict[str, dict[str, str]] = {
    "bf16": {"quantization": "none", "dtype": "bfloat16"},
    "q4_1_file": {"quantization": "auto"}, "q8_0": {"quantization": "q8_0"},
    "q4_0": {"quantization": "q4_0"},
    "q8_0_rounding": {"quantization": "none", "rounded_to": "q8_0"},
    "q4_0_rounding": {"quantization": "none", "rounded_to": "q4_0"}}
DEFAULT_VARIANTS = ("bf16", "q4_1_file", "q8_0", "q4_0")
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 10)
_TOPICS = ["the history of Rome", "how a CPU cache works", "baking sourdough bread",
           "the water cycle", "learning to play the guitar", "black holes", "the French "
           "Revolution", "writing a binary search in Python", "why the sky is blue",
           "planting tomatoes", "the rules of chess", "how vaccines work", "a trip to Japan",
           "the stock market", "photosynthesis", "the first moon landing"]


def prompts(count: int) -> list[list[int]]:
    """`count` prompts, chat and raw text alternating, over varied topics (each topic's
    second round takes the other form: 32 distinct prompts)."""
    tok = load_tokenizer()
    out = []
    for i in range(count):
        topic = _TOPICS[i % len(_TOPICS)]
        if (i + i // len(_TOPICS)) % 2 == 0:
            out.append(tok.apply_chat_template(
                [{"role": "user", "content": f"Tell me about {topic}."}]))
        else:
            out.append(tok.encode(f"Here is a short essay on {topic}. It begins:"))
    return out


def make_runner(config: dict[str, str], num_seqs: int, per_seq: int,
                num_threads: int | None = None) -> ModelRunner:
    fields = dict(config)
    fields.setdefault("dtype", "float32")  # fp32 activations unless a variant names its own
    rounded_to = fields.pop("rounded_to", None)
    runner = ModelRunner(ModelConfig(**fields, num_threads=num_threads),  # type: ignore[arg-type]
                         CacheConfig(num_gpu_blocks_override=num_seqs * per_seq,
                                     kv_cache_dtype="float32"), max_model_len=per_seq * 16)
    if rounded_to is not None:
        # A private copy: the runner's own model is shared with the fp32 reference's runner.
        model = load_model(None, runner.model_config.dtype, "cpu", backends=runner.backends,
                           quantization="none")
        round_as_held(model, rounded_to)
        runner.model = model
    return runner


def decode(runner: ModelRunner, prompt_ids: list[list[int]], num_new: int, per_seq: int,
           batch: int, forced: list[list[int]] | None = None
           ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The most likely next token at each of `num_new` steps per prompt, and the logits
    [num_new, vocab] it was chosen from, `batch` prompts packed at a time. Greedy (each step
    fed its own choice), or with `forced` fed those tokens instead (teacher forcing)."""
    tokens = [list(p) for p in prompt_ids]
    computed = [0] * len(tokens)
    chosen: list[list[int]] = [[] for _ in tokens]
    rows: list[list[torch.Tensor]] = [[] for _ in tokens]
    for first in range(0, len(tokens), batch):
        group = range(first, min(first + batch, len(tokens)))
        for step in range(num_new):
            seqs = [ScheduledSequence(str(i), tokens[i][computed[i]:], computed[i],
                                      list(range(i * per_seq, (i + 1) * per_seq)), True,
                                      _GREEDY, output_index=step) for i in group]
            with torch.inference_mode():
                _, logits = runner.forward_logits(seqs)
            assert logits is not None
            for row, i in enumerate(group):
                best = int(logits[row].argmax())
                chosen[i].append(best)
                rows[i].append(logits[row].float().clone())
                computed[i] = len(tokens[i])
                tokens[i].append(forced[i][step] if forced is not None else best)
    return chosen, [torch.stack(r) for r in rows]


def measure(variants: dict[str, dict[str, str]], prompt_ids: list[list[int]], num_new: int,
            batch: int = 1, num_threads: int | None = None) -> dict[str, Any]:
    """Rates of each variant (name -> VARIANTS-style fields) against fp32 on these prompts."""
    per_seq = -(-(max(map(len, prompt_ids)) + num_new) // 16)
    n = len(prompt_ids)
    t0 = time.perf_counter()
    ref = make_runner({"quantization": "none"}, n, per_seq, num_threads)
    print(f"reference loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    t0 = time.perf_counter()
    reference, ref_logits = decode(ref, prompt_ids, num_new, per_seq, batch)
    out: dict[str, Any] = {"prompts": n, "new_tokens": num_new, "batch": batch,
                           "threads": torch.get_num_threads(),
                           "reference": {"weight_bytes": ref.weight_bytes,
                                         "seconds": round(time.perf_counter() - t0, 2)}}
    del ref
    ref_top2 = [r.topk(2, -1) for r in ref_logits]  # per prompt: values, indices [num_new, 2]
    ref_margins = torch.cat([t.values[:, 0] - t.values[:, 1] for t in ref_top2])
    seen: dict[str, tuple[list[list[int]], torch.Tensor]] = {}  # name -> greedy, forced top-1
    for name, config in variants.items():
        t0 = time.perf_counter()
        runner = make_runner(config, n, per_seq, num_threads)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        greedy, _ = decode(runner, prompt_ids, num_new, per_seq, batch)
        forced, logits = decode(runner, prompt_ids, num_new, per_seq, batch, forced=reference)
        top1 = torch.tensor([t for f in forced for t in f])
        same = top1 == torch.tensor([t for r in reference for t in r])
        missed = sorted(ref_margins[~same].tolist())
        # How the variant moves fp32's top-1 minus top-2 gap, teacher-forced (same contexts).
        gaps = torch.cat([lg.gather(1, t.indices) for lg, t in zip(logits, ref_top2)])
        shift = ((gaps[:, 0] - gaps[:, 1]) - ref_margins).abs()
        out[name] = {
            "config": config,
            "bytes_per_param": round(runner.weight_bytes / runner.num_params, 3),
            "greedy_equal": sum(g == r for g, r in zip(greedy, reference)) / n,
            "top1_agreement": float(same.float().mean()),
            "disagreement_margins": {
                "count": len(missed),
                "median": round(statistics.median(missed), 4) if missed else None,
                "max": round(missed[-1], 4) if missed else None,
                "values": [round(m, 4) for m in missed]},
            "margin_shift": {"median": round(float(shift.median()), 4),
                             "p90": round(float(shift.quantile(0.9)), 4)},
            "load_seconds": round(load_s, 2),
            "seconds": round(time.perf_counter() - t0, 2)}
        seen[name] = (greedy, top1)
        print(name, {k: v for k, v in out[name].items() if k != "disagreement_margins"},
              out[name]["disagreement_margins"]["count"], flush=True)
        del runner, logits
    for name, config in variants.items():
        real = config.get("rounded_to")
        if real in seen:  # the real variant against its own rounding: the kernels' share
            (g_real, t_real), (g_round, t_round) = seen[real], seen[name]
            out[name]["vs_" + real] = {
                "greedy_equal": sum(a == b for a, b in zip(g_real, g_round)) / n,
                "top1_agreement": float((t_real == t_round).float().mean())}
    out["reference"]["median_margin"] = round(float(ref_margins.median()), 4)
    out["_reference_tokens"] = reference  # for hf_crosscheck; not written
    return out


def hf_crosscheck(prompt_ids: list[list[int]], num_new: int, formats: list[str],
                  ours: list[list[int]] | None = None) -> dict[str, Any]:
    """The rounding done to transformers' own fp32 model of the default file (round_as_held on
    its parameters): per format, greedy_equal and teacher-forced top-1 against transformers'
    fp32, on these prompts; with `ours` (our fp32 greedy tokens), how often those equal
    transformers' fp32 ones."""
    from transformers import AutoModelForCausalLM

    directory, name = default_model_location()

    t0 = time.perf_counter()
    fp32 = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32).eval()
    ref = _hf_greedy(fp32, prompt_ids, num_new)
    n = len(prompt_ids)
    out: dict[str, Any] = {"prompts": n, "new_tokens": num_new}
    if ours is not None:
        out["ours_fp32_greedy_equal"] = sum(a == b for a, b in zip(ours, ref)) / n
    for fmt in formats:
        model = copy.deepcopy(fp32)
        rounded = round_as_held(model, fmt)
        greedy = _hf_greedy(model, prompt_ids, num_new)
        with torch.inference_mode():  # teacher-forced: one pass over prompt + fp32's tokens
            top1 = [model(torch.tensor([p + r[:-1]])).logits[0, len(p) - 1:].argmax(-1)
                    for p, r in zip(prompt_ids, ref)]
        same = torch.cat([t == torch.tensor(r) for t, r in zip(top1, ref)])
        out[fmt] = {"matrices_rounded": rounded,
                    "greedy_equal": sum(g == r for g, r in zip(greedy, ref)) / n,
                    "top1_agreement": float(same.float().mean())}
    out["seconds"] = round(time.perf_counter() - t0, 2)
    print("hf cross-check", out, flush=True)
    return out


def _hf_greedy(model: Any, prompt_ids: list[list[int]], num_new: int) -> list[list[int]]:
    """`num_new` greedy tokens per prompt, EOS included and passed (as `decode` does)."""
    out = []
    with torch.inference_mode():
        for p in prompt_ids:
            ids, past, new = torch.tensor([p]), None, []
            for _ in range(num_new):
                res = model(ids, past_key_values=past, use_cache=True)
                past, best = res.past_key_values, int(res.logits[0, -1].argmax())
                new.append(best)
                ids = torch.tensor([[best]])
            out.append(new)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1,
                        help="prompts decoded together (1: the integer-dot decode path)")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help="comma-separated subset of " + ",".join(VARIANTS))
    parser.add_argument("--threads", type=int, default=None,
                        help="compute threads (default: every usable core; on a shared "
                        "machine 1 avoids threads waiting on each other)")
    parser.add_argument("--hf-check", type=int, default=0, metavar="N",
                        help="also round transformers' fp32 model as q8_0 and q4_0 hold it "
                        "and compare greedy decodes on the first N prompts (needs "
                        "transformers)")
    parser.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    variants = {name: VARIANTS[name] for name in args.variants.split(",")}
    prompt_ids = prompts(args.prompts)
    result = measure(variants, prompt_ids, args.new_tokens, args.batch, args.threads)
    if args.hf_check:
        torch.set_num_threads(result["threads"])
        result["hf_crosscheck"] = hf_crosscheck(
            prompt_ids[:args.hf_check], args.new_tokens, ["q8_0", "q4_0"],
            ours=result.pop("_reference_tokens")[:args.hf_check])
    result.pop("_reference_tokens", None)
    write_result({"benchmark": "quant_accuracy", "model": "SmolLM2-135M-Instruct (default GGUF)",
                  **result}, args.out)
    return 0
