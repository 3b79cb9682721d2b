"""The KV block pools: one device pool the model reads and writes, one host pool for swapped
blocks, and the block copies between them.

Both pools hold all layers in one tensor so a swap is one gather/scatter for all layers::

    pool: [num_layers, 2 (key, value), num_blocks, block_size, num_kv_heads, head_dim]
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_device_blocks: int, num_host_blocks: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        shape = (num_layers, 2, 0, block_size, num_kv_heads, head_dim)
        # NOTE: uninitialised, like the host pool: zero-filling a pool of gigabytes cost ~0.7 s
        # of start-up and touched every page. Every reader stays within each sequence's
        # written slots (the C++ kernel stops at the sequence length; the torch path zeroes
        # the V rows it gathers past it), so unwritten slots are never used.
        device_shape = _with_blocks(shape, num_device_blocks)
        if device.type == "cpu":
            self.device_pool = _untouched_host_tensor(device_shape, dtype)
        else:
            self.device_pool = torch.empty(device_shape, dtype=dtype, device=device)
        # Uninitialised on purpose: a host block is only read after a swap-out wrote it, and
        # untouched pages of a large swap space cost no memory until used.
        host_shape = _with_blocks(shape, num_host_blocks)
        if device.type == "cuda":  # pinned host memory makes device<->host copies async
            self.host_pool = torch.empty(host_shape, dtype=dtype, pin_memory=True)
        else:
            self.host_pool = _untouched_host_tensor(host_shape, dtype)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self.device_pool[layer, 0], self.device_pool[layer, 1]) for layer in range(num_layers)]

    @property
    def num_device_blocks(self) -> int:
        return self.device_pool.shape[2]

    @property
    def num_host_blocks(self) -> int:
        return self.host_pool.shape[2]

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks, for (device_block, host_block) pairs."""
        if not pairs:
            return
        src = torch.tensor([d for d, _ in pairs], device=self.device)
        dst = torch.tensor([h for _, h in pairs])
        self.host_pool[:, :, dst] = self.device_pool[:, :, src].to("cpu")

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks, for (host_block, device_block) pairs."""
        if not pairs:
            return
        src = torch.tensor([h for h, _ in pairs])
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        blocks = self.host_pool[:, :, src]
        if self.device.type == "cuda":
            blocks = blocks.pin_memory()
        self.device_pool[:, :, dst] = blocks.to(self.device, non_blocking=True)


def _untouched_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host tensor on its own anonymous mapping, so its pages cost memory only once written."""
    # NOTE: torch.empty goes through malloc, which may hand back heap pages an earlier
    # allocation already touched (CI saw a 64 MiB pool fully resident before any write); a
    # mapping of our own makes "resident only once used" hold whatever the allocator does.
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # frombuffer keeps the mapping alive for as long as the tensor (and its views) live.
    # Private: Python's default for an anonymous map is shared (shmem), which a forked child
    # would share and which transparent huge pages treat differently.
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


def _with_blocks(shape: tuple[int, ...], num_blocks: int) -> tuple[int, ...]:
    return shape[:2] + (num_blocks,) + shape[3:]
