"""LoRA adapters against peft's PeftModel on transformers' Llama: logits, 32 greedy tokens,
and a batch mixing every adapter with the base."""

from __future__ import annotations

import pytest
import torch

from everystop.executor.lora import peft_adapter

from .conftest import ADAPTERS, VOCAB, greedy_generate, make_runner, peft_reference

NUM_NEW = 32
LOGIT_TOL = 1e-4


def _prompts(n: int, seed: int = 7) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length,), generator=gen).tolist()
            for length in (5, 23, 40, 9, 31)[:n]]


@pytest.fixture(scope="module")
def runner(lora_dirs):
    base, adapters = lora_dirs
    return make_runner(base, adapters)


@pytest.fixture(scope="module")
def references(lora_dirs):
    """Per adapter name (None: base), per prompt: peft's (tokens, first logits)."""
    base, adapters = lora_dirs
    prompts = _prompts(2)
    return {name: [peft_reference(base, adapters.get(name) if name else None, p, NUM_NEW)
                   for p in prompts] for name in [None, *ADAPTERS]}


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_adapter_matches_peft(runner, references, name):
    lora_id = list(ADAPTERS).index(name)
    prompts = _prompts(2)
    ours, first = greedy_generate(runner, prompts, [lora_id] * len(prompts), NUM_NEW)
    base_tokens = [ref[0] for ref in references[None]]
    for i, (tokens, logits) in enumerate(references[name]):
        assert (first[i] - logits).abs().max().item() < LOGIT_TOL
        assert ours[i] == tokens
    # The adapter matters: the reference tokens are not the base model's.
    assert [ref[0] for ref in references[name]] != base_tokens


def test_batch_mixing_four_adapters_and_base_matches_alone(runner):
    prompts = _prompts(5)
    ids = [0, 1, 2, 3, -1]
    mixed, mixed_first = greedy_generate(runner, prompts, ids, NUM_NEW)
    for i, (prompt, lora_id) in enumerate(zip(prompts, ids)):
        alone, alone_first = greedy_generate(runner, [prompt], [lora_id], NUM_NEW)
        assert mixed[i] == alone[0], f"prompt {i} (adapter id {lora_id})"
        assert torch.allclose(mixed_first[i], alone_first[0], atol=LOGIT_TOL)


def test_base_rows_next_to_adapter_rows_match_peft_base(runner, references):
    """Base rows sharing passes with adapter rows get no delta."""
    prompts = _prompts(2)
    ours, _ = greedy_generate(runner, prompts + prompts, [-1, -1, 0, 1], NUM_NEW)
    assert ours[:2] == [ref[0] for ref in references[None]]


def test_scaling_by_alpha_instead_of_alpha_over_r_fails(lora_dirs, references, monkeypatch):
    """The mutation the reference test must catch: PEFT scales by alpha / r."""
    base, adapters = lora_dirs
    monkeypatch.setattr(peft_adapter, "peft_scale", lambda alpha, rank, rslora: alpha)
    wrong = make_runner(base, adapters)
    prompts = _prompts(2)
    name = "all7"
    _, first = greedy_generate(wrong, prompts, [0] * 2, 1)
    assert (first[0] - references[name][0][1]).abs().max().item() > 100 * LOGIT_TOL
