"""Who this process is in a tensor-parallel group, and the three collectives the sharded model
needs (all-reduce, gather to rank 0, a min over ranks). Passed explicitly to every sharded layer.

With world_size 1 every collective is a no-op, so the single-process model runs the same code.
The group is a torch.distributed ProcessGroup used directly (`group.allreduce([t]).wait()`), not
registered as torch's default group: an engine can build, lose and rebuild groups in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch ProcessGroup over all ranks (gloo or NCCL); None when alone
    # A gloo group over the same ranks for host-side values (the same object on CPU).
    cpu_group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")
        if self.world_size > 1 and (self.group is None or self.cpu_group is None):
            raise ValueError("a tensor-parallel context needs its process groups")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks, in place; returns it."""
        if self.world_size > 1:
            self.group.allreduce([x]).wait()
        return x

    def all_min(self, value: int) -> int:
        """The smallest `value` any rank holds (agreeing on pool sizes)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.cpu_group.allreduce([t], opts).wait()
        return int(t.item())

    def gather_last_dim(self, x: torch.Tensor, full_size: int) -> torch.Tensor | None:
        """Concatenate every rank's slice of the last dimension on rank 0 (None elsewhere).

        Slices follow `shard_range(full_size, world_size, rank)`; they may differ by one in width,
        so each is padded to the widest before the gather and trimmed after.
        """
        if self.world_size == 1:
            return x
        width = -(-full_size // self.world_size)
        padded = F.pad(x, (0, width - x.shape[-1])).contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank != 0:
            self.group.gather([], [padded], opts).wait()
            return None
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        self.group.gather([parts], [padded], opts).wait()
        return torch.cat([p[..., :shard_range(full_size, self.world_size, r)[1]]
                          for r, p in enumerate(parts)], dim=-1)


SINGLE = ParallelContext()


def shard_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """(start, size) of `rank`'s contiguous share of `n` items; sizes differ by at most one,
    the larger shares going to the lower ranks."""
    base, extra = divmod(n, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


@dataclass(frozen=True)
class HeadShard:
    """This rank's query heads and KV heads (global indices)."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def shard_heads(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadShard:
    """Split attention heads so that each rank's query heads share KV heads it holds.

    Whole GQA groups (one KV head and its query heads) go to ranks as evenly as possible
    (uneven when the group count is not a multiple of the ranks, e.g. 3 KV heads on 2 ranks:
    2 + 1). With fewer KV heads than ranks, each KV head is replicated on world/kv ranks that
    split its query heads between them.
    """
    group = num_heads // num_kv_heads
    if num_kv_heads >= world_size:
        kv_start, num_kv = shard_range(num_kv_heads, world_size, rank)
        return HeadShard(kv_start * group, num_kv * group, kv_start, num_kv)
    if world_size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over "
                         f"{world_size} ranks (needs a multiple of {num_kv_heads} ranks)")
    ranks_per_kv = world_size // num_kv_heads
    if group < ranks_per_kv:
        raise ValueError(f"{num_heads} attention heads cannot be split over {world_size} ranks")
    kv = rank // ranks_per_kv
    q_start, num_q = shard_range(group, ranks_per_kv, rank % ranks_per_kv)
    return HeadShard(kv * group + q_start, num_q, kv, 1)
