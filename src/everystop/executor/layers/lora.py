"""LoRA deltas added to a linear's output, batched over the adapters of one pass.

Each row of a pass belongs to one adapter (its slot) or to the base model (slot -1). After a
targeted linear, the rows of each adapter are gathered, multiplied through that adapter's
low-rank pair and added back (the SGMV/punica idea in plain torch)::

    out[rows_s] += (x[rows_s] @ A_s^T) @ B_s^T        for each adapter slot s in the pass

A fused projection ([q; k; v], [gate; up]) holds one pair per adapter: A stacks the parts'
A matrices, B places each part's B in its own output rows and rank columns (block diagonal), so
one pair of GEMMs serves every part. PEFT's scaling is folded into B when the adapter loads.

With the CPU kernels, the bank also keeps each pair cut into its parts when it loads (no zero
block of B is read), and a linear's deltas for every adapter of the pass are one kernel call
(csrc/lora_delta.cpp), as the decoder stack adds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from everystop.executor.layers.cpu_kernels import CpuKernels


@dataclass(frozen=True)
class LoraPair:
    """One adapter on one linear: delta = (x @ a.T) @ b.T, the scaling folded into b."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]


@dataclass(frozen=True)
class RowGroups:
    """The rows of an input that belong to each adapter slot (base rows left out)."""

    num_rows: int
    groups: tuple[tuple[int, torch.Tensor], ...]  # (slot, row indices)

    @staticmethod
    def from_slots(slots: torch.Tensor) -> RowGroups:
        """Group the rows of `slots` ([rows] int64, -1 = base) by adapter slot."""
        groups = []
        for slot in torch.unique(slots).tolist():
            if slot >= 0:
                groups.append((int(slot), torch.nonzero(slots == slot).flatten()))
        return RowGroups(int(slots.shape[0]), tuple(groups))


@dataclass(frozen=True)
class LoraPass:
    """The adapter of each row of one forward pass. The last layer may run its attention output
    and MLP on the output rows alone (models/decoder.py's OutputRows), so the grouping of those
    rows is kept too; a linear picks the grouping whose row count its input has (the two counts
    differ: output rows are only cut out when they are fewer than all rows).

    For the kernels that take every adapter of the pass at once: `adapters`, the pass's adapter
    slots in order, and `row_adapters`, each row's index into them (-1: base), with
    `output_row_adapters` the same for the output rows."""

    all_rows: RowGroups
    output_rows: RowGroups | None = None
    adapters: tuple[int, ...] = ()
    row_adapters: torch.Tensor | None = None
    output_row_adapters: torch.Tensor | None = None

    @staticmethod
    def from_slots(slots: torch.Tensor, output_rows: torch.Tensor | None) -> LoraPass:
        out = None
        if output_rows is not None and output_rows.numel() < slots.numel():
            out = RowGroups.from_slots(slots[output_rows])
        all_rows = RowGroups.from_slots(slots)
        row_adapters = torch.full_like(slots, -1)
        for k, (_, rows) in enumerate(all_rows.groups):
            row_adapters[rows] = k
        return LoraPass(all_rows, out, tuple(slot for slot, _ in all_rows.groups),
                        row_adapters, None if out is None else row_adapters[output_rows])

    def row_adapters_for(self, num_rows: int) -> torch.Tensor:
        """`row_adapters` or `output_row_adapters`, whichever has `num_rows` rows."""
        if num_rows == self.all_rows.num_rows:
            assert self.row_adapters is not None
            return self.row_adapters
        if self.output_row_adapters is not None and num_rows == self.output_row_adapters.numel():
            return self.output_row_adapters
        raise ValueError(f"a LoRA pass over {self.all_rows.num_rows} rows got an input of "
                         f"{num_rows} rows")

    def groups_for(self, num_rows: int) -> RowGroups:
        if num_rows == self.all_rows.num_rows:
            return self.all_rows
        if self.output_rows is not None and num_rows == self.output_rows.num_rows:
            return self.output_rows
        raise ValueError(f"a LoRA pass over {self.all_rows.num_rows} rows got an input of "
                         f"{num_rows} rows")


