"""The adapters one model runner serves: loaded by id into the model's LoRA bank, and the
adapter of each row of a pass.

An adapter id is a small non-negative integer the engine gives each adapter when it loads
(never reused, so the prefix cache of an unloaded adapter can never serve a new one); -1 is
the base model.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
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
    """Adapters by id: every one served has a path; the ones resident hold their weights in the
    model's bank. With `max_resident` (--max-cpu-loras) set, loading or using an adapter beyond
    it drops the least recently used adapter that no running request uses; an adapter used
    again after that is read from its path again."""

    def __init__(self, model: DecoderForCausalLM, dtype: torch.dtype,
                 max_rank: int = DEFAULT_MAX_LORA_RANK, max_resident: int = 0) -> None:
        if model.ctx.world_size > 1:
            raise LoraLoadError("LoRA adapters are not served under tensor parallelism")
        self.model, self.dtype, self.max_rank = model, dtype, max_rank
        self.max_resident = max_resident  # 0: no cap
        self.bank = model.attach_lora_bank()
        self.paths: dict[int, str] = {}
        self.adapters: OrderedDict[int, LoraAdapter] = OrderedDict()  # least recently used first
        self.running_ids: frozenset[int] = frozenset()  # as of the last pass
        self.num_evictions = self.num_reloads = 0

    def load(self, lora_id: int, path: str) -> LoraAdapter:
        """Read the adapter at `path` (a PEFT directory or a llama.cpp GGUF file) and serve it
        as `lora_id` (LoraLoadError if it does not fit this base model)."""
        if lora_id < 0:
            raise ValueError(f"adapter ids are non-negative, not {lora_id}")
        if lora_id in self.paths:
            raise ValueError(f"adapter id {lora_id} is already loaded")
        adapter = self._read(lora_id, path)
        self.paths[lora_id] = path
        logger.info("LoRA adapter %d: %s, rank %d, scale %g, %d projections, %.1f MiB",
                    lora_id, path, adapter.rank, adapter.scale, len(adapter.pairs),
                    adapter.nbytes / 2**20)
        self._evict_over_cap(keep={lora_id})
        return adapter

    def unload(self, lora_id: int) -> None:
        if self.paths.pop(lora_id, None) is None:
            raise KeyError(f"no adapter with id {lora_id}")
        self._drop(lora_id)

    @property
    def nbytes(self) -> int:
        """Bytes of the resident adapters' weights."""
        return sum(a.nbytes for a in self.adapters.values())

    def _read(self, lora_id: int, path: str) -> LoraAdapter:
        """Read the adapter's weights into the bank as the most recently used."""
        read = load_gguf_adapter if is_gguf_file(path) else load_peft_adapter
        adapter = read(path, self.model.args, self.dtype, self.max_rank)
        device = self.model.model.norm.weight.device
        for name in adapter.pairs:
            if name not in self.bank.names:
                raise LoraLoadError(f"{path}: this base model's {name} takes no LoRA delta")
        for name, pair in adapter.pairs.items():
            self.bank.add(lora_id, name, type(pair)(pair.a.to(device), pair.b.to(device)))
        self.adapters[lora_id] = adapter
        return adapter

    def _drop(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)
        self.bank.remove(lora_id)

    def _make_resident(self, ids: set[int], running: frozenset[int]) -> None:
        """The adapters of a pass in the bank, most recently used; then the cap applied."""
        self.running_ids = running
        for lora_id in sorted(ids):
            if lora_id in self.adapters:
                self.adapters.move_to_end(lora_id)
            elif lora_id in self.paths:
                self._read(lora_id, self.paths[lora_id])
                self.num_reloads += 1
                logger.info("LoRA adapter %d reloaded from %s", lora_id, self.paths[lora_id])
        self._evict_over_cap(keep=ids)

    def _evict_over_cap(self, keep: set[int]) -> None:
        if not self.max_resident:
            return
        spared = keep | self.running_ids
        while len(self.adapters) > self.max_resident:
            victim = next((i for i in self.adapters if i not in spared), None)
            if victim is None:  # every resident adapter is in use: over the cap until one is not
                logger.warning("LoRA: %d adapters resident, above --max-cpu-loras %d: each is "
                               "used by a running request", len(self.adapters),
                               self.max_resident)
                return
            freed = self.adapters[victim].nbytes
            self._drop(victim)
            self.num_evictions += 1
            logger.info("LoRA adapter %d evicted from memory (least recently used; "
                        "--max-cpu-loras %d): %.1f MiB freed; it is read again from %s on its "
                        "next use", victim, self.max_resident, freed / 2**20,
                        self.paths[victim])

    def pass_for(self, seqs: Sequence[ScheduledSequence], output_rows: torch.Tensor | None,
                 running: frozenset[int] = frozenset()) -> LoraPass | None:
        """Each token row's adapter for the packed pass of `seqs` (their adapters read back
        in if evicted); None when no row has one. `running`: the adapters of every running
        request, which are never evicted."""
        for s in seqs:
            if s.lora_id != BASE and s.lora_id not in self.paths:
                raise KeyError(f"request {s.request_id}: adapter id {s.lora_id} is not loaded")
        used = {s.lora_id for s in seqs if s.lora_id != BASE}
        self._make_resident(used, running)
        if not used:
            return None
        lens = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        ids = np.fromiter((s.lora_id for s in seqs), dtype=np.int64, count=len(seqs))
        slots = torch.from_numpy(np.repeat(ids, lens))
        device = self.model.model.norm.weight.device
        return LoraPass.from_slots(slots.to(device), output_rows)

    @contextmanager
    def running(self, seqs: Sequence[ScheduledSequence], output_rows: torch.Tensor | None,
                running: frozenset[int] = frozenset()) -> Iterator[None]:
        """The model's targeted projections add the adapters' deltas while inside."""
        self.bank.current = self.pass_for(seqs, output_rows, running)
        try:
            yield
        finally:
            self.bank.current = None
