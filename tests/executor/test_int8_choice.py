"""`--int8-decode-dot auto`: int8 activations exactly where block weights meet CPU kernels with
an integer dot path, off for float weights; explicit on/off win; a model under auto computes
what the setting it chose computes when named, and what it computes for a prompt does not
depend on its chunking or a prefix-cache hit."""

from __future__ import annotations

import argparse
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from everystop import LLM, SamplingParams
from everystop.config import CacheConfig, ConfigError, ModelConfig
from everystop.engine.args import add_engine_args, engine_config_from_args
from everystop.executor.dtype_choice import weights_are_blocks
from everystop.executor.int8_choice import choose_int8_decode_dot, integer_dot_path
from everystop.executor.layers.cpu_kernels import CpuKernels, load_cpu_kernels, runnable_isas
from everystop.executor.model_runner import ModelRunner, select_backends
from everystop.executor.models.loader import default_model_path
from tests.tiny_llama import llama_config, save_random_llama

from .conftest import greedy_generate

KERNELS = CpuKernels(isa="avx512")  # never called: the probes below stand in for its library


def _choose(blocks: bool, path: str | None = "AVX512-VNNI",
            kernels: CpuKernels | None = KERNELS, **config: object) -> bool:
    config.setdefault("int8_decode_dot", "auto")
    return choose_int8_decode_dot(ModelConfig(**config), kernels,  # type: ignore[arg-type]
                                  blocks, dot_path=lambda k: path)[0]


def test_auto_takes_int8_exactly_for_block_weights_with_an_integer_dot_path() -> None:
    assert _choose(blocks=True)
    assert _choose(blocks=True, path="AVX2 maddubs")
    assert not _choose(blocks=False)  # float/16-bit weights
    assert not _choose(blocks=True, path=None)  # a build with no integer dot path
    assert not _choose(blocks=True, kernels=None)  # plain torch


def test_explicit_settings_override_auto() -> None:
    for blocks in (True, False):
        for path in ("AVX512-VNNI", None):
            assert _choose(blocks, path, int8_decode_dot="on")
            assert not _choose(blocks, path, int8_decode_dot="off")


