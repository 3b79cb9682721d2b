"""Sliding-window memory on a real model: a Mistral GGUF with window W (16) serves a sequence
of 8W tokens in a KV pool of W/block_size + 4 blocks, far fewer than the sequence's 8 blocks,
holding at most W/block_size + 2 at once, and still decodes what transformers decodes. Neither
the window nor the small pool limits the context (max_model_len stays the model's)."""

from __future__ import annotations

import pytest
import torch

from everystop import LLM, SamplingParams

from .family_builders import SPECS, WINDOW, hf_model, save_gguf

transformers = pytest.importorskip("transformers")

BLOCK = 16
PROMPT, NEW = 6 * WINDOW, 2 * WINDOW  # 8W tokens in all


def test_a_windowed_gguf_holds_only_its_window(tmp_path) -> None:
    spec = SPECS["mistral"]
    gguf = tmp_path / "mistral.gguf"
    stored = save_gguf(spec, hf_model(spec), gguf)
    reference = hf_model(spec)
    reference.load_state_dict(stored, strict=False)
    prompt = torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(3))

    llm = LLM(str(gguf), dtype="float32", kv_cache_dtype="float32", block_size=BLOCK,
              num_gpu_blocks_override=WINDOW // BLOCK + 4, swap_space_gib=0.0,
              max_num_seqs=1, max_num_batched_tokens=BLOCK, chunk_size=BLOCK)
    engine = llm.engine
    assert engine.kv.sliding_window == WINDOW
    # The pool does not cap the context either: the sequence holds only its window.
    assert engine.max_model_len == spec.config["max_position_embeddings"]
    assert engine.kv.blocks_needed(PROMPT + NEW) > engine.kv.num_gpu_blocks
    engine.add_request(prompt.tolist(), SamplingParams(temperature=0.0, max_tokens=NEW,
                                                       ignore_eos=True))
    peak, tokens = 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = out.token_ids
        peak = max(peak, engine.kv.pool.num_used_blocks)
    assert peak <= WINDOW / BLOCK + 2
    with torch.no_grad():
        expected = reference.generate(prompt[None], max_new_tokens=NEW, do_sample=False,
                                      pad_token_id=0)[0, PROMPT:].tolist()
    assert tokens == expected
