"""The draft-model proposer (--speculative draft:PATH): greedy output is token for token what
plain greedy decoding gives, with the default model drafting for itself (every proposal
accepted) and with a tiny model drafting for a larger one of the same tokenizer (proposals
rejected too); a draft with another tokenizer or more parameters is refused at start-up."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from everystop import LLM, SamplingParams
from everystop.config import ConfigError
from everystop.executor.draft_proposer import DraftModelProposer
from everystop.executor.models.loader import default_model_path

from ..models.family_builders import SPECS, Spec, hf_model, save_gguf, save_hf
from .free_draft import free_draft
from .test_speculation_model import GREEDY, OPTIONS, PROMPTS


def _draft_options(path: str, **more: object) -> dict[str, object]:
    return dict(OPTIONS, speculative=f"draft:{path}", num_speculative_tokens=4, **more)


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    llm = LLM(**OPTIONS, model=default_model_path(), max_num_seqs=32)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.model
@pytest.mark.parametrize("max_num_seqs, num_prompts", [(1, 32), (16, 32)])
def test_the_default_model_drafting_for_itself_gives_the_plain_greedy_tokens(
        plain, max_num_seqs: int, num_prompts: int) -> None:
    path = default_model_path()
    llm = free_draft(LLM(**_draft_options(path, model=path, max_num_seqs=max_num_seqs)))
    outs = llm.generate(PROMPTS[:num_prompts], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == plain[:num_prompts]
    stats = llm.engine.stats()
    # The same weights propose what the target verifies: all but near ties are accepted.
    assert stats.spec_decode_num_draft_tokens >= 4 * num_prompts
    assert stats.spec_decode_acceptance_rate > 0.9
    assert llm.engine.kv.pool.num_used_blocks == 0
    llm.engine.scheduler.check_integrity()


def _tiny(tmp_path: Path, name: str, spec: Spec, layers: int) -> str:
    spec = dataclasses.replace(spec, config=dict(spec.config, num_hidden_layers=layers))
    return str(save_hf(spec, hf_model(spec), tmp_path / name))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("draft")


def test_a_smaller_draft_gives_the_plain_greedy_tokens(tiny_dir: Path) -> None:
    target = _tiny(tiny_dir, "target", SPECS["qwen2"], layers=2)
    draft = _tiny(tiny_dir, "draft", SPECS["qwen2"], layers=1)
    prompts = [[3 + i, 40, 41, 42 + i, 43] * 3 for i in range(6)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = LLM(model=target, dtype="float32", max_num_seqs=4)
    spec = free_draft(LLM(model=target, dtype="float32", max_num_seqs=4,
                          speculative=f"draft:{draft}", num_speculative_tokens=3))
    expected = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == expected
    stats = spec.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    # Seeded sampling draws output token i from (seed, i) with or without the draft.
    seeded = SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)
    assert [o.token_ids for o in spec.generate(prompts, seeded, use_tqdm=False)] == [
        o.token_ids for o in plain.generate(prompts, seeded, use_tqdm=False)]
    assert spec.engine.stats().spec_decode_num_draft_tokens > (
        stats.spec_decode_num_draft_tokens)
    spec.engine.scheduler.check_integrity()
    assert spec.engine.kv.pool.num_used_blocks == 0
    # Hot reload: off and back re-attaches the loaded draft; another draft is refused by name.
    engine = spec.engine
    draft_proposer, sched_cfg, cache = engine.scheduler.proposer, engine.config.scheduler, \
        engine.config.cache
    assert draft_proposer is not None
    engine.update_config(sched_cfg.replace(speculative="off"), cache)
    assert engine.scheduler.proposer is None
    engine.update_config(sched_cfg.replace(num_speculative_tokens=2), cache)
    assert engine.scheduler.proposer is draft_proposer
    with pytest.raises(ConfigError, match="speculative 'draft:/other': a draft model is loaded"):
        engine.update_config(sched_cfg.replace(speculative="draft:/other"), cache)


def test_a_q8_0_copy_drafting_for_its_f16_file_gives_the_plain_greedy_tokens(
        tiny_dir: Path) -> None:
    spec, model = SPECS["qwen2"], hf_model(SPECS["qwen2"])
    target, draft = tiny_dir / "f16.gguf", tiny_dir / "q8_0.gguf"
    save_gguf(spec, model, target)
    save_gguf(spec, model, draft, q8_0=True)
    prompts = [[3 + i, 40, 41, 42 + i, 43] * 3 for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    options = dict(model=str(target), dtype="float32", max_num_seqs=4)
    plain = LLM(**options)
    spec_llm = free_draft(LLM(**options, speculative=f"draft:{draft}",
                              num_speculative_tokens=4))
    expected = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in spec_llm.generate(prompts, params, use_tqdm=False)] == expected
    # The same weights to 8 bits: the draft mostly guesses what the target decodes.
    assert spec_llm.engine.stats().spec_decode_acceptance_rate > 0.5
    # Each model runs the kernels its own weights take: the draft's blocks the integer dots
    # (on by default for them), the target's F16 weights fp32 activations.
    proposer = spec_llm.engine.scheduler.proposer
    assert isinstance(proposer, DraftModelProposer)
    draft_kernels = proposer.model.model.embed_tokens.kernels
    target_runner = spec_llm.engine.executor.runner
    assert draft_kernels is not None and draft_kernels.int8_decode_dot
    assert target_runner is not None and target_runner.backends.kernels is not None
    assert not target_runner.backends.kernels.int8_decode_dot


def test_a_draft_with_another_tokenizer_is_refused_by_name(tiny_dir: Path) -> None:
    target = _tiny(tiny_dir, "qwen2", SPECS["qwen2"], layers=2)
    draft = _tiny(tiny_dir, "phi3", SPECS["phi3"], layers=1)  # other special tokens
    with pytest.raises(ConfigError, match="speculative: the draft model's tokenizer differs"):
        LLM(model=target, dtype="float32", speculative=f"draft:{draft}")


def test_a_draft_larger_than_the_target_is_refused_by_name(tiny_dir: Path) -> None:
    target = _tiny(tiny_dir, "small", SPECS["qwen2"], layers=1)
    draft = _tiny(tiny_dir, "large", SPECS["qwen2"], layers=3)
    with pytest.raises(ConfigError, match="speculative: the draft model has more parameters"):
        LLM(model=target, dtype="float32", speculative=f"draft:{draft}")


def test_a_draft_path_that_does_not_exist_is_refused_by_name(tiny_dir: Path) -> None:
    target = _tiny(tiny_dir, "qwen2", SPECS["qwen2"], layers=2)
    with pytest.raises(ConfigError, match=r"speculative: the draft model: .*does not exist"):
        LLM(model=target, dtype="float32", speculative=f"draft:{tiny_dir / 'missing'}")