def test_cli_and_config_default_to_auto_and_take_explicit_settings() -> None:
    parser = add_engine_args(argparse.ArgumentParser())

    def parsed(*argv: str) -> str:
        return engine_config_from_args(parser.parse_args(list(argv))).model.int8_decode_dot

    assert parsed() == "auto" and ModelConfig().int8_decode_dot == "auto"
    assert parsed("--int8-decode-dot") == "on"  # the bare flag
    for value in ("auto", "on", "off"):
        assert parsed("--int8-decode-dot", value) == value
    with pytest.raises(SystemExit):
        parsed("--int8-decode-dot", "yes")
    with pytest.raises(ConfigError, match="int8_decode_dot"):
        ModelConfig(int8_decode_dot="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("isa", runnable_isas())
def test_every_x86_build_but_generic_names_an_integer_dot_path(isa: str) -> None:
    kernels = load_cpu_kernels(isa)
    assert kernels is not None
    path = integer_dot_path(kernels)
    assert (path is None) == (isa == "generic"), path


@pytest.mark.parametrize("cap", ["ATEN_CPU_CAPABILITY=avx2", "ONEDNN_MAX_CPU_ISA=AVX2"])
def test_an_avx2_cap_keeps_the_dots_off_avx512(cap: str) -> None:
    """An AVX2 machine reproduced on a wider one (the environment capping the ISA, as
    cpu_kernels.cpu_flags reads it) takes the dot path an AVX2 machine has: the kernels never
    reach for AVX512-VNNI, which this CPU may have."""
    name, value = cap.split("=")
    code = ("from everystop.executor.int8_choice import integer_dot_path\n"
            "from everystop.executor.layers.cpu_kernels import load_cpu_kernels\n"
            "print(integer_dot_path(load_cpu_kernels('auto')))")
    env = {**os.environ, name: value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600, check=True).stdout.strip().splitlines()
    assert out and out[-1] in ("AVX2 maddubs", "AVX-VNNI", "None"), out


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny_llama_int8")
    save_random_llama(llama_config(vocab_size=512, hidden_size=256, intermediate_size=512),
                      path, std=0.05)
    return str(path)


@pytest.mark.parametrize(("quantization", "expected"), [("auto", False), ("q8_0", True),
                                                        ("q4_0", True), ("bf16", False)])
def test_backends_follow_the_weights_and_log_the_choice(
        tiny_llama: str, quantization: str, expected: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    """Float safetensors held as they are (or 16-bit): off; quantized at load: on. The choice
    and its reason are logged once, at start-up."""
    blocks = weights_are_blocks(tiny_llama, quantization)  # as ModelRunner reads it
    with caplog.at_level(logging.INFO, logger="everystop.executor.model_runner"):
        backends = select_backends(ModelConfig(model=tiny_llama, dtype="float32",
                                               quantization=quantization,
                                               int8_decode_dot="auto"), blocks)
    assert backends.kernels is not None
    assert backends.kernels.int8_decode_dot == expected
    # int8 rounding would magnify a row count's last-bit differences: on brings invariance.
    assert backends.kernels.batch_invariant == expected
    lines = [r.getMessage() for r in caplog.records if "int8 decode dot auto" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(
        f"int8 decode dot auto: {'on' if expected else 'off'} ("), lines
    with caplog.at_level(logging.INFO, logger="everystop.executor.model_runner"):
        caplog.clear()
        select_backends(ModelConfig(model=tiny_llama, dtype="float32",
                                    quantization=quantization, int8_decode_dot="off"), blocks)
    assert not [r for r in caplog.records if "int8 decode dot" in r.getMessage()]


def test_outputs_under_auto_equal_the_setting_it_chose(tiny_llama: str, tmp_path: Path) -> None:
    """Q4_0 weights: auto computes bit-identically what an explicit "on" computes, and not
    what "off" does (the rounding is real)."""
    prompts = [[1, 5, 9, 200, 17], list(range(3, 60))]
    logits = {}
    for setting in ("auto", "on", "off"):
        runner = ModelRunner(ModelConfig(model=tiny_llama, dtype="float32", quantization="q4_0",
                                         int8_decode_dot=setting),  # type: ignore[arg-type]
                             CacheConfig(num_gpu_blocks_override=32, swap_space_gib=0.0,
                                         kv_cache_dtype="float32"), 256)
        tokens, first = greedy_generate(runner, prompts, 4, 16)
        logits[setting] = (tokens, first)
    assert logits["auto"][0] == logits["on"][0]
    assert torch.equal(logits["auto"][1], logits["on"][1])
    assert not torch.equal(logits["on"][1], logits["off"][1])


def _first_logprobs(llm: LLM, prompts: list[list[int]]) -> list[float]:
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
    return [next(iter(o.outputs[0].logprobs[0].values())).logprob for o in outs]


@pytest.mark.parametrize("int8", ["auto", "off"])
def test_a_prompts_logprobs_do_not_depend_on_its_chunks_or_a_cache_hit(tiny_llama: str,
                                                                        int8: str) -> None:
    """Q4_0 weights, defaults otherwise: the first token's logprob is the same to the bit
    whether the prompt ran in one pass, in 24-token chunks beside others, or after a
    prefix-cache hit. With fp32 activations ("off", not batch-invariant) the same runs differ
    in the last bits, which shows the chunkings really differ."""
    gen = random.Random(0)
    prompts = [[gen.randrange(2, 500) for _ in range(gen.randrange(40, 200))] for _ in range(6)]
    common = dict(tokenizer=default_model_path(), quantization="q4_0", int8_decode_dot=int8,
                  enable_prefix_caching=True, block_size=16, max_num_seqs=4)
    whole = LLM(tiny_llama, max_num_batched_tokens=512, **common)
    cold = _first_logprobs(whole, prompts)
    hit = _first_logprobs(whole, prompts)  # every full block of each prompt is cached now
    chunked = _first_logprobs(LLM(tiny_llama, max_num_batched_tokens=24, **common), prompts)
    if int8 == "auto":
        assert cold == hit == chunked
    else:
        assert cold != chunked or cold != hit
        assert max(abs(a - b) for a, b in zip(cold * 2, chunked + hit)) < 1e-3
