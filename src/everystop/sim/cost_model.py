"""Latency of one forward pass from its shape: a roofline per iteration plus comm and overhead.

    time = max(flops / (peak * eff_c), bytes / (hbm_bw * eff_m))     the kernels, per GPU
         + n_allreduce * (latency + ring_bytes / (link_bw * eff_l))  tensor-parallel comm
         + overhead + overhead_per_seq * num_seqs                     CPU work outside kernels
         + swap_bytes / pcie_bw                                       preemption swaps

flops  = 2 * layer_params * tokens + 2 * lm_head_params * sampled + 4 * L * H * d * attn_pairs
bytes  = weight bytes + KV bytes read (every sequence's whole context) + KV bytes written
(all divided by tp). Activations are left out: at these sizes they are a few % of the bytes.

The same form is fitted to measurements (see `fit.py`): the coefficients are then plain
seconds-per-FLOP and seconds-per-byte rather than 1/(peak*eff).

A CPU runs its kernels one after another, not overlapped, and switches kernels by batch size,
so measured CPU passes are described by an extended form that replaces the max:

    attention_apart   the max covers the dense work only (dense FLOPs, weight bytes); attention
                      is added on top: e * attention FLOPs + f * KV bytes
    gemv_max_tokens   passes of up to this many tokens run the linears as GEMVs, which read
                      every weight once per chunk of gemv_chunk_rows rows, and once more per
                      chunk of at least gemv_narrow_rows rows (0: none), whose accumulators
                      leave registers for fewer output columns at a time:
                          (chunks * g_w + narrow chunks * g_n) * weight bytes + dense FLOPs * g_f
                      larger passes run GEMMs that first convert every weight once:
                          weight bytes * h_w + max(a * dense FLOPs, b * weight bytes)

With the defaults (False, 0) the form above is computed exactly as before.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from everystop.core.outputs import SchedulerOutput
from everystop.sim.specs import HardwareSpec, ModelSpec


@dataclass(frozen=True)
class IterationShape:
    """What a cost model needs to know about one forward pass (no token ids)."""

    num_seqs: int
    num_decode_tokens: int
    num_prefill_tokens: int
    context_tokens_read: int  # sum over sequences of the context after this step
    attention_pairs: int  # sum over new tokens of the positions each attends to
    num_sampled: int
    num_swap_blocks: int = 0
    # Proposals verified on speculating decode rows: query rows like prefill tokens, each
    # sampled (counted in num_sampled too).
    num_draft_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens + self.num_draft_tokens

    @classmethod
    def from_scheduler_output(cls, out: SchedulerOutput) -> IterationShape:
        # One loop, no per-field generators: this runs once per simulated pass (the fleet
        # simulator's hot path).
        # Decode rows held in bulk (core/decode_batch.py): one token each, reading their context.
        bulk = out.num_bulk_decodes
        pairs = context = out.bulk_context_tokens
        sampled = bulk
        for e in out.scheduled:
            n, start = len(e.token_ids), e.start_pos
            pairs += n * start + n * (n + 1) // 2
            context += start + n
            sampled += e.sample
        sampled += out.num_draft_tokens  # a speculating row samples its 1+k positions
        return cls(num_seqs=len(out.scheduled) + bulk, num_decode_tokens=out.num_decode_tokens,
                   num_prefill_tokens=out.num_prefill_tokens, context_tokens_read=context,
                   attention_pairs=pairs, num_sampled=sampled,
                   num_swap_blocks=len(out.blocks_to_swap_in) + len(out.blocks_to_swap_out),
                   num_draft_tokens=out.num_draft_tokens)

    @classmethod
    def from_record(cls, rec: dict) -> IterationShape:
        """From a measured-iteration record. Only num_decode_tokens, num_prefill_tokens and
        context_tokens_read are required; missing fields are approximated (exact for
        decode-only iterations)."""
        dec, pre = int(rec["num_decode_tokens"]), int(rec["num_prefill_tokens"])
        ctx = int(rec["context_tokens_read"])
        seqs = int(rec.get("num_seqs", dec + (1 if pre else 0)))
        pairs = int(rec.get("attention_pairs", ctx + pre * pre // 2))
        return cls(num_seqs=seqs, num_decode_tokens=dec, num_prefill_tokens=pre,
                   context_tokens_read=ctx, attention_pairs=pairs,
                   num_sampled=int(rec.get("num_sampled", seqs)),
                   num_swap_blocks=int(rec.get("num_swap_blocks", 0)),
                   num_draft_tokens=int(rec.get("num_draft_tokens", 0)))

    def to_dict(self) -> dict:
        return asdict(self)


def gemv_chunks(rows: int, chunk_rows: int, narrow_rows: int) -> tuple[int, int]:
    """How many chunks of at most `chunk_rows` rows a GEMV of `rows` rows takes, and how many
    of them have at least `narrow_rows` rows (0: none counted)."""
    full, rest = divmod(rows, chunk_rows)
    if not narrow_rows:
        return full + (rest > 0), 0
    return full + (rest > 0), full * (chunk_rows >= narrow_rows) + (rest >= narrow_rows)


@dataclass(frozen=True)
class Work:
    """Per-GPU work of one iteration."""

    flops: float
    bytes: float
    comm_bytes: float  # per all-reduce, ring traffic per GPU
    num_allreduce: int
    swap_bytes: float


@dataclass(frozen=True)
class Coefficients:
    sec_per_flop: float
    sec_per_byte: float
    overhead_s: float
    overhead_per_seq_s: float = 0.0
    sec_per_link_byte: float = 0.0
    allreduce_latency_s: float = 0.0
    sec_per_swap_byte: float = 0.0
    # The extended form (module docstring); the defaults keep the roofline form.
    attention_apart: bool = False
    sec_per_attention_flop: float = 0.0
    sec_per_kv_byte: float = 0.0
    gemv_max_tokens: int = 0
    gemv_chunk_rows: int = 8
    sec_per_gemv_weight_byte: float = 0.0  # per chunk of gemv_chunk_rows rows
    gemv_narrow_rows: int = 0
    sec_per_gemv_narrow_weight_byte: float = 0.0  # per chunk of gemv_narrow_rows rows or more
    sec_per_gemv_flop: float = 0.0
    sec_per_gemm_weight_byte: float = 0.0  # once per pass above gemv_max_tokens

    @classmethod
    def from_hardware(cls, hw: HardwareSpec) -> Coefficients:
        return cls(sec_per_flop=1.0 / (hw.peak_flops * hw.eff_compute),
                   sec_per_byte=1.0 / (hw.hbm_bandwidth * hw.eff_memory),
                   overhead_s=hw.iteration_overhead_s, overhead_per_seq_s=hw.overhead_per_seq_s,
                   sec_per_link_byte=1.0 / (hw.link_bandwidth * hw.eff_link),
                   allreduce_latency_s=hw.allreduce_latency_s,
                   sec_per_swap_byte=1.0 / hw.pcie_bandwidth)

    def to_dict(self) -> dict:
        return asdict(self)


class CostModel:
    """Modeled latency of a forward pass of `model` sharded `tp` ways."""

    def __init__(self, model: ModelSpec, tp: int, coeffs: Coefficients,
                 hw: HardwareSpec | None = None, block_size: int = 16) -> None:
        self.model, self.tp, self.coeffs, self.hw = model, tp, coeffs, hw
        self.block_size = block_size

    @classmethod
    def from_specs(cls, model: ModelSpec, hw: HardwareSpec, tp: int,
                   block_size: int = 16) -> CostModel:
        return cls(model, tp, Coefficients.from_hardware(hw), hw, block_size)

    def work(self, s: IterationShape) -> Work:
        m, tp = self.model, self.tp
        flops = (2 * m.layer_params * s.num_tokens + 2 * m.lm_head_params * s.num_sampled
                 + 4 * m.num_layers * m.num_heads * m.head_dim * s.attention_pairs)
        weights = m.pass_weight_bytes
        kv = (s.context_tokens_read + s.num_tokens) * m.kv_bytes_per_token
        ring = 2 * (tp - 1) / tp * s.num_tokens * m.hidden_size * m.dtype_bytes if tp > 1 else 0.0
        swap = s.num_swap_blocks * self.block_size * m.kv_bytes_per_token
        return Work(flops=flops / tp, bytes=(weights + kv) / tp, comm_bytes=ring,
                    num_allreduce=2 * m.num_layers if tp > 1 else 0, swap_bytes=swap / tp)

    def _extended_kernels_s(self, s: IterationShape) -> tuple[float, float, float, float]:
        """The extended form's kernel time (module docstring) in four parts: the per-pass weight
        reads or conversions, the dense compute side, the dense memory side (the GEMMs' max
        takes the larger of the two; the GEMVs' memory side is 0: their weight reads are in the
        first part) and attention. (`work`'s totals split again here, so the roofline form's
        hot path builds nothing more.)"""
        m, tp, c = self.model, self.tp, self.coeffs
        dense = (2 * m.layer_params * s.num_tokens + 2 * m.lm_head_params * s.num_sampled) / tp
        attention = 4 * m.num_layers * m.num_heads * m.head_dim * s.attention_pairs / tp
        weights = m.pass_weight_bytes / tp
        kv = (s.context_tokens_read + s.num_tokens) * m.kv_bytes_per_token / tp
        if c.attention_apart:
            compute, memory = dense, weights
            attention_s = attention * c.sec_per_attention_flop + kv * c.sec_per_kv_byte
        else:
            compute, memory, attention_s = dense + attention, weights + kv, 0.0
        num_tokens = s.num_tokens
        if num_tokens <= c.gemv_max_tokens:
            chunks, narrow = gemv_chunks(num_tokens, c.gemv_chunk_rows, c.gemv_narrow_rows)
            return ((chunks * c.sec_per_gemv_weight_byte
                     + narrow * c.sec_per_gemv_narrow_weight_byte) * weights,
                    compute * c.sec_per_gemv_flop, 0.0, attention_s)
        return (weights * c.sec_per_gemm_weight_byte, compute * c.sec_per_flop,
                memory * c.sec_per_byte, attention_s)

    def breakdown(self, s: IterationShape) -> dict[str, float]:
        w, c = self.work(s), self.coeffs
        if c.attention_apart or c.gemv_max_tokens:
            weights_s, compute_s, memory_s, attention_s = self._extended_kernels_s(s)
            kernels = {"weights_s": weights_s, "compute_s": compute_s, "memory_s": memory_s,
                       "attention_s": attention_s}
        else:
            kernels = {"compute_s": w.flops * c.sec_per_flop, "memory_s": w.bytes * c.sec_per_byte}
        return {**kernels,
                "comm_s": w.num_allreduce * (c.allreduce_latency_s
                                             + w.comm_bytes * c.sec_per_link_byte),
                "overhead_s": c.overhead_s + c.overhead_per_seq_s * s.num_seqs,
                "swap_s": w.swap_bytes * c.sec_per_swap_byte}

    def latency(self, s: IterationShape) -> float:
        # The sum `breakdown` itemizes, in the same order (so the same float), without building
        # the dict or the Work: this runs once per simulated pass. NOTE: the roofline form's
        # terms are `work`'s, written out with the same operations in the same order; a test
        # holds them equal.
        m, tp, c = self.model, self.tp, self.coeffs
        if c.attention_apart or c.gemv_max_tokens:
            w = self.work(s)
            weights_s, compute_s, memory_s, attention_s = self._extended_kernels_s(s)
            return (weights_s + max(compute_s, memory_s) + attention_s
                    + w.num_allreduce * (c.allreduce_latency_s
                                         + w.comm_bytes * c.sec_per_link_byte)
                    + (c.overhead_s + c.overhead_per_seq_s * s.num_seqs)
                    + w.swap_bytes * c.sec_per_swap_byte)
        tokens = s.num_decode_tokens + s.num_prefill_tokens + s.num_draft_tokens
        flops = (2 * m.layer_params * tokens + 2 * m.lm_head_params * s.num_sampled
                 + 4 * m.num_layers * m.num_heads * m.head_dim * s.attention_pairs) / tp
        kv_bytes = m.kv_bytes_per_token
        nbytes = (m.pass_weight_bytes + (s.context_tokens_read + tokens) * kv_bytes) / tp
        if tp > 1:
            ring = 2 * (tp - 1) / tp * tokens * m.hidden_size * m.dtype_bytes
            comm = 2 * m.num_layers * (c.allreduce_latency_s + ring * c.sec_per_link_byte)
        else:
            comm = 0 * (c.allreduce_latency_s + 0.0 * c.sec_per_link_byte)
        swap = s.num_swap_blocks * self.block_size * kv_bytes / tp
        return (max(flops * c.sec_per_flop, nbytes * c.sec_per_byte)
                + comm
                + (c.overhead_s + c.overhead_per_seq_s * s.num_seqs)
                + swap * c.sec_per_swap_byte)

    def decode_latency(self, n: int, context: int) -> float:
        """`latency(IterationShape(n, n, 0, context, context, n))`: a pure decode pass of n rows
        reading `context` tokens, the same float without building the shape (a decode stretch
        plans one per pass). NOTE: the roofline form's terms as `latency` writes them, in the
        same order; a test holds the two equal."""
        c = self.coeffs
        if c.attention_apart or c.gemv_max_tokens:
            return self.latency(IterationShape(n, n, 0, context, context, n))
        m, tp = self.model, self.tp
        flops = (2 * m.layer_params * n + 2 * m.lm_head_params * n
                 + 4 * m.num_layers * m.num_heads * m.head_dim * context) / tp
        kv_bytes = m.kv_bytes_per_token
        nbytes = (m.pass_weight_bytes + (context + n) * kv_bytes) / tp
        if tp > 1:
            ring = 2 * (tp - 1) / tp * n * m.hidden_size * m.dtype_bytes
            comm = 2 * m.num_layers * (c.allreduce_latency_s + ring * c.sec_per_link_byte)
        else:
            comm = 0 * (c.allreduce_latency_s + 0.0 * c.sec_per_link_byte)
        swap = 0 * self.block_size * kv_bytes / tp
        return (max(flops * c.sec_per_flop, nbytes * c.sec_per_byte)
                + comm
                + (c.overhead_s + c.overhead_per_seq_s * n)
                + swap * c.sec_per_swap_byte)

    def min_latency_s(self) -> float:
        """A floor under `latency` for every pass shape, or 0.0 where none is derived (the
        extended form). The roofline form's terms at no tokens, no context and no sequences:
        each term of the sum is at least its floor here and float addition is monotone, so
        no pass of any shape is priced below it, to the last bit (fleet_parallel relies on
        that: a pass started at t cannot end before t + this)."""
        c = self.coeffs
        if c.attention_apart or c.gemv_max_tokens:
            return 0.0
        m, tp = self.model, self.tp
        memory = m.pass_weight_bytes / tp * c.sec_per_byte
        comm = 2 * m.num_layers * c.allreduce_latency_s if tp > 1 else 0.0
        return memory + comm + c.overhead_s

    def roofline_s(self, s: IterationShape) -> float:
        """Physical floor: peak FLOPs and full HBM bandwidth, no comm, no overhead. No real
        iteration of this shape on this hardware can be faster."""
        if self.hw is None:
            raise ValueError("the roofline needs a hardware spec")
        w = self.work(s)
        return max(w.flops / self.hw.peak_flops, w.bytes / self.hw.hbm_bandwidth)


def decode_shape(batch: int, context_len: int) -> IterationShape:
    """A pure decode step: `batch` sequences, each with `context_len` tokens after the step."""
    return IterationShape(num_seqs=batch, num_decode_tokens=batch, num_prefill_tokens=0,
                          context_tokens_read=batch * context_len,
                          attention_pairs=batch * context_len, num_sampled=batch)


def prefill_shape(prompt_len: int, start: int = 0) -> IterationShape:
    """One sequence's prefill chunk of `prompt_len` tokens starting at position `start`."""
    return IterationShape(num_seqs=1, num_decode_tokens=0, num_prefill_tokens=prompt_len,
                          context_tokens_read=start + prompt_len,
                          attention_pairs=prompt_len * start + prompt_len * (prompt_len + 1) // 2,
                          num_sampled=1)
