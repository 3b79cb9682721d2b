"""LoRA deltas added to a linear's output, batched over the adapters of one pass.

Each row of a pass belongs to one adapter (its slot) or to the base model (slot -1). After a
targeted linear, the rows of each adapter are gathered, multiplied through that adapter's
low-rank pair and added back (the SGMV/punica idea in plain torch)::

    out[rows_s] += (x[rows_s] @ A_s^T) @ B_s^T        for each adapter slot s in the pass

A fused projection ([q; k; v], [gate; up]) holds one pair per adapter: A stacks the parts'
A matrices, B places each part's B in its own output rows and rank columns (block diagonal), so
one pair of GEMMs serves every part. PEFT's scaling is folded into B when the adapter loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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

    For the kernels that take every adapter of the pass at once (the decoder stack): `adapters`,
    the pass's adapter slots in order, and `row_adapters`, each row's index into them (-1:
    base)."""

    all_rows: RowGroups
    output_rows: RowGroups | None = None
    adapters: tuple[int, ...] = ()
    row_adapters: torch.Tensor | None = None

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
                        row_adapters)

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
    # slot -> (the pairs its parts were cut from, the parts): pass_weights' cache
    _parts: dict[int, tuple[list[LoraPair | None], list[torch.Tensor]]] = field(
        default_factory=dict)

    def add_delta(self, linear: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (= x @ W^T, this pass's fresh output) plus each row's adapter delta, in place."""
        batch = self.current
        if batch is None:
            return out
        by_slot = self.pairs.get(linear)
        if not by_slot:
            return out
        for slot, rows in batch.groups_for(x.shape[0]).groups:
            pair = by_slot.get(slot)
            if pair is None:  # this adapter does not target this linear
                continue
            xs = x.index_select(0, rows).to(pair.a.dtype)
            delta = (xs @ pair.a.T) @ pair.b.T
            out.index_add_(0, rows, delta.to(out.dtype))
        return out

    def pass_weights(self, linears: list[tuple[str, tuple[int, ...]]]) -> list[torch.Tensor]:
        """The decoder stack's LoRA weights: for each adapter of the current pass, for each of
        `linears` (name, the row counts of its parts: [q; k; v] has three), for each part its
        (A, B), or two empty tensors where the adapter leaves that part alone."""
        assert self.current is not None
        out: list[torch.Tensor] = []
        for slot in self.current.adapters:
            out += self._slot_parts(slot, linears)
        return out

    def _slot_parts(self, slot: int, linears: list[tuple[str, tuple[int, ...]]]
                    ) -> list[torch.Tensor]:
        """pass_weights' list for one adapter, kept while its pairs are the bank's (views of
        them: no copy)."""
        pairs = [self.pairs.get(name, {}).get(slot) for name, _ in linears]
        cached = self._parts.get(slot)
        if cached is not None and len(cached[0]) == len(pairs) and all(
                a is b for a, b in zip(cached[0], pairs, strict=True)):
            return cached[1]
        live = {s for by_slot in self.pairs.values() for s in by_slot}
        for gone in [s for s in self._parts if s not in live]:
            del self._parts[gone]
        parts: list[torch.Tensor] = []
        for pair, (_, rows) in zip(pairs, linears, strict=True):
            parts += split_parts(pair, rows)
        self._parts[slot] = (pairs, parts)
        return parts


def split_parts(pair: LoraPair | None, rows: tuple[int, ...]) -> list[torch.Tensor]:
    """A fused pair as one (A, B) per part of its output rows: the part's rows of B and the
    span of columns nonzero in them, with A's matching rows (views). A part without a nonzero
    column (not targeted) gets two empty tensors."""
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
            out += (pair.a[first:last], b[:, first:last])
        start += num
    return out


_NONE = torch.empty(0)  # no pair (the stack checks a pair's shapes only where A is non-empty)


@dataclass(frozen=True)
class LoraHook:
    """What a targeted linear holds: the bank and its own name in it."""

    bank: LoraBank
    name: str

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self.bank.add_delta(self.name, x, out)
