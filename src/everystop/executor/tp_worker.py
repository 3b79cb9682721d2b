"""A tensor-parallel worker process (ranks 1..N-1): load this rank's shard, then run every plan
rank 0 broadcasts, in order, until told to stop.

The worker reports to rank 0 over a one-way pipe: ("hello", pid) before joining the groups, and
("error", text) if anything fails, then exits non-zero. It never samples: its logits gather
feeds rank 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import traceback
from multiprocessing.connection import Connection

from everystop.config import EngineConfig


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    rank: int
    world_size: int
    port: int
    config: EngineConfig  # model path already resolved, device already this rank's
    num_threads: int
    timeout_s: float


def rank_device(device: str, rank: int) -> str:
    """Rank r runs on cuda:r (one GPU per shard); every CPU rank on the CPU."""
    return f"cuda:{rank}" if device.startswith("cuda") else device


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Process entry point (spawned: a fresh interpreter, no state inherited from the engine)."""
    try:
        _serve(spec, conn)
    except BaseException as exc:  # report anything, then die
        with contextlib.suppress(OSError, ValueError):  # rank 0 is gone
            conn.send(("error", f"rank {spec.rank}: {type(exc).__name__}: {exc}",
                       traceback.format_exc()))
        sys.exit(1)
    sys.exit(0)


def _serve(spec: WorkerSpec, conn: Connection) -> None:
    import torch

    from everystop.executor.model_runner import ModelRunner
    from everystop.executor.tp_group import connect, decode_plan, recv_message

    torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.config.model.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    conn.send(("hello", os.getpid()))
    ctx = connect(spec.rank, spec.world_size, None, spec.port, device, spec.timeout_s)
    cfg = spec.config
    runner = ModelRunner(cfg.model, cfg.cache, cfg.scheduler.max_model_len,
                         cfg.scheduler.max_num_batched_tokens, parallel=ctx)
    while True:
        kind, *payload = recv_message(ctx)
        if kind == "stop":
            return
        if kind == "execute":
            runner.execute(decode_plan(payload[0]))
        elif kind == "logits":
            runner.forward_logits(decode_plan(payload[0]).scheduled)
        elif kind == "ping":  # round trip for overhead measurements (payload ignored)
            ctx.all_min(0)
        elif kind == "measure_prefill":
            runner.measure_prefill_tokens_per_s(payload[0])
        else:
            raise RuntimeError(f"unknown message {kind!r} from rank 0")
