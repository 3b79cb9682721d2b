"""Shared fixtures for executor tests: a small driver that plays the scheduler by hand."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from everystop.core.outputs import ScheduledSequence
from everystop.sampling_params import SamplingParams

# The test machine is small and shared: more threads than cores makes torch far slower.
torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def blocks_for(index: int, per_seq: int) -> list[int]:
    """Disjoint block table for the index-th sequence of a hand-built batch."""
    return list(range(index * per_seq, (index + 1) * per_seq))


def greedy_generate(runner, prompts: list[list[int]], num_new: int, per_seq: int,
                    ) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy-decode all prompts together (one packed prefill, then packed decode steps).

    Returns the new tokens per prompt and the first-step logits [len(prompts), vocab].
    """
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    first_logits = None
    for step in range(num_new):
        seqs = [ScheduledSequence(str(i), tokens[i][computed[i]:], computed[i],
                                  blocks_for(i, per_seq), True, GREEDY, output_index=step)
                for i in range(len(prompts))]
        sampled, logits = runner.forward_logits(seqs)
        if first_logits is None:
            first_logits = logits.clone()
        out = runner.sampler(logits, [s.sampling_params for s in sampled], [step] * len(sampled))
        for i, tok in enumerate(out.token_ids):
            computed[i] = len(tokens[i])
            tokens[i].append(tok)
    assert first_logits is not None
    return [t[len(p):] for t, p in zip(tokens, prompts)], first_logits


@pytest.fixture(scope="session")
def default_runner():
    """The default model (SmolLM2-135M, float32, CPU, float32 KV cache, fp32 activations into
    the block weights: the strict reference tests compare exact numerics;
    tests/executor/test_kv_cache_dtype.py covers 16-bit caches,
    tests/executor/test_int8_vs_transformers.py int8 activations) with 384 device and 64 host
    blocks, loaded once for the whole session."""
    from everystop.config import CacheConfig, ModelConfig
    from everystop.executor.model_runner import ModelRunner

    swap_gib = 64 * 46080 * 16 / 2**30  # 64 host blocks of 16 tokens at 46080 B/token
    return ModelRunner(ModelConfig(int8_decode_dot="off"),
                       CacheConfig(num_gpu_blocks_override=384, swap_space_gib=swap_gib,
                                   kv_cache_dtype="float32"), max_model_len=2048)



HfGreedy = Callable[[list[int], int], tuple[list[int], torch.Tensor]]


@pytest.fixture(scope="session")
def hf_greedy(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> HfGreedy:
    """transformers' greedy continuation of a prompt on the default model (float32) and the
    logits of each step: the reference the exact and int8 tests compare with. Each
    (prompt, length) is generated once per run, the run's workers sharing the results through
    its temporary directory; transformers' model is loaded only on a miss."""
    import fcntl
    import hashlib
    import os

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # this run's directory, above each worker's own
    cache = base / "hf-greedy"
    cache.mkdir(exist_ok=True)

    def generate(prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        key = hashlib.sha256(repr((prompt, n)).encode()).hexdigest()[:24]
        path = cache / f"{key}.pt"
        with open(str(path) + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one worker generates; the other waits, reads
            if not path.exists():
                model = request.getfixturevalue("hf_float32_model")
                with torch.no_grad():
                    res = model.generate(torch.tensor([prompt]), max_new_tokens=n,
                                         do_sample=False, output_logits=True,
                                         return_dict_in_generate=True, pad_token_id=0)
                torch.save((res.sequences[0, len(prompt):].tolist(),
                            torch.cat(res.logits).float()), path)
            tokens, logits = torch.load(path)
        return tokens, logits

    return generate


def follow_greedy(ours: list[list[int]], prompts: list[list[int]], hf_greedy: HfGreedy,
                  num_new: int, max_flip_margin: float) -> tuple[int, list[float]]:
    """How many of `ours` (greedy continuations of `prompts`) equal transformers' whole, and
    the reference's top margins where the rest first part: each must be a near-tie (below
    `max_flip_margin`), since only a near-tie may flip greedy's choice."""
    fully_equal, margins = 0, []
    for i, prompt in enumerate(prompts):
        theirs, their_logits = hf_greedy(prompt, num_new)
        mine = ours[i][:len(theirs)]
        for j, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                margin = (their_logits[j, b] - their_logits[j, a]).item()
                margins.append(round(margin, 3))
                assert margin < max_flip_margin, f"prompt {i} step {j}: {a} != {b} ({margin})"
                break
        fully_equal += mine == theirs
    return fully_equal, margins


def kl_divergence(ref: torch.Tensor, ours: torch.Tensor) -> torch.Tensor:
    """KL(ref || ours) per row of logits."""
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(ours, -1)
    return (p.exp() * (p - q)).sum(-1)


def check_logits_against_q4(name: str, ours: torch.Tensor, q4: torch.Tensor, ref: torch.Tensor,
                            *, max_logit_diff: float, max_mean_ratio: float,
                            max_kl_ratio: float) -> float:
    """A rounding's logits (`ours`) against transformers' (`ref`), held to the yardstick of
    the same weights rounded to Q4_0 (`q4`): its largest difference under `max_logit_diff`,
    its mean difference and mean KL under the given shares of the Q4_0 weights'. Returns the
    largest difference (a test may also need it above 0: the rounding's route was taken)."""
    d, d4 = (ours - ref).abs(), (q4 - ref).abs()
    kl, kl4 = kl_divergence(ref, ours).mean().item(), kl_divergence(ref, q4).mean().item()
    print(f"{name}: max {d.max():.3f} mean {d.mean():.3f} KL {kl:.2e}; "
          f"q4_0 weights: max {d4.max():.3f} mean {d4.mean():.3f} KL {kl4:.2e}")
    assert d.max().item() < max_logit_diff
    assert d.mean().item() < max_mean_ratio * d4.mean().item()
    assert kl < max_kl_ratio * kl4
    return d.max().item()
