"""A tiny random Llama base (float32) and random PEFT adapters of it, built with transformers
and peft in a temporary directory; a hand-driven greedy decoder over our ModelRunner."""

from __future__ import annotations

import pytest
import torch

from everystop.config import CacheConfig, ModelConfig
from everystop.core.outputs import ScheduledSequence
from everystop.executor.model_runner import ModelRunner
from everystop.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

torch.set_num_threads(1)  # the test machine is small and shared
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
VOCAB = 256
# name -> LoraConfig options: ranks, alphas, targets and rsLoRA differ from one to the next.
ADAPTERS: dict[str, dict] = {
    "all7": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                     "gate_proj", "up_proj", "down_proj"]),
    "qv": dict(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"]),
    "mlp_rs": dict(r=2, lora_alpha=3, use_rslora=True,
                   target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"]),
    "kod": dict(r=16, lora_alpha=8, target_modules=["k_proj", "o_proj", "down_proj"]),
}


def tiny_config(**overrides) -> object:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                eos_token_id=None)  # no EOS: every greedy run generates all its tokens
    base.update(overrides)
    return transformers.LlamaConfig(**base)


def save_adapter(base_dir: str, out_dir: str, seed: int, **options) -> None:
    """A random PEFT adapter of the base at `base_dir` (B nonzero: init_lora_weights=False),
    its weights scaled up so that each adapter moves the greedy tokens."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    config = peft.LoraConfig(init_lora_weights=False, **options)
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    wrapped.save_pretrained(out_dir)


@pytest.fixture(scope="module")
def lora_dirs(tmp_path_factory) -> tuple[str, dict[str, str]]:
    """(base directory, adapter name -> adapter directory)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config())
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    root = tmp_path_factory.mktemp("lora")
    base = str(root / "base")
    model.save_pretrained(base, safe_serialization=True)
    adapters = {}
    for seed, (name, options) in enumerate(ADAPTERS.items(), start=1):
        adapters[name] = str(root / name)
        save_adapter(base, adapters[name], seed, **options)
    return base, adapters


def make_runner(base: str, adapters: dict[str, str], **model_options) -> ModelRunner:
    """Adapters get ids 0.. in the order given; fp32 weights, activations and KV."""
    config = ModelConfig(model=base, dtype="float32",
                         lora_modules=tuple(adapters.items()), **model_options)
    return ModelRunner(config, CacheConfig(num_gpu_blocks_override=96, swap_space_gib=0.0,
                                           kv_cache_dtype="float32"), 512)


def greedy_generate(runner: ModelRunner, prompts: list[list[int]], lora_ids: list[int],
                    num_new: int, per_seq: int = 16) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy-decode every prompt together (one packed prefill, then packed decode steps),
    prompt i under adapter lora_ids[i] (-1: base). Returns the new tokens per prompt and the
    first step's logits [len(prompts), vocab]."""
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    first = None
    for step in range(num_new):
        seqs = [ScheduledSequence(str(i), tokens[i][computed[i]:], computed[i],
                                  list(range(i * per_seq, (i + 1) * per_seq)), True, GREEDY,
                                  output_index=step, lora_id=lora_ids[i])
                for i in range(len(prompts))]
        _, logits = runner.forward_logits(seqs)
        assert logits is not None
        if first is None:
            first = logits.clone()
        for i, tok in enumerate(logits.argmax(dim=-1).tolist()):
            computed[i] = len(tokens[i])
            tokens[i].append(tok)
    assert first is not None
    return [t[len(p):] for t, p in zip(tokens, prompts)], first


def peft_reference(base: str, adapter: str | None, prompt: list[int],
                   num_new: int) -> tuple[list[int], torch.Tensor]:
    """transformers (+ peft's PeftModel when `adapter` is given): greedy tokens and the first
    step's logits."""
    model = transformers.LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        # An explicit mask: with pad_token_id given, generate() would mask token 0 of a prompt.
        res = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=num_new,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    return res.sequences[0, len(prompt):].tolist(), res.logits[0][0]
