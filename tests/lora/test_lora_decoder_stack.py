"""Decode passes with adapter rows run in the C++ decoder stack (its LoRA parameters) and give
peft's logits; the grouped LoRA kernel against plain torch."""

from __future__ import annotations

import pytest
import torch

from everystop.core.outputs import ScheduledSequence
from everystop.executor.layers.cpu_kernels import load_cpu_kernels, runnable_isas
from everystop.executor.layers.lora import LoraPair, adapter_dtype, split_parts
from everystop.executor.models.decoder import DecoderForCausalLM

from .conftest import ADAPTERS, GREEDY, VOCAB, make_runner, transformers

peft = pytest.importorskip("peft")
KERNELS = load_cpu_kernels("auto")
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no CPU kernels built here")
LOGIT_TOL = 1e-4


def _peft_last_logits(base: str, adapter: str | None, tokens: list[int]) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1]


def spy_on_the_stack(monkeypatch) -> list[bool]:
    """Each decoder-stack call from now on appends whether the pass had adapters active."""
    stack_calls: list[bool] = []
    original = DecoderForCausalLM._decoder_stack

    def spy(self, *args, **kwargs):
        stack_calls.append(self.lora_bank.current is not None)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DecoderForCausalLM, "_decoder_stack", spy)
    return stack_calls


def test_a_decode_pass_mixing_adapters_and_base_runs_the_stack_and_matches_peft(
        lora_dirs, monkeypatch):
    base, adapters = lora_dirs
    runner = make_runner(base, adapters)
    stack_calls = spy_on_the_stack(monkeypatch)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 6, 4, 5, 2)]
    ids = [0, 1, 2, 3, -1]
    tokens = [list(p) for p in prompts]
    for step in range(2):  # the prompts' pass, then one decode pass of five rows
        seqs = [ScheduledSequence(str(i), tokens[i][len(prompts[i]) if step else 0:],
                                  len(prompts[i]) if step else 0,
                                  list(range(i * 4, (i + 1) * 4)), True, GREEDY,
                                  output_index=step, lora_id=ids[i])
                for i in range(len(prompts))]
        stack_calls.clear()
        _, logits = runner.forward_logits(seqs)
        assert logits is not None
        if step == 0:
            for i, tok in enumerate(logits.argmax(dim=-1).tolist()):
                tokens[i].append(tok)
    assert stack_calls == [True]  # the decode pass took the stack, with its LoRA pass
    names = list(ADAPTERS)
    for i, lora_id in enumerate(ids):
        ref = _peft_last_logits(base, adapters[names[lora_id]] if lora_id >= 0 else None,
                                tokens[i])
        assert (logits[i] - ref).abs().max().item() < LOGIT_TOL, f"row {i} (adapter {lora_id})"


# The best build this CPU runs, and the AVX2 one where that is another.
ISAS = [isa for isa in runnable_isas()[:1] + ["avx2"] if isa in runnable_isas()]


@pytest.mark.parametrize("isa", sorted(set(ISAS)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_kernel_adds_each_rows_own_adapter_delta(dtype, isa):
    kernels = load_cpu_kernels(isa)
    assert kernels is not None
    gen = torch.Generator().manual_seed(5)
    rows, n_in, n_out = 13, 100, 77  # not multiples of any vector width
    ranks = [16, 5, 0, 48]  # 0: this adapter leaves the linear alone
    x = torch.randn(rows, n_in, generator=gen).to(dtype)
    out = torch.randn(rows, n_out, generator=gen).to(dtype)
    weights: list[torch.Tensor] = []
    for r in ranks:
        weights += ([torch.randn(r, n_in, generator=gen).to(dtype),  # A
                     torch.randn(r, n_out, generator=gen).to(dtype)] if r  # B^T
                    else [torch.empty(0), torch.empty(0)])
    slots = torch.tensor([0, 1, 2, 3, -1, 0, 3, 3, 1, 2, -1, 0, 1])
    want = out.float().clone()
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0 and ranks[slot]:
            a, bt = weights[2 * slot].float(), weights[2 * slot + 1].float()
            want[row] += (x[row].float() @ a.T) @ bt
    got = kernels.lora_add_(out.clone(), x, slots, weights)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())
    untouched = (slots < 0) | (slots == 2)
    assert torch.equal(got[untouched], out[untouched])
    # One part of a fused projection: B^T a column span of a wider matrix (strided rows), the
    # delta landing in the part's own output columns only.
    offset, n = 20, 30
    parts: list[torch.Tensor] = []
    want = out.float().clone()
    for slot, r in enumerate(ranks):
        if not r:
            parts += [torch.empty(0), torch.empty(0)]
            continue
        bt = torch.randn(r, n + 3, generator=gen).to(dtype)[:, 2:2 + n]
        parts += [weights[2 * slot], bt]
        for row in (slots == slot).nonzero().flatten().tolist():
            want[row, offset:offset + n] += (x[row].float() @ weights[2 * slot].float().T
                                             ) @ bt.float()
    assert not parts[1].is_contiguous()
    got = kernels.lora_add_(out.clone(), x, slots, parts, col_offsets=[offset])
    assert torch.allclose(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())
    assert torch.equal(got[:, :offset], out[:, :offset])
    assert torch.equal(got[:, offset + n:], out[:, offset + n:])


def test_a_fused_pair_splits_into_its_targeted_parts():
    rank, n_in = 2, 5
    a = torch.randn(2 * rank, n_in)  # q and v targeted, k not: B's k rows are zero
    b = torch.zeros(8 + 4 + 4, 2 * rank)
    b[:8, :rank] = torch.randn(8, rank)
    b[12:, rank:] = torch.randn(4, rank)
    parts = split_parts(LoraPair(a, b), (8, 4, 4))
    assert torch.equal(parts[0], a[:rank]) and torch.equal(parts[1], b[:8, :rank].T)
    assert parts[2].numel() == 0 and parts[3].numel() == 0
    assert torch.equal(parts[4], a[rank:]) and torch.equal(parts[5], b[12:, rank:].T)


@pytest.mark.parametrize("isa", sorted(set(ISAS)))
def test_a_prefill_sized_call_over_several_parts_matches_torch_and_each_row_alone(isa):
    """Enough rows and work that the kernel splits one adapter's rows into several work items
    over the threads; every row still gets exactly what it gets in a call of its own."""
    kernels = load_cpu_kernels(isa)
    assert kernels is not None
    gen = torch.Generator().manual_seed(9)
    rows, n_in, part_rows, ranks = 80, 600, (300, 200), (48, 7)
    x = torch.randn(rows, n_in, generator=gen)
    out = torch.randn(rows, sum(part_rows), generator=gen)
    weights: list[torch.Tensor] = []
    for r in ranks:
        for n in part_rows:
            weights += [torch.randn(r, n_in, generator=gen) / 8, torch.randn(r, n, generator=gen)]
    slots = torch.tensor([0] * 70 + [1, -1] * 5)
    offsets = [0, part_rows[0]]
    got = kernels.lora_add_(out.clone(), x, slots, weights, offsets)
    want = out.clone()
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for p, (n, c) in enumerate(zip(part_rows, offsets, strict=True)):
            a, bt = weights[4 * slot + 2 * p], weights[4 * slot + 2 * p + 1]
            want[row, c:c + n] += (x[row] @ a.T) @ bt
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-3)
    for row in (0, 33, 69, 70, 71):
        alone = torch.full_like(slots, -1)
        alone[row] = slots[row]
        one = kernels.lora_add_(out.clone(), x, alone, weights, offsets)
        assert torch.equal(one[row], got[row]), f"row {row}"