@dataclass
class LoraBank:
    """Every loaded adapter's pairs, by linear and slot, and the pass being run (None: no row
    of it has an adapter). Shared by the model's targeted linears."""

    names: set[str] = field(default_factory=set)  # the linears hooked to this bank
    pairs: dict[str, dict[int, LoraPair]] = field(default_factory=dict)
    current: LoraPass | None = None
    # linear -> its parts' output rows ([q; k; v] has three); set with `kernels`
    part_rows: dict[str, tuple[int, ...]] = field(default_factory=dict)
    kernels: CpuKernels | None = None
    # linear -> slot -> its pair cut into parts (split_parts), made as the adapter loads
    parts: dict[str, dict[int, list[torch.Tensor]]] = field(default_factory=dict)
    # slot -> pass_weights' list for it (the stack's linears, in its order)
    _slot_lists: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def add(self, slot: int, name: str, pair: LoraPair) -> None:
        """Serve `pair` as adapter `slot`'s on linear `name`."""
        self.pairs.setdefault(name, {})[slot] = pair
        if name in self.part_rows:
            self.parts.setdefault(name, {})[slot] = split_parts(pair, self.part_rows[name])
        self._slot_lists.pop(slot, None)

    def remove(self, slot: int) -> None:
        """Drop every pair of adapter `slot`."""
        for by_slot in (*self.pairs.values(), *self.parts.values()):
            by_slot.pop(slot, None)
        self._slot_lists.pop(slot, None)

    def add_delta(self, linear: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (= x @ W^T, this pass's fresh output) plus each row's adapter delta, in place."""
        batch = self.current
        if batch is None:
            return out
        by_slot = self.pairs.get(linear)
        if not by_slot:
            return out
        if self._kernel_add(linear, batch, x, out):
            return out
        for slot, rows in batch.groups_for(x.shape[0]).groups:
            pair = by_slot.get(slot)
            if pair is None:  # this adapter does not target this linear
                continue
            dtype = torch.promote_types(x.dtype, pair.a.dtype)  # bf16 adapters: fp32 math
            xs = x.index_select(0, rows).to(dtype)
            delta = (xs @ pair.a.to(dtype).T) @ pair.b.to(dtype).T
            out.index_add_(0, rows, delta.to(out.dtype))
        return out

    def _kernel_add(self, linear: str, batch: LoraPass, x: torch.Tensor, out: torch.Tensor
                    ) -> bool:
        """Every adapter's deltas on `linear` in one grouped kernel call, where the kernels
        take these tensors (CPU, x's dtype throughout, `out` contiguous). False: not done."""
        kernels, by_slot = self.kernels, self.parts.get(linear)
        if (kernels is None or by_slot is None or not kernels.handles(x)
                or x.dtype != out.dtype or out.dim() != 2 or not out.is_contiguous()):
            return False
        rows = self.part_rows[linear]
        none = [_NONE, _NONE] * len(rows)
        weights: list[torch.Tensor] = []
        for slot in batch.adapters:
            weights += by_slot.get(slot, none)
        if any(not kernel_takes(w.dtype, x.dtype) for w in weights if w.numel()):
            return False
        offsets = [sum(rows[:p]) for p in range(len(rows))]
        kernels.lora_add_(out, x.contiguous(), batch.row_adapters_for(x.shape[0]), weights,
                          offsets)
        return True

    def pass_weights(self, linears: list[tuple[str, tuple[int, ...]]]) -> list[torch.Tensor]:
        """The decoder stack's LoRA weights: for each adapter of the current pass, for each of
        `linears` (name, the row counts of its parts: [q; k; v] has three), for each part its
        (A, B^T), or two empty tensors where the adapter leaves that part alone."""
        assert self.current is not None
        out: list[torch.Tensor] = []
        for slot in self.current.adapters:
            out += self._slot_parts(slot, linears)
        return out

    def _slot_parts(self, slot: int, linears: list[tuple[str, tuple[int, ...]]]
                    ) -> list[torch.Tensor]:
        """pass_weights' list for one adapter, kept until its pairs change."""
        cached = self._slot_lists.get(slot)
        if cached is not None:
            return cached
        parts: list[torch.Tensor] = []
        for name, rows in linears:
            split = self.parts.get(name, {}).get(slot)
            if split is None:
                split = split_parts(self.pairs.get(name, {}).get(slot), rows)
            parts += split
        self._slot_lists[slot] = parts
        return parts


def split_parts(pair: LoraPair | None, rows: tuple[int, ...]) -> list[torch.Tensor]:
    """A fused pair as one (A, B^T) per part of its output rows, as the grouped kernel takes
    them: the span of rank columns nonzero in the part's rows of B, A's matching rows (a view)
    and those B columns transposed ([rank, rows], a copy). A part without a nonzero column (not
    targeted) gets two empty tensors."""
    out: list[torch.Tensor] = []
    start = 0
    for num in rows:
        b = None if pair is None else pair.b[start:start + num]
        cols = (torch.empty(0, dtype=torch.long) if b is None
                else torch.nonzero(b.abs().sum(dim=0)).flatten())
        if pair is None or b is None or cols.numel() == 0:
            out += (_NONE, _NONE)
        else:
            first, last = int(cols[0]), int(cols[-1]) + 1
            out += (pair.a[first:last], b[:, first:last].T.contiguous())
        start += num
    return out


def adapter_dtype(activations: torch.dtype, projections: torch.dtype,
                  kernels: CpuKernels | None) -> torch.dtype:
    """The dtype adapters are held in: the activations', or bf16 under fp32 activations when
    the base's own projections are held below fp32 (quantized blocks, 16-bit weights) and the
    CPU kernels add the deltas. A decode pass reads every adapter of the pass in full (8
    rank-16 adapters of all seven projections: ~30% of a 135M base's parameters), so halving
    their bytes matters, and their rounding is far below the base weights' own."""
    if (activations == torch.float32 and projections != torch.float32
            and kernels is not None):
        return torch.bfloat16
    return activations


def kernel_takes(weights: torch.dtype, activations: torch.dtype) -> bool:
    """Whether the grouped kernel takes adapter weights of `weights` under `activations`."""
    return weights == activations or (weights == torch.bfloat16
                                      and activations == torch.float32)


_NONE = torch.empty(0)  # no pair (the stack checks a pair's shapes only where A is non-empty)


@dataclass(frozen=True)
class LoraHook:
    """What a targeted linear holds: the bank and its own name in it."""

    bank: LoraBank
    name: str

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self.bank.add_delta(self.name, x, out)
