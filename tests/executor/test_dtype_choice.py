"""`--dtype auto`: bf16 exactly where the CPU multiplies bf16 natively and the weights are
float, fp32 elsewhere; explicit dtypes win; a model under auto computes what the dtype it chose
computes when named."""

from __future__ import annotations

import pytest
import torch

from everystop.config import CacheConfig, ModelConfig
from everystop.engine.args import add_engine_args, engine_config_from_args
from everystop.executor.dtype_choice import choose_dtype, weights_are_blocks
from everystop.executor.layers.cpu_kernels import cpu_flags
from everystop.executor.model_runner import ModelRunner
from everystop.executor.models.loader import default_model_path

from .conftest import greedy_generate
from .test_hf_loader import tiny_dir  # noqa: F401  (fixture)

AVX2 = frozenset({"avx2", "fma", "f16c"})
ZEN4 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
SAPPHIRE = AVX2 | {"avx512f", "avx512bw", "avx512vl", "amx_tile", "amx_bf16"}


def _choose(flags: frozenset[str], blocks: bool = False, gemm: bool = True, **config) -> str:
    return choose_dtype(ModelConfig(**config), blocks, flags=lambda: flags,
                        bf16_gemm=lambda: gemm)[0]


def test_auto_picks_bf16_exactly_where_the_cpu_has_native_bf16():
    assert _choose(ZEN4) == "bfloat16"
    assert _choose(SAPPHIRE) == "bfloat16"
    assert _choose(AVX2) == "float32"
    assert _choose(AVX2 | {"avx512f", "avx512bw"}) == "float32"  # AVX-512 without bf16 dots
    assert _choose(ZEN4, gemm=False) == "float32"  # oneDNN builds no bf16 GEMM
    assert _choose(ZEN4, cpu_kernels="off") == "float32"


def test_auto_keeps_fp32_for_block_weights():
    assert _choose(ZEN4, blocks=True) == "float32"
    assert _choose(SAPPHIRE, blocks=True) == "float32"


def test_explicit_dtypes_override_auto():
    for dtype in ("float32", "bfloat16", "float16"):
        assert _choose(ZEN4, dtype=dtype) == dtype
        assert _choose(AVX2, dtype=dtype) == dtype
        assert _choose(ZEN4, blocks=True, dtype=dtype) == dtype


def test_cli_and_config_default_to_auto_and_take_explicit_dtypes():
    import argparse

    parser = add_engine_args(argparse.ArgumentParser())
    assert engine_config_from_args(parser.parse_args([])).model.dtype == "auto"
    assert engine_config_from_args(parser.parse_args(["--dtype", "float32"])).model.dtype \
        == "float32"
    assert ModelConfig().dtype == "auto"


def test_weight_kind_is_read_from_the_file(tiny_dir):  # noqa: F811
    assert weights_are_blocks(default_model_path(), "auto")  # the shipped Q4_1 GGUF
    assert not weights_are_blocks(default_model_path(), "none")
    assert not weights_are_blocks(tiny_dir[0], "auto")  # safetensors: float weights
    assert weights_are_blocks(tiny_dir[0], "q8_0")


def test_outputs_under_auto_equal_the_dtype_it_chose(tiny_dir):  # noqa: F811
    path = tiny_dir[0]
    chosen, _ = choose_dtype(ModelConfig(model=path), weights_are_blocks(path, "auto"))

    def run(dtype: str) -> tuple[list[list[int]], torch.Tensor]:
        runner = ModelRunner(ModelConfig(model=path, dtype=dtype),
                             CacheConfig(num_gpu_blocks_override=64, swap_space_gib=0.0), 512)
        assert runner.dtype == getattr(torch, chosen)
        return greedy_generate(runner, [[1, 2, 3, 4, 5], list(range(40, 90))], 8, per_seq=16)

    auto_tokens, auto_logits = run("auto")
    named_tokens, named_logits = run(chosen)
    assert auto_tokens == named_tokens
    assert torch.equal(auto_logits, named_logits)


@pytest.mark.skipif(not ({"avx512_bf16", "amx_bf16"} & cpu_flags()),
                    reason="this CPU has no native bf16: auto is fp32 here (covered above)")
def test_auto_runs_bf16_on_this_native_bf16_cpu(tiny_dir):  # noqa: F811
    path = tiny_dir[0]
    dtype, why = choose_dtype(ModelConfig(model=path), weights_are_blocks(path, "auto"))
    assert dtype == "bfloat16", why


@pytest.mark.parametrize(("var", "value"), [("ATEN_CPU_CAPABILITY", "avx2"),
                                            ("ONEDNN_MAX_CPU_ISA", "AVX2")])
def test_an_avx2_cap_in_the_environment_gives_an_avx2_machines_defaults(
        monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    from everystop.executor.layers.cpu_kernels import runnable_isas

    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    full = cpu_flags()
    monkeypatch.setenv(var, value)
    capped = cpu_flags()
    assert capped <= full and not any(f.startswith(("avx512", "amx")) for f in capped)
    assert runnable_isas()[0] in ("avx2", "generic")
    assert choose_dtype(ModelConfig(), False, bf16_gemm=lambda: True)[0] == "float32"
