"""The fused CPU ops of every kernel build this CPU can run (AVX-512 with BF16, AVX-512, AVX2,
generic) agree with the plain-torch layers they replace (fp32 tightly, 16-bit up to one
rounding), and the model gives the same logits with them on or off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from everystop.config import CacheConfig, ConfigError, ModelConfig
from everystop.executor.layers.attention import write_kv
from everystop.executor.layers.cpu_kernels import CpuKernels, load_cpu_kernels, runnable_isas
from everystop.executor.layers.linear import SMALL_ROWS, linear
from everystop.executor.layers.norm import RMSNorm
from everystop.executor.layers.rotary import apply_rope, rope_cos_sin, rope_inv_freq
from everystop.executor.model_runner import ModelRunner

from .conftest import greedy_generate


@pytest.fixture(params=runnable_isas())
def kernels(request) -> CpuKernels:
    """Each kernel build this CPU can execute (a build failure fails the test)."""
    loaded = load_cpu_kernels(request.param)
    assert loaded is not None
    return loaded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_torch(dtype, kernels):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, generator=g).to(dtype)
    x = (3 * torch.randn(7, 96, generator=g)).to(dtype)
    fused_norm, plain_norm = RMSNorm(96, 1e-5, kernels).to(dtype), RMSNorm(96, 1e-5).to(dtype)
    fused_norm.weight.data = plain_norm.weight.data = weight
    fused, plain = fused_norm(x), plain_norm(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused.float(), plain.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_add_then_norm(dtype, kernels):
    g = torch.Generator().manual_seed(6)
    weight = torch.randn(96, generator=g).to(dtype)
    x, residual = (3 * torch.randn(2, 7, 96, generator=g)).to(dtype)
    fused_norm, plain_norm = RMSNorm(96, 1e-5, kernels).to(dtype), RMSNorm(96, 1e-5).to(dtype)
    fused_norm.weight.data = plain_norm.weight.data = weight
    plain_out, plain_sum = plain_norm(x, residual.clone())
    stream = residual.clone()
    fused_out, fused_sum = fused_norm(x, stream)
    assert fused_sum is stream  # updated in place: the stream the caller owns
    assert torch.equal(fused_sum, plain_sum)  # the add rounds exactly as torch's
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused_out.float(), plain_out.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype, kernels):
    gu = torch.randn(5, 2 * 40, generator=torch.Generator().manual_seed(1))
    gu[0] *= 60  # gates far into both tails: exp must neither overflow nor lose the sign
    gu = gu.to(dtype)
    ref = F.silu(gu[:, :40]) * gu[:, 40:]
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kernels.silu_mul(gu).float(), ref.float(), atol=tol, rtol=tol)


def test_silu_mul_bf16_rounds_like_torch(kernels):
    # The vector path rounds silu(gate) and the product to bf16 as torch does; only the
    # exponential's last-bit error may flip a rounding, so nearly every value is identical.
    gu = (torch.randn(32, 2 * 1536, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()
    ref = F.silu(gu[:, :1536]) * gu[:, 1536:]
    assert (kernels.silu_mul(gu) == ref).float().mean().item() > 0.999


def test_rope_in_place_matches_torch_on_a_strided_view(kernels):
    g = torch.Generator().manual_seed(2)
    cos, sin = rope_cos_sin(torch.tensor([0, 5, 17, 300]), rope_inv_freq(32, 1e4, None))
    qkv = torch.randn(4, 5 * 32, generator=g)
    k_view = qkv[:, 3 * 32:].view(4, 2, 32)  # rows strided by the fused qkv width
    expected = apply_rope(k_view.clone(), cos, sin)
    before = qkv[:, :3 * 32].clone()
    out = apply_rope(k_view, cos, sin, kernels)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qkv[:, 3 * 32:].view(4, 2, 32), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, :3 * 32], before)  # neighbours untouched


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32),
                                               (torch.float32, torch.float16),
                                               (torch.bfloat16, torch.bfloat16)])
def test_rope_write_kv_matches_rope_then_write_kv(dtype, cache_dtype, kernels):
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, d, tokens = 3, 1, 32, 5
    cos, sin = rope_cos_sin(torch.tensor([0, 3, 17, 40, 41]), rope_inv_freq(d, 1e4, None))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    slots = torch.tensor([9, 2, 30, 31, 0])
    shape = (4, 8, kv_heads, d)  # 4 blocks of 8 slots
    ref_k, ref_v = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    q, k, v = qkv.clone().split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    ref_q = apply_rope(q.reshape(tokens, heads, d), cos, sin, kernels)
    k = apply_rope(k.reshape(tokens, kv_heads, d), cos, sin, kernels)
    write_kv(ref_k, ref_v, k, v.reshape(tokens, kv_heads, d), slots)
    kc, vc = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    kernels.rope_write_kv_(qkv, cos, sin, kc, vc, slots, heads, kv_heads)
    assert torch.equal(qkv[:, :heads * d].reshape(tokens, heads, d), ref_q)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


@pytest.mark.parametrize("cols", [1000, 1003, 5])  # 1003, 5: values past the last vector
def test_argmax_rows_first_maximum_and_nan(kernels, cols):
    x = torch.randn(11, cols, generator=torch.Generator().manual_seed(3))
    x[1] = 2.0  # all tied: first index
    x[2, 1] = x[2, cols - 2] = 50.0
    x[3, 4] = float("nan")
    x[4, :] = float("-inf")
    x[5, cols - 1] = 60.0  # the maximum last
    x[6, cols - 1] = float("nan")  # a NaN last
    x[7, 0] = x[7, cols - 1] = float("nan")  # the first NaN of two
    x[8] = -1.0
    x[8, 3], x[8, 2] = 0.0, -0.0  # equal zeros: the first of them
    x[9, 2] = float("inf")
    x[10, cols - 3] = float("nan")
    x[10, 0] = float("inf")
    assert kernels.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8])
def test_linear_small_matches_fp32_matmul(dtype, rows, kernels):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(rows, 100, generator=g).to(dtype)  # 100: a tail after the 8/16-wide chunks
    w = torch.randn(70, 100, generator=g).to(dtype)  # 70: a tail after the column groups
    ref = x.float() @ w.float().T
    out = kernels.linear_small(x, w)
    assert out.dtype == dtype and out.shape == (rows, 70)
    # fp32 accumulation: only the final rounding to the output dtype differs.
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("k", [100, 576, 1536])
@pytest.mark.parametrize("rows", [1, 2])
def test_linear_small_bf16_weights_beside_fp32_rows(k, rows, kernels):
    """`--quantization bf16` under `--dtype float32`: the weights widen exactly (on x86 builds
    one row reads them as even/odd pairs against a reordered copy of x), so the product matches
    fp32 to accumulation-order error, with or without a k remainder after the 32-wide steps."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(70, k, generator=g).bfloat16()
    ref = x.double() @ w.double().T
    out = kernels.linear_small(x, w)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * k ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_agrees_with_f_linear_on_every_route(dtype, kernels):
    """Small inputs take the GEMV, larger ones the packed fp32 GEMM (whose stand-in "original
    weight" is zeros: if MKL ever fell back to it, the result would be zeros, not this)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 160, generator=g).to(dtype)
    for rows in (0, 1, SMALL_ROWS, SMALL_ROWS + 1, 64, 300):
        x = torch.randn(rows, 160, generator=g).to(dtype)
        ref = x.float() @ w.float().T
        out = linear(x, w, kernels)
        assert out.dtype == dtype and out.shape == (rows, 96)
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        scale = ref.abs().max().item() if rows else 1.0
        torch.testing.assert_close(out.float(), ref, atol=tol * scale, rtol=tol)


@pytest.mark.model
def test_model_logits_same_with_and_without_fused_ops(default_runner):
    prompts = [list(range(1000, 1037)), list(range(3000, 3005))]
    assert default_runner.backends.kernels is not None
    plain_runner = ModelRunner(ModelConfig(cpu_kernels="off"),
                               CacheConfig(num_gpu_blocks_override=16,
                                           kv_cache_dtype="float32"), max_model_len=2048)
    fused_tokens, fused_logits = greedy_generate(default_runner, prompts, 4, per_seq=4)
    plain_tokens, plain_logits = greedy_generate(plain_runner, prompts, 4, per_seq=4)
    torch.testing.assert_close(fused_logits, plain_logits, atol=1e-3, rtol=1e-4)
    assert fused_tokens == plain_tokens


@pytest.mark.parametrize("has_16bit_gemm", [True, False])
def test_16bit_gemm_route_follows_the_config(monkeypatch, has_16bit_gemm):
    # Both CPU kinds on any machine: whether oneDNN has a bf16 GEMM is patched, not read.
    from everystop.executor import model_runner
    from everystop.executor.model_runner import select_backends

    monkeypatch.setattr(model_runner, "onednn_bf16_gemm_supported", lambda: has_16bit_gemm)
    blocks = True  # the default model's Q4_1 weights
    fp32 = select_backends(ModelConfig(dtype="bfloat16", cpu_16bit_gemm="fp32"), blocks)
    assert fp32.kernels is not None and fp32.kernels.fp32_gemm_for_16bit is True
    auto = select_backends(ModelConfig(dtype="bfloat16", cpu_16bit_gemm="auto"), blocks)
    assert auto.kernels is not None and isinstance(auto.kernels.fp32_gemm_for_16bit, bool)
    if has_16bit_gemm:
        native = select_backends(ModelConfig(dtype="bfloat16", cpu_16bit_gemm="native"), blocks)
        assert native.kernels is not None and native.kernels.fp32_gemm_for_16bit is False
    else:
        # An AVX2-only CPU: oneDNN cannot build a bf16 GEMM, so "native" is refused by name
        # and "auto" never picks it (the first block-weight prefill would fail).
        assert auto.kernels.fp32_gemm_for_16bit is True
        with pytest.raises(ConfigError, match=r"cpu_16bit_gemm 'native'.*no bfloat16 GEMM"):
            select_backends(ModelConfig(dtype="bfloat16", cpu_16bit_gemm="native"), blocks)


def test_the_bf16_gemm_check_matches_what_onednn_builds():
    from everystop.executor.layers.linear import onednn_bf16_gemm_supported

    x, w = torch.randn(12, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    try:
        torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        builds = True
    except RuntimeError:
        builds = False
    assert onednn_bf16_gemm_supported() is builds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [9, 13, 29, 64])
def test_linear_small_takes_decode_batches_8_rows_at_a_time(dtype, rows, kernels):
    # 4096 columns: the weight's column groups (~256 KiB each) are fewer columns than the
    # weight's 70, so the rows go 8 at a time over more than one group.
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 4096, generator=g).to(dtype)
    w = torch.randn(70, 4096, generator=g).to(dtype)
    ref = x.float() @ w.float().T
    out = kernels.linear_small(x, w)
    assert out.dtype == dtype and out.shape == (rows, 70)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


def test_the_build_root_is_torchs_without_importing_its_build_module():
    import subprocess
    import sys

    code = ("import sys, torch; from everystop.executor.layers.cpu_kernels import "
            "_default_build_root as ours; root = ours(); "
            "assert 'torch.utils.cpp_extension' not in sys.modules; "
            "from torch.utils.cpp_extension import get_default_build_root as theirs; "
            "assert root == theirs(), (root, theirs())")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
