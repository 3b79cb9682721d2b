"""The sparse MoE block (layers/moe.py) against transformers' own Mixtral and Qwen3-MoE blocks
on the same weights, dense and held as GGUF blocks, with and without the CPU kernels; and the
proof that only the chosen experts are read: the unchosen experts' weights poisoned with NaN
leave the output bit for bit unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from everystop.executor.layers.cpu_kernels import CpuKernels, load_cpu_kernels
from everystop.executor.layers.moe import SparseMoeBlock, route
from everystop.executor.layers.quant import FORMATS, format_code, quantize

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

HIDDEN, EXPERT_FFN = 64, 96


def _hf_block(family: str, num_experts: int, top_k: int, norm_topk_prob: bool = True):
    """A transformers MoE block with random weights (large enough that routing is decisive)."""
    if family == "mixtral":
        config = transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=EXPERT_FFN,
                                            num_local_experts=num_experts,
                                            num_experts_per_tok=top_k)
        block = MixtralSparseMoeBlock(config)
    else:
        config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN,
                                             moe_intermediate_size=EXPERT_FFN,
                                             num_experts=num_experts, num_experts_per_tok=top_k,
                                             norm_topk_prob=norm_topk_prob)
        block = Qwen3MoeSparseMoeBlock(config)
    g = torch.Generator().manual_seed(num_experts * 10 + top_k)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return block.eval()


CASES = [("mixtral", 8, 2, True), ("qwen3_moe", 16, 4, True), ("qwen3_moe", 16, 4, False)]


def _ours(hf, family: str, top_k: int, renormalize: bool, kernels: CpuKernels | None,
          fmt: str = "fp32") -> SparseMoeBlock:
    """Our block holding hf's weights as `fmt` ("fp32", "f16", "q8_0", "q4_0"); hf's expert
    weights are set to the values ours holds, so both compute with the same numbers."""
    experts = hf.experts
    num_experts = experts.gate_up_proj.shape[0]
    ours = SparseMoeBlock(HIDDEN, EXPERT_FFN, num_experts, top_k, renormalize, kernels=kernels)
    ours.gate.weight.data = hf.gate.weight.detach().clone()
    for mine, theirs in ((ours.experts.gate_up_proj, experts.gate_up_proj),
                         (ours.experts.down_proj, experts.down_proj)):
        w = theirs.detach().reshape(-1, theirs.shape[-1])  # expert-major, as ours stacks them
        if fmt in ("q8_0", "q4_0"):
            held = quantize(w, fmt)
            mine.hold(held)
            exact = held.dequantize()
        else:
            held = w.half() if fmt == "f16" else w.clone()
            mine.hold(held)
            exact = held.float()
        with torch.no_grad():
            theirs.copy_(exact.view(theirs.shape))
    return ours


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    loaded = load_cpu_kernels("auto")
    if loaded is None:
        pytest.skip("no CPU kernel build on this machine")
    return loaded


@pytest.mark.parametrize("family,num_experts,top_k,norm", CASES)
def test_routing_equals_transformers_router(family, num_experts, top_k, norm):
    hf = _hf_block(family, num_experts, top_k, norm)
    x = torch.randn(50, HIDDEN, generator=torch.Generator().manual_seed(3))
    logits, their_weights, their_ids = hf.gate(x)
    weights, ids = route(logits, top_k, renormalize=norm)
    assert torch.equal(ids, their_ids)
    torch.testing.assert_close(weights, their_weights.float(), rtol=0, atol=0)
    assert torch.allclose(weights.sum(-1), torch.ones(50)) == norm


@pytest.mark.parametrize("family,num_experts,top_k,norm", CASES)
@pytest.mark.parametrize("fmt", ["fp32", "f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("use_kernels", [False, True])
def test_block_equals_transformers_block(family, num_experts, top_k, norm, fmt, use_kernels,
                                         request):
    ks = request.getfixturevalue("kernels") if use_kernels else None
    hf = _hf_block(family, num_experts, top_k, norm)
    ours = _ours(hf, family, top_k, norm, ks, fmt)
    g = torch.Generator().manual_seed(7)
    for rows in (1, 3, 40):  # decode-sized (GEMV) and prefill-sized (GEMM) expert batches
        x = torch.randn(rows, HIDDEN, generator=g)
        with torch.no_grad():
            expected = hf(x.unsqueeze(0))[0]
            got = ours(x)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def poison_unchosen(ours: SparseMoeBlock, chosen: set[int]) -> int:
    """Fill every unchosen expert's rows with NaN (dense) or 0xFF bytes (blocks: NaN scales).
    Returns how many experts were poisoned."""
    poisoned = 0
    experts = ours.experts
    for e in range(experts.num_experts):
        if e in chosen:
            continue
        poisoned += 1
        for module, rows in ((experts.gate_up_proj, experts.local_gate_up),
                             (experts.down_proj, experts.hidden_size)):
            w = module.weight.data[e * rows:(e + 1) * rows]
            w.fill_(255 if w.dtype == torch.uint8 else float("nan"))
    return poisoned


@pytest.mark.parametrize("fmt", ["fp32", "q8_0"])
@pytest.mark.parametrize("use_kernels,int8", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("rows", [1, 4, 12])
def test_unchosen_experts_are_never_read(fmt, use_kernels, int8, rows, request):
    ks = request.getfixturevalue("kernels") if use_kernels else None
    if ks is not None:
        ks = dataclasses.replace(ks, int8_decode_dot=int8)
    hf = _hf_block("qwen3_moe", 32, 2, True)
    ours = _ours(hf, "qwen3_moe", 2, True, ks, fmt)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        clean = ours(x)
        _, ids = route(ours.gate(x), 2, True)
        assert poison_unchosen(ours, set(ids.flatten().tolist())) > 0
        poisoned = ours(x)
    assert not clean.isnan().any()
    assert torch.equal(poisoned, clean)


def test_poison_is_seen_when_a_chosen_expert_is_poisoned():
    """The poison test's own check: poisoning an expert a row chose does reach the output."""
    hf = _hf_block("mixtral", 8, 2)
    ours = _ours(hf, "mixtral", 2, True, None)
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, ids = route(ours.gate(x), 2, True)
        poison_unchosen(ours, set(range(8)) - {int(ids[0, 0])})
        out = ours(x)
    assert out[0].isnan().all()


