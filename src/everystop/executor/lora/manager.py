"""The adapters one model runner serves: loaded by id into the model's LoRA bank, and the
adapter of each row of a pass.

An adapter id is a small non-negative integer the engine gives each adapter when it loads
(never reused, so the prefix cache of an unloaded adapter can never serve a new one); -1 is
the base model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from everystop.core.outputs import ScheduledSequence
from everystop.executor.layers.lora import LoraPass
from everystop.executor.lora.gguf_adapter import is_gguf_file, load_gguf_adapter
from everystop.executor.lora.peft_adapter import (
    DEFAULT_MAX_LORA_RANK,
    LoraAdapter,
    LoraLoadError,
    load_peft_adapter,
)
from everystop.executor.models.decoder import DecoderForCausalLM

BASE = -1
logger = logging.getLogger(__name__)


class LoraManager:
    def __init__(self, model: DecoderForCausalLM, dtype: torch.dtype,
                 max_rank: int = DEFAULT_MAX_LORA_RANK) -> None:
        if model.ctx.world_size > 1:
            raise LoraLoadError("LoRA adapters are not served under tensor parallelism")
        self.model, self.dtype, self.max_rank = model, dtype, max_rank
        self.bank = model.attach_lora_bank()
        self.adapters: dict[int, LoraAdapter] = {}

    def load(self, lora_id: int, path: str) -> LoraAdapter:
        """Read the adapter at `path` (a PEFT directory or a llama.cpp GGUF file) and serve it
        as `lora_id` (LoraLoadError if it does not fit this base model)."""
        if lora_id < 0:
            raise ValueError(f"adapter ids are non-negative, not {lora_id}")
        if lora_id in self.adapters:
            raise ValueError(f"adapter id {lora_id} is already loaded")
        read = load_gguf_adapter if is_gguf_file(path) else load_peft_adapter
        adapter = read(path, self.model.args, self.dtype, self.max_rank)
        device = self.model.model.norm.weight.device
        for name, pair in adapter.pairs.items():
            if name not in self.bank.names:
                raise LoraLoadError(f"{path}: this base model's {name} takes no LoRA delta")
            self.bank.pairs.setdefault(name, {})[lora_id] = type(pair)(
                pair.a.to(device), pair.b.to(device))
        self.adapters[lora_id] = adapter
        logger.info("LoRA adapter %d: %s, rank %d, scale %g, %d projections, %.1f MiB",
                    lora_id, path, adapter.rank, adapter.scale, len(adapter.pairs),
                    adapter.nbytes / 2**20)
        return adapter

    def unload(self, lora_id: int) -> None:
        if self.adapters.pop(lora_id, None) is None:
            raise KeyError(f"no adapter with id {lora_id}")
        for by_slot in self.bank.pairs.values():
            by_slot.pop(lora_id, None)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.adapters.values())

    def pass_for(self, seqs: Sequence[ScheduledSequence],
                 output_rows: torch.Tensor | None) -> LoraPass | None:
        """Each token row's adapter for the packed pass of `seqs`; None when no row has one."""
        if all(s.lora_id == BASE for s in seqs):
            return None
        for s in seqs:
            if s.lora_id != BASE and s.lora_id not in self.adapters:
                raise KeyError(f"request {s.request_id}: adapter id {s.lora_id} is not loaded")
        lens = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        ids = np.fromiter((s.lora_id for s in seqs), dtype=np.int64, count=len(seqs))
        slots = torch.from_numpy(np.repeat(ids, lens))
        device = self.model.model.norm.weight.device
        return LoraPass.from_slots(slots.to(device), output_rows)

    @contextmanager
    def running(self, seqs: Sequence[ScheduledSequence],
                output_rows: torch.Tensor | None) -> Iterator[None]:
        """The model's targeted projections add the adapters' deltas while inside."""
        self.bank.current = self.pass_for(seqs, output_rows)
        try:
            yield
        finally:
            self.bank.current = None
