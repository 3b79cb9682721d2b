"""Batched next-token sampling with per-row parameters (greedy, temperature, top-k, top-p,
min-p, seeds; penalties, biases, min_tokens and structured output's token masks through
`logits_controls`) and optional
logprobs, vectorized over rows.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with
probability p_i. The noise is drawn in vocabulary order, so a seeded row's choice depends only
on its own logits and its (seed, output_index) stream, never on the rest of the batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from everystop.core.outputs import ScheduledSequence, TokenLogprob
from everystop.executor.layers.cpu_kernels import CpuKernels
from everystop.executor.logits_controls import (
    apply_controls,
    apply_min_p,
    apply_token_bitmasks,
)
from everystop.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None where the row did not ask for logprobs


def seed_for_step(seed: int, output_index: int) -> int:
    """A 63-bit generator seed for token `output_index` of a request seeded with `seed`."""
    digest = hashlib.blake2b(f"{seed}:{output_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Sampler:
    """Samples one token per row. Unseeded rows draw from this sampler's own generator."""

    def __init__(self, device: torch.device | str, seed: int = 0,
                 kernels: CpuKernels | None = None) -> None:
        self.device = torch.device(device)
        self.kernels = kernels
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 output_indices: Sequence[int],
                 seqs: Sequence[ScheduledSequence] | None = None) -> SamplerOutput:
        """logits: [N, vocab] float32 (unmodified); one SamplingParams and output index per row;
        `seqs` (one per row) gives the penalties their tokens seen and min_tokens its EOS id."""
        vocab = logits.shape[1]
        greedy_rows = [p.greedy for p in params]
        controlled = apply_controls(logits, params, output_indices, seqs)
        if seqs is not None and any(s.token_bitmask is not None for s in seqs):
            controlled = apply_token_bitmasks(controlled, seqs)
        tokens = _argmax(controlled, self.kernels)
        if not all(greedy_rows):
            greedy = torch.tensor(greedy_rows, device=logits.device)
            sampled = self._sample(controlled, params, output_indices, vocab)
            tokens = torch.where(greedy, tokens, sampled)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, _logprobs(logits, tokens, token_list, params))

    def _sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                output_indices: Sequence[int], vocab: int) -> torch.Tensor:
        dev = logits.device
        # Greedy rows get temperature 1 here; their result is discarded by the caller.
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                             device=dev, dtype=torch.float32)
        scaled = logits / temps[:, None]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        if any(p.min_p for p in params):
            scaled = apply_min_p(scaled, torch.tensor([p.min_p for p in params], device=dev))
        if min(top_k) < vocab or min(top_p) < 1.0:
            scaled = _apply_top_k_top_p(scaled, torch.tensor(top_k, device=dev),
                                        torch.tensor(top_p, device=dev, dtype=torch.float32))
        probs = torch.softmax(scaled, dim=-1)
        noise = self._noise(params, output_indices, probs.shape, dev)
        return _argmax(probs.div_(noise), self.kernels)

    def _noise(self, params: Sequence[SamplingParams], output_indices: Sequence[int],
               shape: torch.Size, dev: torch.device) -> torch.Tensor:
        noise = torch.empty(shape, device=dev)
        unseeded = [i for i, p in enumerate(params) if p.seed is None and not p.greedy]
        if unseeded:
            rows = torch.empty((len(unseeded), shape[1]), device=dev)
            rows.exponential_(generator=self.generator)
            noise[unseeded] = rows
        for i, p in enumerate(params):
            if p.seed is not None and not p.greedy:
                gen = torch.Generator(device=dev).manual_seed(seed_for_step(p.seed,
                                                                            output_indices[i]))
                noise[i].exponential_(generator=gen)
        # Greedy rows keep whatever noise they got (unused); keep them finite and positive.
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            noise[greedy] = 1.0
        # NOTE: Exp(1) samples can be exactly 0; p / 0 would be NaN for a masked token (p = 0),
        # and argmax treats NaN as the maximum.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _argmax(x: torch.Tensor, kernels: CpuKernels | None) -> torch.Tensor:
    """Row argmax (first maximal index), through the fused CPU op where it applies."""
    if kernels is not None and kernels.handles(x) and x.dtype == torch.float32 and \
            x.stride(-1) == 1:
        return kernels.argmax_rows(x)
    return x.argmax(dim=-1)


def _apply_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus to -inf (the best token always
    survives)."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    drop = ranks >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens ranked above it already cover top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    keep = torch.zeros_like(drop).scatter_(-1, order, ~drop)
    return scaled.masked_fill(~keep, float("-inf"))


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, token_list: list[int],
              params: Sequence[SamplingParams]) -> list[TokenLogprob | None]:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(params)
    if not rows:
        return out
    # Logprobs describe the model's distribution, before temperature/top-k/top-p (as OpenAI).
    logp = torch.log_softmax(logits[rows], dim=-1)
    chosen = logp.gather(-1, tokens[rows][:, None]).squeeze(-1).tolist()
    k = max(params[i].logprobs or 0 for i in rows)
    top_vals, top_ids = (logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long()))
    top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        want = params[i].logprobs or 0
        out[i] = TokenLogprob(token_id=token_list[i], logprob=chosen[j],
                              top=list(zip(top_ids_l[j][:want], top_vals_l[j][:want])))
    return out
