"""Every registered family against transformers: a tiny random checkpoint of each (see
family_builders.py) loaded from its HF directory and from GGUF (F16, Q8_0) must give the
prompt logits transformers gives (fp32, within LOGIT_TOL) and the same 32 greedy tokens, with
prompts past the sliding window of the windowed families, batched as alone."""

from __future__ import annotations

import pytest
import torch

from everystop.config import CacheConfig, ModelConfig
from everystop.executor.model_runner import ModelRunner

from ..executor.conftest import greedy_generate
from .family_builders import SPECS, VOCAB, WINDOW, Spec, hf_model, save_gguf, save_hf

transformers = pytest.importorskip("transformers")

# fp32 on both sides; the difference is summation order (and, from GGUF, 16-bit weights
# widened by our kernels where transformers holds the same values in fp32).
LOGIT_TOL = 2e-3
NEW_TOKENS = 32
# Longer than WINDOW (16) and than a 16-token block: windowed layers drop whole blocks.
PROMPT_LENS = (3, 21, 70)


def _runner(path: str) -> ModelRunner:
    # fp32 activations (none rounded to int8 for Q8_0 weights) and KV: the reference comparison
    # is exact to 1e-3.
    return ModelRunner(ModelConfig(model=path, dtype="float32", int8_decode_dot="off"),
                       CacheConfig(num_gpu_blocks_override=64, swap_space_gib=0.0,
                                   kv_cache_dtype="float32"), 256)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _reference(hf, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy tokens and first-step logits per prompt."""
    out = []
    for prompt in prompts:
        with torch.no_grad():
            res = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                              do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0)
        out.append((res.sequences[0, len(prompt):].tolist(), res.logits[0][0]))
    return out


def _check(runner: ModelRunner, hf) -> None:
    prompts = _prompts()
    reference = _reference(hf, prompts)
    ours, first = greedy_generate(runner, prompts, NEW_TOKENS, per_seq=8)
    for i, (tokens, logits) in enumerate(reference):
        err = (first[i] - logits).abs().max().item()
        assert err < LOGIT_TOL, f"prompt {i}: logits differ by {err}"
        assert ours[i] == tokens, f"prompt {i}"
    # Each sequence alone decodes what it decoded in the batch.
    alone, _ = greedy_generate(runner, prompts[-1:], NEW_TOKENS, per_seq=8)
    assert alone[0] == ours[-1]


@pytest.fixture(scope="module", params=sorted(SPECS))
def family(request, tmp_path_factory):
    spec = SPECS[request.param]
    hf = hf_model(spec)
    path = save_hf(spec, hf, tmp_path_factory.mktemp(spec.name))
    return spec, hf, path


def _check_window(spec: Spec, runner: ModelRunner, hf) -> None:
    """A windowed family's window is a window, not the model's context limit."""
    if spec.windowed:
        assert WINDOW in runner.model.args.layer_windows
        assert max(PROMPT_LENS) > 2 * WINDOW
        assert runner.model.args.max_position_embeddings == hf.config.max_position_embeddings


def test_hf_directory_matches_transformers(family) -> None:
    spec, hf, path = family
    runner = _runner(str(path))
    assert runner.model.args.vocab_size == VOCAB
    _check_window(spec, runner, hf)
    _check(runner, hf)


# Families llama.cpp exports (Mistral as "llama", its window in the metadata).
GGUF_FAMILIES = sorted(name for name, spec in SPECS.items() if spec.gguf_arch)


@pytest.mark.parametrize("q8_0", [False, True], ids=["f16", "q8_0"])
@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_gguf_matches_transformers(name, q8_0, tmp_path) -> None:
    spec = SPECS[name]
    hf = hf_model(spec)
    gguf = tmp_path / f"{spec.name}.gguf"
    stored = save_gguf(spec, hf, gguf, q8_0=q8_0)
    reference = hf_model(spec)
    reference.load_state_dict(stored, strict=False)  # the values the file holds
    runner = _runner(str(gguf))
    _check_window(spec, runner, hf)
    _check(runner, reference)


def test_chat_template_renders_as_transformers(family, tmp_path) -> None:
    from everystop.tokenizer import load_tokenizer

    spec, hf, path = family
    messages = [{"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "What is 2+2?"}]
    expected = transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert load_tokenizer(str(path)).render_chat(messages) == expected
    if spec.gguf_arch is not None:
        gguf = tmp_path / f"{spec.name}.gguf"
        save_gguf(spec, hf, gguf)
        assert load_tokenizer(str(gguf)).render_chat(messages) == expected
