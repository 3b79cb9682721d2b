"""The decoder every registered family (models/registry.py) is built from, over a flat packed
batch with a paged KV cache. A family's differences are fields of `DecoderArgs`; a family file
(models/llama.py, ...) only reads them from a checkpoint.

Parameter names follow Hugging Face's except two fused projections (see `hf_sources`):
`self_attn.qkv_proj` = [q; k; v] and `mlp.gate_up_proj` = [gate; up].
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from everystop.executor.layers.attention import (
    AttentionMetadata,
    paged_attention,
    select_backend,
    write_kv,
)
from everystop.executor.layers.cpu_kernels import CpuKernels, StackMoe
from everystop.executor.layers.linear import (
    CHUNKED_GEMV_ROWS,
    HeldWeight,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gemv_rows,
)
from everystop.executor.layers.lora import LoraBank, LoraHook, kernel_takes
from everystop.executor.layers.mlp import ACTIVATIONS, SwiGLU
from everystop.executor.layers.norm import RMSNorm
from everystop.executor.layers.parallel import SINGLE, ParallelContext
from everystop.executor.layers.quant import format_code
from everystop.executor.layers.rotary import (
    LONGROPE,
    LongRope,
    apply_rope,
    rope_cos_sin,
    rope_inv_freq,
)
from everystop.executor.layers.weight_reads import WeightReads, pass_bytes

KVCache = tuple[torch.Tensor, torch.Tensor]  # (key_cache, value_cache) of one layer
# The decoder stack's linears of a layer, in its order (csrc/decoder_stack.cpp): the LoRA
# weights it takes follow it, part by part (q, k, v, o, gate, up, down).
STACK_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecoderArgs:
    """Architecture hyper-parameters, read from a GGUF header or a config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # What the families change (the defaults are Llama's):
    attention_bias: bool = False  # q, k and v projections carry biases (Qwen2)
    qk_norm: bool = False  # RMSNorm over each q and k head before rope (Qwen3, Gemma 3)
    # Per layer, the sliding window W (a query at p attends keys p-W+1..p); 0 = every key.
    # Empty: no layer has a window.
    layer_windows: tuple[int, ...] = ()
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0  # embeddings are multiplied by it (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # scores' scale; None: head_dim ** -0.5
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) when > 0 (Gemma 2)
    final_softcap: float = 0.0  # logits likewise (Gemma 2)
    sandwich_norms: bool = False  # an RMSNorm on the attention's and the MLP's outputs too
    local_rope_theta: float | None = None  # windowed layers' own rope base, unscaled (Gemma 3)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.hidden_act!r} (supported: "
                             f"{', '.join(ACTIVATIONS)})")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for "
                             f"{self.num_layers} layers")
        if any(w < 0 for w in self.layer_windows):
            raise ValueError(f"negative sliding window in {self.layer_windows}")

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: none)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def sliding_window(self) -> int | None:
        """The window every layer attends within, or None where any layer attends to the
        whole context: the KV cache releases blocks behind it (core/sliding_window.py)."""
        if not self.layer_windows or 0 in self.layer_windows:
            return None
        return max(self.layer_windows)

    def stack_blockers(self) -> list[str]:
        """What keeps decode passes off the one-call decoder stack (empty: nothing; every
        difference of the dense families is one of its parameters)."""
        return []


@dataclass(frozen=True)
class Backends:
    """How the layers compute, fixed when the model is built: the CPU kernel library (None =
    plain torch), the attention implementation (see layers/attention.select_backend) and
    whether decode-sized batches run the whole decoder stack in one kernel call."""

    kernels: CpuKernels | None = None
    attention: str = "auto"
    decoder_stack: bool = True


TORCH_ONLY = Backends()


class OutputRows(NamedTuple):
    """The rows of a batch whose final hidden states are used, and the attention metadata
    that queries only them (AttentionMetadata.for_rows)."""

    rows: torch.Tensor
    meta: AttentionMetadata