def test_top_k_is_checked():
    with pytest.raises(ValueError, match="experts per token"):
        SparseMoeBlock(HIDDEN, EXPERT_FFN, 4, 5, True)


def _int_dot_path(kernels: CpuKernels) -> int:
    paths = [int(p) for p in kernels.ops.int_dot_paths()]
    if paths[-1] == 0:
        pytest.skip("no integer dot path in this build")
    return paths[-1]


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_int8_block_rows_equal_single_row_integer_gemvs(kernels, fmt):
    """With int8 activations the block's kernel (csrc/moe_experts.cpp) gives every row, however
    many rows share its experts, exactly what that row's experts give it through single-row
    integer GEMVs: a token's output does not depend on the batch around it."""
    ks = dataclasses.replace(kernels, int8_decode_dot=True)
    path = _int_dot_path(ks)
    num_experts, top_k, hidden, inter = 8, 3, 96, 64
    g = torch.Generator().manual_seed(11)
    router = torch.randn(num_experts, hidden, generator=g) * 0.3
    gate_up = quantize(torch.randn(num_experts * 2 * inter, hidden, generator=g) * 0.2, fmt)
    down = quantize(torch.randn(num_experts * hidden, inter, generator=g) * 0.2, fmt)
    code = FORMATS[fmt][0]
    for rows in (1, 2, 5, 9, 20):  # up to more than one 8-row pass per expert
        x = torch.randn(rows, hidden, generator=g)
        got, chosen = ks.moe_block(x, router, gate_up.data, code, down.data, code, top_k, True)
        weights, ids = route(torch.nn.functional.linear(x, router), top_k, True)
        expected = torch.zeros(rows, hidden)
        for t in range(rows):
            for e in sorted(ids[t].tolist()):
                gu = gate_up.data[e * 2 * inter:(e + 1) * 2 * inter]
                h = ks.ops.linear_q_small_path(x[t:t + 1], gu, code, hidden, path)
                dn = down.data[e * hidden:(e + 1) * hidden]
                y = ks.ops.linear_q_small_path(ks.silu_mul(h), dn, code, inter, path)
                w = weights[t, (ids[t] == e).nonzero()[0, 0]]
                expected[t] = expected[t] + y[0] * w
        assert chosen == len(set(ids.flatten().tolist()))
        assert torch.equal(got, expected), f"{rows} rows"


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("int8", [False, True])
def test_prefill_pass_kernel_equals_module_path(kernels, fmt, int8):
    """A prefill-sized pass runs the block's kernel, and each expert there takes what the
    module path's linear() takes for its rows (the GEMV up to gemv_rows, fp32 tiles past it):
    bit for bit the per-expert module path, for passes where some experts have more rows than
    the GEMV takes and others fewer."""
    ks = dataclasses.replace(kernels, int8_decode_dot=int8)
    hf = _hf_block("qwen3_moe", 16, 4)
    ours = _ours(hf, "qwen3_moe", 4, True, ks, fmt)
    g = torch.Generator().manual_seed(5)
    sizes = []
    for rows in (33, 150, 300):
        x = torch.randn(rows, HIDDEN, generator=g)
        weights, ids = route(ours.gate(x), 4, True)
        counts = torch.bincount(ids.flatten(), minlength=16)
        with torch.no_grad():
            got = ours(x)
            expected = ours.experts(x, weights, ids)
        assert torch.equal(got, expected), f"{rows} rows, expert rows {counts.tolist()}"
        sizes += counts[counts > 0].tolist()
    assert max(sizes) > 32 and min(sizes) <= 32  # both paths ran