@pytest.mark.parametrize("isa", sorted(set(ISAS)))
def test_bf16_adapter_weights_under_fp32_rows_give_the_fp32_sums_of_their_values(isa):
    """Adapters held bf16 next to fp32 activations (layers/lora.py's adapter_dtype): the kernel
    widens each weight and sums in fp32, so it gives the fp32 product of the rounded weights."""
    kernels = load_cpu_kernels(isa)
    assert kernels is not None
    gen = torch.Generator().manual_seed(3)
    rows, n_in, n_out, ranks = 11, 70, 45, (16, 3)
    x = torch.randn(rows, n_in, generator=gen)
    out = torch.randn(rows, n_out, generator=gen)
    weights = [torch.randn(*shape, generator=gen).to(torch.bfloat16)
               for r in ranks for shape in ((r, n_in), (r, n_out))]
    slots = torch.tensor([0, 1, -1, 1, 0, 0, 1, -1, 0, 1, 1])
    got = kernels.lora_add_(out.clone(), x, slots, weights)
    want = out.clone()
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            a, bt = weights[2 * slot].float(), weights[2 * slot + 1].float()
            want[row] += (x[row] @ a.T) @ bt
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert torch.equal(got[slots < 0], out[slots < 0])


def test_adapters_of_a_base_held_16_bit_are_bf16_and_decode_in_the_stack_as_layer_by_layer(
        lora_dirs, monkeypatch):
    base, adapters = lora_dirs
    runners = [make_runner(base, adapters, quantization="bf16", decoder_stack=stack)
               for stack in (True, False)]
    pairs = runners[0].lora.bank.pairs["0.qkv_proj"]
    assert {p.a.dtype for p in pairs.values()} == {torch.bfloat16}
    assert runners[0].dtype == torch.float32
    stack_calls = spy_on_the_stack(monkeypatch)
    ids = [0, 1, 2, 3, -1, 2]
    prompts = [[5 + i, 9, 4 + 2 * i] for i in range(len(ids))]
    decoded, decode_stack_calls = [], []
    for runner in runners:
        for step in range(2):  # the prompts' pass, then a decode pass
            stack_calls.clear()
            seqs = [ScheduledSequence(str(i), prompts[i] if step == 0 else [7 + i],
                                      len(prompts[i]) if step else 0,
                                      list(range(i * 4, (i + 1) * 4)), True, GREEDY,
                                      output_index=step, lora_id=ids[i])
                    for i in range(len(ids))]
            _, logits = runner.forward_logits(seqs)
        assert logits is not None
        decoded.append(logits)
        decode_stack_calls.append(list(stack_calls))
    assert decode_stack_calls == [[True], []]  # the decode pass: in the stack, then layer by layer
    assert torch.allclose(decoded[0], decoded[1], rtol=1e-5, atol=1e-5)


def test_adapters_are_held_bf16_only_under_fp32_rows_of_a_base_held_below_fp32():
    kernels = KERNELS
    assert adapter_dtype(torch.float32, torch.uint8, kernels) == torch.bfloat16  # blocks
    assert adapter_dtype(torch.float32, torch.bfloat16, kernels) == torch.bfloat16
    assert adapter_dtype(torch.float32, torch.float32, kernels) == torch.float32
    assert adapter_dtype(torch.bfloat16, torch.uint8, kernels) == torch.bfloat16
    assert adapter_dtype(torch.float16, torch.float16, kernels) == torch.float16
    assert adapter_dtype(torch.float32, torch.uint8, None) == torch.float32  # plain torch