class DecoderAttention(nn.Module):
    """Under tensor parallelism this rank's heads only (see `shard_heads`): the head counts and
    sizes below are local; o_proj sums the ranks' partial outputs.

    Optional, as `args` says: `qkv_bias` ([q; k; v] biases, sharded like qkv_proj's rows),
    `q_norm`/`k_norm` (one RMSNorm weight [head_dim] shared by every head)."""

    def __init__(self, args: DecoderArgs, ctx: ParallelContext = SINGLE,
                 backends: Backends = TORCH_ONLY, window: int = 0) -> None:
        super().__init__()
        self.backends = backends
        kernels = backends.kernels
        self.qkv_proj = QKVParallelLinear(args.hidden_size, args.num_heads, args.num_kv_heads,
                                          args.head_dim, ctx, kernels)
        heads = self.qkv_proj.heads
        self.num_heads, self.num_kv_heads, self.head_dim = (heads.num_q, heads.num_kv,
                                                            args.head_dim)
        self.q_size = heads.num_q * args.head_dim
        self.kv_size = heads.num_kv * args.head_dim
        self.scale = args.attn_scale if args.attn_scale is not None else args.head_dim ** -0.5
        self.window, self.softcap = window, args.attn_softcap
        self.qkv_bias = (nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size))
                         if args.attention_bias else None)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, kernels) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, kernels) if args.qk_norm else None
        self.o_proj = RowParallelLinear(args.num_heads * args.head_dim, args.hidden_size, ctx,
                                        (heads.q_start * args.head_dim, self.q_size), kernels)

    def shard_weight(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the full q/k/v bias (the module's one direct parameter)."""
        return self.qkv_proj.shard_weight(full)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, only: OutputRows | None = None) -> torch.Tensor:
        """Every row's K/V is written; the output is every row's, or only `only`'s rows'."""
        qkv = self.qkv_proj(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias.to(qkv.dtype)
        if self.q_norm is not None and self.k_norm is not None:
            # Normed heads back into one [q; k; v] row per token, for the fused rope + write.
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(-1, self.q_size)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(-1, self.kv_size)
            qkv = torch.cat([q, k, v], dim=-1)
        kernels = self.backends.kernels
        key_cache, value_cache = kv_cache
        # NOTE: K/V are written before attention so each token sees itself and the earlier
        # tokens of this same step through the block table.
        if (kernels is not None and kernels.handles(qkv) and kernels.handles(key_cache)
                and meta.write_rows is None and qkv.is_contiguous()):
            kernels.rope_write_kv_(qkv, cos, sin, key_cache, value_cache, meta.slot_mapping,
                                   self.num_heads, self.num_kv_heads)
            q = qkv[:, :self.q_size].view(-1, self.num_heads, self.head_dim)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rope(q.view(-1, self.num_heads, self.head_dim), cos, sin, kernels)
            k = apply_rope(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin, kernels)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            write_kv(key_cache, value_cache, k, v, meta.slot_mapping, meta.write_rows)
        if only is not None:
            if only.rows.numel() == 0:
                return x.new_empty((0, x.shape[1]))
            q, meta = q[only.rows], only.meta
        out = paged_attention(q, key_cache, value_cache, meta, self.scale, kernels,
                              self.backends.attention, self.window, self.softcap)
        return self.o_proj(out.reshape(-1, self.q_size))


class DecoderLayer(nn.Module):
    """input norm -> attention [-> attn_out_norm] -> + residual -> post-attention norm -> MLP
    [-> mlp_out_norm] (the bracketed norms with `sandwich_norms`, Gemma 2/3)."""

    def __init__(self, args: DecoderArgs, ctx: ParallelContext = SINGLE,
                 backends: Backends = TORCH_ONLY, layer: int = 0) -> None:
        super().__init__()
        kernels = backends.kernels
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels)
        self.self_attn = DecoderAttention(args, ctx, backends, args.window(layer))
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels)
        self.mlp = SwiGLU(args.hidden_size, args.intermediate_size, ctx, kernels,
                          args.hidden_act)
        sandwich = args.sandwich_norms
        self.attn_out_norm = (RMSNorm(args.hidden_size, args.rms_norm_eps, kernels)
                              if sandwich else None)
        self.mlp_out_norm = (RMSNorm(args.hidden_size, args.rms_norm_eps, kernels)
                             if sandwich else None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                only: OutputRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings at layer 0, residual None).
        Returns this layer's MLP output and the residual stream it is to be added to: each add
        is fused into the norm that follows it (the stream is updated in place). With `only`,
        K/V are still written for every row but the outputs are `only`'s rows alone."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta, only)
        if only is not None:
            residual = residual[only.rows]
            if h.shape[0] == 0:
                return h, residual
        if self.attn_out_norm is not None:
            h = self.attn_out_norm(h)
        h, residual = self.post_attention_layernorm(h, residual)
        h = self.mlp(h)
        return (h if self.mlp_out_norm is None else self.mlp_out_norm(h)), residual