def test_prefill_pass_kernel_honours_gemv_rows(kernels):
    """Past `gemv_rows` an expert takes fp32 tiles, up to it the GEMV: with the bound at every
    row count the pass equals the all-GEMV pass (the decoder stack's), with it at 1 the
    module path with every expert in tiles, and the two differ only by the sums' order."""
    fmt = "q4_0"
    hf = _hf_block("mixtral", 8, 2)
    ours = _ours(hf, "mixtral", 2, True, kernels, fmt)
    experts = ours.experts
    x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(9))
    # The held format (interleaved where the rows are whole groups), as the kernels read it.
    gu_code = format_code(experts.gate_up_proj.weight_format)
    dn_code = format_code(experts.down_proj.weight_format)
    args = (x, ours.gate.weight, experts.gate_up_proj.weight, gu_code,
            experts.down_proj.weight, dn_code, 2, True)
    gemv, _ = kernels.moe_block(*args)
    tiles, _ = kernels.moe_block(*args, gemv_rows=1)
    weights, ids = route(ours.gate(x), 2, True)
    expected = torch.zeros_like(x)
    for e in sorted(set(ids.flatten().tolist())):
        rows = (ids == e).any(-1).nonzero()[:, 0]
        span = experts.local_gate_up
        gu = experts.gate_up_proj.weight[e * span:(e + 1) * span]
        h = kernels.ops.linear_q_tiled(x[rows], gu, gu_code, HIDDEN)
        dn = experts.down_proj.weight[e * HIDDEN:(e + 1) * HIDDEN]
        y = kernels.ops.linear_q_tiled(kernels.silu_mul(h), dn, dn_code, EXPERT_FFN)
        w = (weights * (ids == e)).sum(-1)[rows].unsqueeze(1)
        expected.index_add_(0, rows, y * w)
    assert torch.equal(tiles, expected)
    assert not torch.equal(tiles, gemv)
    torch.testing.assert_close(tiles, gemv, rtol=1e-5, atol=1e-5)
