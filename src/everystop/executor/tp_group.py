"""Process groups for tensor parallelism, and the control channel that carries each step's plan
from rank 0 to the workers.

Rank 0 (the engine process) hosts a TCPStore on a free port; every rank builds its groups over
it. Groups are torch.distributed ProcessGroup objects constructed directly, not torch's global
default group, so one process can build, lose and rebuild them (tests, a failed start):

    data group  NCCL on CUDA, gloo on CPU   all-reduces and the logits gather of the forward pass
    cpu group   gloo                        plans (pickled bytes) and host-side values

On CPU the two are the same gloo group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from everystop.core.outputs import ScheduledSequence, SchedulerOutput
from everystop.executor.layers.parallel import ParallelContext

HOST = "127.0.0.1"
# Workers wait this long for the next plan: an idle server may send none for hours.
IDLE_TIMEOUT = timedelta(days=365)
# The wire format is every field of both dataclasses, in declaration order: a field added to
# either travels without an edit here (a hand-picked subset once dropped `padding`).
_SEQ_FIELDS = tuple(f.name for f in dataclasses.fields(ScheduledSequence))
_OUT_FIELDS = tuple(f.name for f in dataclasses.fields(SchedulerOutput) if f.name != "scheduled")


def create_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store, hosted by rank 0 on a port the OS picks (no port races)."""
    return dist.TCPStore(HOST, 0, world_size, True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def connect(rank: int, world_size: int, store: Any, port: int, device: torch.device,
            timeout_s: float) -> ParallelContext:
    """Join the groups as `rank` (rank 0 passes its store; workers pass None and the port)."""
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(HOST, port, world_size, False, timeout=timeout)
    cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size,
                                      timeout)
    group = cpu_group
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, world_size, opts)
    ctx = ParallelContext(rank, world_size, group, cpu_group)
    ctx.all_min(0)  # NOTE: a first collective, so every rank is known to be connected
    return ctx


def abort(ctx: ParallelContext) -> None:
    """Best effort: make collectives blocked on a dead peer return (NCCL cannot see a peer
    die; gloo already fails on the closed socket)."""
    for group in {id(ctx.group): ctx.group, id(ctx.cpu_group): ctx.cpu_group}.values():
        # already broken or not supported: nothing to save
        with contextlib.suppress(Exception):
            group.abort()


# --- the control channel -------------------------------------------------------------------

def send_message(ctx: ParallelContext, message: tuple[Any, ...]) -> int:
    """Rank 0: broadcast a message (pickled) to every worker; returns its size in bytes."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    _broadcast(ctx, torch.tensor([len(data)], dtype=torch.int64))
    _broadcast(ctx, torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return len(data)


def recv_message(ctx: ParallelContext) -> tuple[Any, ...]:
    """Workers: wait (as long as it takes) for rank 0's next message."""
    size = torch.zeros(1, dtype=torch.int64)
    _broadcast(ctx, size, IDLE_TIMEOUT)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    _broadcast(ctx, data)
    return pickle.loads(data.numpy().tobytes())


def _broadcast(ctx: ParallelContext, t: torch.Tensor, timeout: timedelta | None = None) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    if timeout is not None:
        opts.timeout = timeout
    ctx.cpu_group.broadcast([t], opts).wait()


def encode_plan(sched: SchedulerOutput) -> tuple[Any, ...]:
    """A step's SchedulerOutput, whole, as plain tuples (smaller pickles than the objects)."""
    rows = [tuple(getattr(s, name) for name in _SEQ_FIELDS) for s in sched.scheduled]
    return rows, tuple(getattr(sched, name) for name in _OUT_FIELDS)


def decode_plan(plan: tuple[Any, ...]) -> SchedulerOutput:
    rows, rest = plan
    return SchedulerOutput(scheduled=[ScheduledSequence(*row) for row in rows],
                           **dict(zip(_OUT_FIELDS, rest)))