class DecoderModel(nn.Module):
    def __init__(self, args: DecoderArgs, ctx: ParallelContext = SINGLE,
                 backends: Backends = TORCH_ONLY) -> None:
        super().__init__()
        kernels = backends.kernels
        # Vocab-sharded rather than replicated: a tied LM head then reuses this slice, and the
        # rank saves (1 - 1/world) of vocab x hidden (1.6 GiB/GPU for Llama-3-70B in bf16 at
        # TP=4) for one extra all-reduce of [tokens, hidden] per step (vs 2 per layer).
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, ctx,
                                                   kernels)
        self.layers = nn.ModuleList(DecoderLayer(args, ctx, backends, i)
                                    for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels)


class DecoderForCausalLM(nn.Module):
    """The whole model. Build it under `torch.device("meta")` and load weights with
    `load_state_dict(..., assign=True)`; then call `set_rope(...)` on the target device.

    With a tensor-parallel `ctx` the module holds rank `ctx.rank`'s shard of every weight; the
    loader cuts shards with each sharded layer's `shard_weight`."""

    def __init__(self, args: DecoderArgs, ctx: ParallelContext = SINGLE,
                 backends: Backends = TORCH_ONLY) -> None:
        super().__init__()
        self.args = args
        self.ctx = ctx
        self.backends = backends
        self.model = DecoderModel(args, ctx, backends)
        self.weight_reads = WeightReads()
        self.lm_head = (None if args.tie_word_embeddings else
                        ParallelLMHead(args.vocab_size, args.hidden_size, ctx, backends.kernels))
        self.inv_freq: torch.Tensor = rope_inv_freq(args.head_dim, args.rope_theta,
                                                    args.rope_scaling)
        self.local_inv_freq: torch.Tensor | None = None
        if args.local_rope_theta is not None:
            self.local_inv_freq = rope_inv_freq(args.head_dim, args.local_rope_theta, None)
        scaling = args.rope_scaling or {}
        self.longrope = (LongRope.from_scaling(args.head_dim, args.rope_theta, scaling,
                                               args.max_position_embeddings)
                         if scaling.get("rope_type", scaling.get("type")) in LONGROPE else None)
        self.lora_bank: LoraBank | None = None
        self._lora_stack_logged = False

    def attach_lora_bank(self) -> LoraBank:
        """Hook LoRA deltas onto every projection an adapter may target (q/k/v, o, gate/up,
        down): the bank's names are `{layer}.qkv_proj`, `{layer}.o_proj`,
        `{layer}.gate_up_proj`, `{layer}.down_proj`. Idempotent."""
        if self.lora_bank is None:
            bank = LoraBank(kernels=self.backends.kernels)
            rows = self._lora_part_rows()
            for i, layer in enumerate(self.model.layers):
                for name, module in lora_targets(layer).items():
                    module.lora = LoraHook(bank, f"{i}.{name}")
                    bank.names.add(f"{i}.{name}")
                    bank.part_rows[f"{i}.{name}"] = rows[name]
            self.lora_bank = bank
        return self.lora_bank

    def _lora_part_rows(self) -> dict[str, tuple[int, ...]]:
        """The output rows of each part of a layer's LoRA-targeted projections."""
        attn = self.model.layers[0].self_attn
        q, kv = attn.q_size, attn.kv_size
        inter = self.args.intermediate_size  # LoRA serves no tensor parallelism
        hidden = self.args.hidden_size
        return {"qkv_proj": (q, kv, kv), "o_proj": (hidden,), "gate_up_proj": (inter, inter),
                "down_proj": (hidden,)}

    def set_rope(self, device: torch.device | str,
                 freq_factors: torch.Tensor | None = None) -> None:
        """(Re)compute the rope frequencies on `device` (not a parameter: never loaded)."""
        self.inv_freq = rope_inv_freq(self.args.head_dim, self.args.rope_theta,
                                      self.args.rope_scaling, freq_factors).to(device)
        if self.args.local_rope_theta is not None:
            self.local_inv_freq = rope_inv_freq(self.args.head_dim, self.args.local_rope_theta,
                                                None).to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states for a packed batch of T tokens: [T, hidden], or only the rows
        `output_rows` (sorted token indices), the ones whose logits are wanted.

        Given output rows, the last layer runs its attention, MLP and norms on those rows alone:
        the other rows only need their K/V written there (as llama.cpp does; a 280-token
        prompt's prefill saves ~94% of one layer's work)."""
        self.weight_reads.begin(input_ids.shape[0])
        x = self.model.embed_tokens(input_ids)
        if self.args.embed_scale != 1.0:
            # As the reference: the scale rounded to the activation dtype first.
            x = x * torch.tensor(self.args.embed_scale, dtype=x.dtype)
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        if self.longrope is not None:
            cos, sin = self.longrope.tables(positions, _token_seq_lens(meta, len(positions)),
                                            cos, sin)
        local = (None if self.local_inv_freq is None else
                 rope_cos_sin(positions, self.local_inv_freq))
        if (self._runs_decoder_stack(x, kv_caches, meta)
                and (lora := self._stack_lora(x.dtype)) is not None):
            out = self._decoder_stack(x, cos, sin, local, kv_caches, meta, *lora)
            return out if output_rows is None else out[output_rows]
        only = None
        if output_rows is not None and output_rows.numel() < x.shape[0]:
            only = OutputRows(output_rows, meta.for_rows(output_rows, positions))
        residual = None
        last = len(self.model.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            c, s = local if local is not None and self.args.window(i) else (cos, sin)
            x, residual = layer(x, residual, c, s, kv_cache, meta, only if i == last else None)
        if residual is None:  # no layers
            x = self.model.norm(x)
            return x if output_rows is None else x[output_rows]
        return self.model.norm(x, residual)[0]

    def _runs_decoder_stack(self, x: torch.Tensor, kv_caches: list[KVCache],
                            meta: AttentionMetadata) -> bool:
        """Whether this batch may take the one-call decoder stack: it runs exactly the kernels
        the layers would pick (the GEMV at up to gemv_rows() rows, the attention kernel, fused
        norms), so only where every layer would pick them; a tensor-parallel rank needs its
        all-reduces between the kernels."""
        kernels = self.backends.kernels
        return (self.backends.decoder_stack and kernels is not None and self.ctx.world_size == 1
                and self.stack_ready
                and 0 < x.shape[0] <= CHUNKED_GEMV_ROWS and kernels.handles(x)
                and meta.write_rows is None and bool(kv_caches)
                and select_backend(x, kv_caches[0][0], kernels, self.backends.attention)
                == "kernel"
                and x.dtype == self.model.norm.weight.dtype
                and self._stack_weights() is not None
                and x.shape[0] <= self._stack_rows(x.dtype))

    def _stack_lora(self, dtype: torch.dtype
                    ) -> tuple[torch.Tensor | None, list[torch.Tensor]] | None:
        """The current pass's adapters as the decoder stack takes them: each row's index into
        the pass's adapters and their weights (per adapter, layer, linear: A, B); (None, [])
        when no row has an adapter. None: the stack cannot add these deltas (adapter weights
        in a dtype its kernel does not take under these activations), so the pass runs layer
        by layer (logged once)."""
        bank = self.lora_bank
        if bank is None or bank.current is None:
            return None, []
        if "_stack_lora_linears" not in self.__dict__:
            parts = self._lora_part_rows()
            self.__dict__["_stack_lora_linears"] = [
                (f"{i}.{name}", parts[name]) for i in range(len(self.model.layers))
                for name in STACK_LINEARS]
        weights = bank.pass_weights(self.__dict__["_stack_lora_linears"])
        if any(not kernel_takes(w.dtype, dtype) for w in weights if w.numel()):
            if not self._lora_stack_logged:
                self._lora_stack_logged = True
                logger.info("LoRA: the kernels take no adapter weights of this dtype under %s "
                            "activations: passes with adapter rows run layer by layer", dtype)
            return None
        return bank.current.row_adapters, weights

    def _stack_rows(self, x_dtype: torch.dtype) -> int:
        """The most rows for which every linear takes the GEMV (per activation dtype, cached
        with the stack's weights)."""
        kernels = self.backends.kernels
        assert kernels is not None
        _, _, _, by_dtype, linears, _ = self.__dict__["_stack_weight_cache"]
        if x_dtype not in by_dtype:
            by_dtype[x_dtype] = min(gemv_rows(m.weight, m.weight_format, x_dtype, kernels)
                                    for m in linears)
        return by_dtype[x_dtype]

    def _decoder_stack(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       local: tuple[torch.Tensor, torch.Tensor] | None,
                       kv_caches: list[KVCache], meta: AttentionMetadata,
                       lora_slots: torch.Tensor | None = None,
                       lora_weights: list[torch.Tensor] | None = None) -> torch.Tensor:
        kernels = self.backends.kernels
        assert kernels is not None
        first = self.model.layers[0]
        attn = first.self_attn
        # _runs_decoder_stack has just brought the cache up to date (_stack_weights): read it
        # as is (its check walks the module tree: ~20 us).
        cached = self.__dict__["_stack_weight_cache"]
        assert cached[2] is not None
        weights, formats = cached[2]
        biases, norms, out_norms = cached[5]
        moe = self._stack_moe()
        out = kernels.decoder_stack(
            x.contiguous(), weights, formats, [k for k, _ in kv_caches], [v for _, v in kv_caches],
            cos, sin, meta.slot_mapping, meta.block_tables.long(), meta.query_start_loc.long(),
            meta.seq_lens.long(), self.model.norm.weight, self.model.norm.eps, attn.scale,
            attn.num_heads, attn.num_kv_heads, biases, norms, self.args.layer_windows,
            attn.softcap, out_norms, self.args.hidden_act == "gelu_tanh",
            list(local) if local is not None else [], moe=moe, lora_slots=lora_slots,
            lora_weights=lora_weights or [])
        if moe is not None:
            self._stack_moe_ran(moe)
        return out

    def _stack_mlp(self, layer: nn.Module) -> tuple[HeldWeight, HeldWeight]:
        """The layer's (gate_up, down) projections as the decoder stack takes them."""
        return layer.mlp.gate_up_proj, layer.mlp.down_proj

    def _stack_moe(self) -> StackMoe | None:
        """The layers' experts for the decoder stack (None: every MLP is dense)."""
        return None

    def _stack_moe_ran(self, moe: StackMoe) -> None:
        """The stack ran with `moe`: record what its experts read."""

    def _stack_weights(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """Per layer [input norm, qkv, o, post-attention norm, gate_up, down], and each linear's
        format code (0 dense, else layers/quant.py's block format); None where the layers would
        not take the decode GEMV (a weight not contiguous).
        Cached: reading 180 parameters through nn.Module attribute lookups every step costs
        ~0.1 ms; rebuilt when the loader has replaced a parameter (load_state_dict(assign=True))."""
        layers = self.model.layers
        cached = self.__dict__.get("_stack_weight_cache")
        if (cached is None or cached[0] is not layers[0].self_attn.qkv_proj.weight
                or cached[1] is not self._stack_mlp(layers[-1])[1].weight):
            mlps = [self._stack_mlp(layer) for layer in layers]
            weights = [w for layer, (gate_up, down) in zip(layers, mlps, strict=True) for w in (
                layer.input_layernorm.weight, layer.self_attn.qkv_proj.weight,
                layer.self_attn.o_proj.weight, layer.post_attention_layernorm.weight,
                gate_up.weight, down.weight)]
            linears = [m for layer, (gate_up, down) in zip(layers, mlps, strict=True) for m in (
                layer.self_attn.qkv_proj, layer.self_attn.o_proj, gate_up, down)]
            formats = [format_code(m.weight_format) for m in linears]
            usable = all(w.is_contiguous() for w in weights)
            cached = (layers[0].self_attn.qkv_proj.weight, mlps[-1][1].weight,
                      (weights, formats) if usable else None, {}, linears,
                      self._stack_extras())
            self.__dict__["_stack_weight_cache"] = cached
        return cached[2]

    def _stack_extras(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Per layer the qkv bias, the q/k norms and the sandwich norms ([] for a family
        without them), as the decoder stack takes them (cached with `_stack_weights`)."""
        layers = self.model.layers
        first = layers[0]
        attn = first.self_attn
        biases = [layer.self_attn.qkv_bias for layer in layers] if attn.qkv_bias is not None else []
        norms = ([w for layer in layers
                  for w in (layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight)]
                 if attn.q_norm is not None else [])
        out_norms = [w for layer in layers for w in (layer.attn_out_norm.weight,
                                                     layer.mlp_out_norm.weight)
                     ] if first.attn_out_norm is not None else []
        return biases, norms, out_norms

    @property
    def stack_ready(self) -> bool:
        """Whether this family's layers are what the decoder stack kernel computes: RMSNorm
        (sandwich norms too), [q; k; v] with rope (per-layer tables too) and full or windowed
        attention, SwiGLU or GeGLU."""
        return not self.args.stack_blockers()

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank caches (all of them without tensor parallelism)."""
        return self.model.layers[0].self_attn.num_kv_heads

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits [N, vocab] for the N hidden rows given (only the rows to sample);
        under tensor parallelism on rank 0 only (None on the other ranks)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        if hidden.shape[0]:
            self.weight_reads.mark_logits()
        logits = head.logits(hidden)
        cap = self.args.final_softcap
        if logits is None or cap <= 0:
            return logits
        return torch.tanh(logits / cap) * cap


    def partly_read_weights(self) -> list[torch.Tensor]:
        """Weights a pass reads only in part, reporting what it read to `weight_reads`."""
        return []

    def weight_bytes_last_pass(self) -> int:
        """Bytes of weights (this rank's, as held) the last forward pass and its logits
        read: every weight whole, the embedding's rows of the pass's tokens, and of a sparse
        MoE block only the experts its rows chose."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return pass_bytes(self.weight_reads, self.parameters(), self.partly_read_weights(),
                          self.model.embed_tokens.weight, head.weight)


def hf_sources(args: DecoderArgs) -> dict[str, list[str]]:
    """For each of our parameter names, the Hugging Face tensors concatenated (dim 0) into it:
    q/k/v into `qkv_proj`, gate/up into `gate_up_proj`, every other one as is."""
    out: dict[str, list[str]] = {n: [n] for n in ("model.embed_tokens.weight",
                                                  "model.norm.weight")}
    if not args.tie_word_embeddings:
        out["lm_head.weight"] = ["lm_head.weight"]
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
        if args.attention_bias:
            out[p + "self_attn.qkv_bias"] = [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
        if args.qk_norm:
            for n in ("q_norm", "k_norm"):
                out[p + f"self_attn.{n}.weight"] = [p + f"self_attn.{n}.weight"]
        out[p + "mlp.gate_up_proj.weight"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        for name in ("self_attn.o_proj", "mlp.down_proj", "input_layernorm",
                     "post_attention_layernorm"):
            out[p + name + ".weight"] = [p + name + ".weight"]
    return out


def lora_targets(layer: nn.Module) -> dict[str, HeldWeight]:
    """A decoder layer's projections LoRA adapters may target, by name (none of an MoE
    layer's experts: their MLP is no SwiGLU)."""
    attn, mlp = layer.self_attn, layer.mlp
    out: dict[str, HeldWeight] = {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj}
    if isinstance(mlp, SwiGLU):
        out.update(gate_up_proj=mlp.gate_up_proj, down_proj=mlp.down_proj)
    return out


def _token_seq_lens(meta: AttentionMetadata, num_tokens: int) -> torch.Tensor:
    """Each token's sequence length after this step (0 for padding rows past the last
    sequence's tokens)."""
    qlens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    lens = torch.repeat_interleave(meta.seq_lens, qlens)
    if lens.shape[0] < num_tokens:
        lens = torch.cat([lens, lens.new_zeros(num_tokens - lens.shape[0])])
    return lens
