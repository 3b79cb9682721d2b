"""The fused CPU ops agree with the plain-torch layers they replace (fp32 tightly, 16-bit up to
one rounding), and the model gives the same logits with them on or off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from everystop.executor.layers import attention_cpu, cpu_ops
from everystop.executor.layers.linear import SMALL_ROWS, linear
from everystop.executor.layers.norm import RMSNorm
from everystop.executor.layers.rotary import apply_rope, rope_cos_sin, rope_inv_freq

from .conftest import greedy_generate

pytestmark = pytest.mark.skipif(not attention_cpu.kernel_available(),
                                reason="the CPU kernel library did not build")


@pytest.fixture
def torch_path():
    """Run the block under plain torch ops, then restore the fused path."""
    cpu_ops.set_enabled(False)
    yield
    cpu_ops.set_enabled(True)


def _both(fn):
    fused = fn()
    cpu_ops.set_enabled(False)
    try:
        plain = fn()
    finally:
        cpu_ops.set_enabled(True)
    return fused, plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_torch(dtype):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-5).to(dtype)
    norm.weight.data = torch.randn(96, generator=g).to(dtype)
    x = (3 * torch.randn(7, 96, generator=g)).to(dtype)
    fused, plain = _both(lambda: norm(x))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused.float(), plain.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype):
    gu = torch.randn(5, 2 * 40, generator=torch.Generator().manual_seed(1))
    gu[0] *= 60  # gates far into both tails: exp must neither overflow nor lose the sign
    gu = gu.to(dtype)
    ref = F.silu(gu[:, :40]) * gu[:, 40:]
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(cpu_ops.silu_mul(gu).float(), ref.float(), atol=tol, rtol=tol)


def test_silu_mul_bf16_rounds_like_torch():
    # The vector path rounds silu(gate) and the product to bf16 as torch does; only the
    # exponential's last-bit error may flip a rounding, so nearly every value is identical.
    gu = (torch.randn(32, 2 * 1536, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()
    ref = F.silu(gu[:, :1536]) * gu[:, 1536:]
    assert (cpu_ops.silu_mul(gu) == ref).float().mean().item() > 0.999


def test_rope_in_place_matches_torch_on_a_strided_view():
    g = torch.Generator().manual_seed(2)
    cos, sin = rope_cos_sin(torch.tensor([0, 5, 17, 300]), rope_inv_freq(32, 1e4, None))
    qkv = torch.randn(4, 5 * 32, generator=g)
    k_view = qkv[:, 3 * 32:].view(4, 2, 32)  # rows strided by the fused qkv width
    cpu_ops.set_enabled(False)
    expected = apply_rope(k_view.clone(), cos, sin)
    cpu_ops.set_enabled(True)
    before = qkv[:, :3 * 32].clone()
    out = apply_rope(k_view, cos, sin)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qkv[:, 3 * 32:].view(4, 2, 32), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, :3 * 32], before)  # neighbours untouched


def test_argmax_rows_first_maximum_and_nan():
    x = torch.randn(6, 1000, generator=torch.Generator().manual_seed(3))
    x[1] = 2.0  # all tied: first index
    x[2, 10] = x[2, 900] = 50.0
    x[3, 77] = float("nan")
    x[4, :] = float("-inf")
    assert cpu_ops.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
def test_linear_small_matches_fp32_matmul(dtype, rows):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(rows, 100, generator=g).to(dtype)  # 100: a tail after the 16-wide chunks
    w = torch.randn(70, 100, generator=g).to(dtype)  # 70: a tail after the 4-column groups
    ref = x.float() @ w.float().T
    out = cpu_ops.linear_small(x, w)
    assert out.dtype == dtype and out.shape == (rows, 70)
    # fp32 accumulation: only the final rounding to the output dtype differs.
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_agrees_with_f_linear_on_every_route(dtype):
    """Small inputs take the GEMV, larger ones the packed fp32 GEMM (whose stand-in "original
    weight" is zeros: if MKL ever fell back to it, the result would be zeros, not this)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 160, generator=g).to(dtype)
    for rows in (0, 1, SMALL_ROWS, SMALL_ROWS + 1, 64, 300):
        x = torch.randn(rows, 160, generator=g).to(dtype)
        ref = x.float() @ w.float().T
        out = linear(x, w)
        assert out.dtype == dtype and out.shape == (rows, 96)
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        scale = ref.abs().max().item() if rows else 1.0
        torch.testing.assert_close(out.float(), ref, atol=tol * scale, rtol=tol)


@pytest.mark.model
def test_model_logits_same_with_and_without_fused_ops(default_runner):
    prompts = [list(range(1000, 1037)), list(range(3000, 3005))]
    (fused_tokens, fused_logits), (plain_tokens, plain_logits) = _both(
        lambda: greedy_generate(default_runner, prompts, 4, per_seq=4))
    torch.testing.assert_close(fused_logits, plain_logits, atol=1e-3, rtol=1e-4)
    assert fused_tokens == plain_tokens
