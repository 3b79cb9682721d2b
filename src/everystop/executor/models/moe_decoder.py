"""The shared decoder with sparse mixture-of-experts feed-forward blocks (Mixtral, Qwen3-MoE):
every MoE layer's `mlp` is a layers/moe.SparseMoeBlock in place of the SwiGLU; layers listed
in `dense_layers` keep theirs. Parameters of an MoE layer::

    mlp.gate.weight                  [E, H]       the router
    mlp.experts.gate_up_proj.weight  [E * 2I, H]  per expert [gate; up], expert-major
    mlp.experts.down_proj.weight     [E * H, I]   per expert down

Decode-sized passes run the MoE layers inside the C++ decoder stack: the router and each
layer's stacked experts are parameters of the stack's layer (csrc/moe_experts.cpp), which
computes what SparseMoeBlock does, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from everystop.executor.layers.cpu_kernels import StackMoe
from everystop.executor.layers.linear import HeldWeight
from everystop.executor.layers.moe import SparseMoeBlock
from everystop.executor.layers.parallel import SINGLE, ParallelContext
from everystop.executor.models.decoder import (
    TORCH_ONLY,
    Backends,
    DecoderArgs,
    DecoderForCausalLM,
    hf_sources,
)


@dataclass(frozen=True)
class MoeArgs(DecoderArgs):
    """DecoderArgs plus the experts: E experts of intermediate size I, k chosen per token
    (weights renormalized over the k when `norm_topk_prob`); `intermediate_size` is then the
    size of the dense layers' SwiGLU, if any."""

    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts per token ({self.experts_per_token}) must be in "
                             f"1..{self.num_experts} (the number of experts)")
        if self.expert_intermediate_size <= 0:
            raise ValueError("the experts' intermediate size must be positive")

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers


class MoeForCausalLM(DecoderForCausalLM):
    """DecoderForCausalLM whose MoE layers route each token to its top-k experts."""

    def __init__(self, args: DecoderArgs, ctx: ParallelContext = SINGLE,
                 backends: Backends = TORCH_ONLY) -> None:
        assert isinstance(args, MoeArgs)
        super().__init__(args, ctx, backends)
        for i, layer in enumerate(self.model.layers):
            if args.is_moe_layer(i):
                layer.mlp = SparseMoeBlock(args.hidden_size, args.expert_intermediate_size,
                                           args.num_experts, args.experts_per_token,
                                           args.norm_topk_prob, ctx, backends.kernels,
                                           self.weight_reads)

    def _stack_mlp(self, layer: nn.Module) -> tuple[HeldWeight, HeldWeight]:
        mlp = layer.mlp
        if isinstance(mlp, SparseMoeBlock):
            return mlp.experts.gate_up_proj, mlp.experts.down_proj
        return super()._stack_mlp(layer)

    def _stack_moe(self) -> StackMoe:
        """Each MoE layer's router (an empty tensor for a dense layer), for the stack."""
        no_router = torch.empty(0)
        routers = [layer.mlp.gate.weight if isinstance(layer.mlp, SparseMoeBlock) else no_router
                   for layer in self.model.layers]
        args = self.args
        assert isinstance(args, MoeArgs)
        return StackMoe(routers, args.experts_per_token, args.norm_topk_prob,
                        torch.zeros(len(routers), dtype=torch.long))

    def _stack_moe_ran(self, moe: StackMoe) -> None:
        for layer, chosen in zip(self.model.layers, moe.chosen.tolist(), strict=True):
            if chosen:
                self.weight_reads.add_partial(chosen * layer.mlp.experts.expert_bytes())

    def partly_read_weights(self) -> list[torch.Tensor]:
        return [w for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)
                for w in layer.mlp.experts.stacked_weights()]


def moe_hf_sources(block: str, gate: str, up: str, down: str
                   ) -> Callable[[DecoderArgs], dict[str, list[str]]]:
    """hf_sources for a checkpoint whose MoE layer `i` is the module
    `model.layers.{i}.{block}` with `gate` (the router) and `experts.{e}.{gate|up|down}`."""

    def sources(args: DecoderArgs) -> dict[str, list[str]]:
        assert isinstance(args, MoeArgs)
        out = hf_sources(args)
        for i in range(args.num_layers):
            if not args.is_moe_layer(i):
                continue
            ours, theirs = f"model.layers.{i}.mlp.", f"model.layers.{i}.{block}."
            del out[ours + "gate_up_proj.weight"], out[ours + "down_proj.weight"]
            experts = range(args.num_experts)
            out[ours + "gate.weight"] = [theirs + "gate.weight"]
            out[ours + "experts.gate_up_proj.weight"] = [
                f"{theirs}experts.{e}.{name}.weight" for e in experts for name in (gate, up)]
            out[ours + "experts.down_proj.weight"] = [
                f"{theirs}experts.{e}.{down}.weight" for e in experts]
        return out

    return sources


def gguf_expert_names(block: str, gate: str, up: str, down: str) -> dict[str, str]:
    """GGUF per-layer tensor kinds of the MoE block -> its Hugging Face module names; the
    stacked experts map to `{block}.experts.{proj}` (served per expert by ExpertSlices)."""
    return {"ffn_gate_inp": f"{block}.gate", "ffn_gate_exps": f"{block}.experts.{gate}",
            "ffn_up_exps": f"{block}.experts.{up}", "ffn_down_exps": f"{block}.experts.{down}"}


def gguf_dense_layers(tensors: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The layers of a GGUF file without a router (a dense SwiGLU instead of experts)."""
    return tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors)
