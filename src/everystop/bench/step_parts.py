"""Where one single-stream decode step goes on the serving path, in microseconds per part.

One request alone runs through the server's engine (`AsyncEngine`: the engine thread, its
lock, the hand-off to an asyncio consumer), and the consumer turns each output into the SSE
frame the server would send (completion chunk, `sse()`). Every part is timed with
perf_counter by wrapping it for this measurement only, exclusive of the parts inside it:

    engine thread, one period (one token, from one step's start to the next's):
      scheduler        schedule() + update_from_output()
      input_build      build_inputs()
      forward_kernels  the decoder-stack op (every layer; or the layers' ops without it)
      forward_python   the rest of model.forward (embedding, rope tables, glue)
      lm_head          compute_logits (the LM head kernel)
      sampler          the sampler
      execute_other    the rest of execute() (swaps, checks, the ModelOutput)
      output_processing  OutputProcessor.process, less detokenize
      detokenize       the incremental detokenizer
      step_other       the rest of LLMEngine.step (lock, listeners, bookkeeping)
      deliver          handing the output to the event loop (call_soon_threadsafe)
      engine_loop      the rest of the period (has_work under the lock, the loop itself)
    event-loop thread (overlaps the next step; its GIL time delays the engine thread):
      handoff          step() returned -> the consumer holding the output (thread wake-up)
      sse              formatting the chunk and the SSE frame

The parts are medians over the measured steps (the first `warmup` decode steps dropped: a
loaded machine's outliers would swamp means; medians need not sum to the median period); the
period is the engine thread's; TPOT is what the consumer saw between two outputs.

It runs in a process of its own (`python -m everystop.bench.step_parts`): a process whose main
thread has already run torch work keeps a second OpenMP pool, and the engine thread's regions
then pay futex wake-ups (see AsyncEngine) that the server does not.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

ENGINE_PARTS = ("scheduler", "input_build", "forward_kernels", "forward_python", "lm_head",
                "sampler", "execute_other", "output_processing", "detokenize", "step_other",
                "deliver", "engine_loop")
KERNEL_PARTS = ("forward_kernels", "lm_head")


class PartClock:
    """Exclusive wall time per named part on one thread: a part's time excludes the parts
    that run inside it. `now`: the clock (perf_counter; tests give their own)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now
        self.totals: dict[str, float] = defaultdict(float)
        self._inner: list[float] = []  # per open part: the time its inner parts took

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self.now()
            self._inner.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                took = self.now() - start
                self.totals[part] += took - self._inner.pop()
                if self._inner:
                    self._inner[-1] += took
        return timed

    def take(self) -> dict[str, float]:
        """The totals since the last take, and a fresh start."""
        out, self.totals = dict(self.totals), defaultdict(float)
        return out


class _Patches:
    """Attributes replaced for the measurement, put back by `undo`."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name, _ABSENT)
                            if hasattr(owner, "__dict__") else getattr(owner, name)))
        _force_set(owner, name, value)

    def undo(self) -> None:
        for owner, name, old in reversed(self._saved):
            if old is _ABSENT:
                (delattr if isinstance(owner, type) else object.__delattr__)(owner, name)
            else:
                _force_set(owner, name, old)
        self._saved.clear()


_ABSENT = object()


def _force_set(owner: Any, name: str, value: Any) -> None:
    """setattr, past a frozen dataclass's guard as well (the CPU kernels' object is one)."""
    if isinstance(owner, type):
        setattr(owner, name, value)
    else:
        object.__setattr__(owner, name, value)


def _instrument(engine: Any, clock: PartClock, patches: _Patches) -> None:
    """Wrap the engine's parts: attributes of this engine's objects, and (process-wide until
    undone) the module function build_inputs and the detokenizer class's methods."""
    from everystop.executor import model_runner as mr
    from everystop.tokenizer import IncrementalDetokenizer

    runner = engine.executor.runner
    model = runner.model
    kernels = model.backends.kernels
    wraps: list[tuple[Any, str, str]] = [
        (engine.scheduler, "schedule", "scheduler"),
        (engine.scheduler, "update_from_output", "scheduler"),
        (mr, "build_inputs", "input_build"), (model, "forward", "forward_python"),
        (model, "compute_logits", "lm_head"), (runner, "sampler", "sampler"),
        (runner, "execute", "execute_other"), (engine.outputs, "process", "output_processing"),
        (IncrementalDetokenizer, "push", "detokenize"),
        (IncrementalDetokenizer, "flush", "detokenize")]
    if kernels is not None:
        wraps.append((kernels, "decoder_stack", "forward_kernels"))
    for owner, name, part in wraps:
        patches.set(owner, name, clock.wrap(part, getattr(owner, name)))


def measure(build_engine: Callable[[], Any], prompt_ids: list[int], *, decode_steps: int = 64,
            warmup: int = 8) -> dict[str, Any]:
    """Serve one greedy request of `decode_steps` tokens through an AsyncEngine built on its
    own thread by `build_engine` (an LLMEngine); per-part microseconds per decode step."""
    from everystop.engine.async_engine import AsyncEngine
    from everystop.sampling_params import SamplingParams
    from everystop.server.formatting import CompletionFormat
    from everystop.server.streaming import sse

    clock = PartClock()
    patches = _Patches()
    aengine = AsyncEngine(build_engine, stall_timeout_s=None)
    engine = aengine.engine
    _instrument(engine, clock, patches)
    # One period per step, from one step's start to the next's: its parts are read there.
    periods: list[dict[str, float]] = []
    returned_at: dict[int, float] = {}
    last_start = [0.0]
    timed_step = clock.wrap("step_other", engine.step)

    def step(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        parts = clock.take()
        if last_start[0]:
            parts["period"] = start - last_start[0]
            parts["engine_loop"] = parts["period"] - sum(
                v for k, v in parts.items() if k != "period")
            periods.append(parts)
        last_start[0] = start
        outputs = timed_step(*args, **kwargs)
        done = time.perf_counter()
        for out in outputs:  # the engine thread hands them over next
            returned_at[len(out.token_ids)] = done
        return outputs
    patches.set(engine, "step", step)

    async def consume() -> list[dict[str, float]]:
        loop = asyncio.get_running_loop()
        patches.set(loop, "call_soon_threadsafe",
                    clock.wrap("deliver", loop.call_soon_threadsafe))
        # The last step closes no period: one token more.
        params = SamplingParams(max_tokens=decode_steps + warmup + 2, temperature=0.0,
                                ignore_eos=True)
        fmt = CompletionFormat("profile", aengine.tokenizer)
        seen = []
        async for out in aengine.generate(list(prompt_ids), params):
            got = time.perf_counter()
            # As the server frames it: a text-only token from the template, others built.
            frame = None if out.finished else fmt.text_frame(0, out.new_text)
            if frame is None:
                choice = fmt.chunk_choice(0, out.new_text, None, out.finish_reason, first=False)
                frame = sse(fmt.body([choice], None, chunk=True))
            seen.append({"arrived": got, "sse": time.perf_counter() - got, "bytes": len(frame),
                         "handoff": got - returned_at.get(len(out.token_ids), got)})
        return seen

    try:
        seen = asyncio.run(consume())
    finally:
        aengine.shutdown()
        patches.undo()
    return summarize(periods, seen, warmup)


def summarize(periods: list[dict[str, float]], seen: list[dict[str, float]],
              warmup: int) -> dict[str, Any]:
    """Medians in microseconds over the decode steps after the warm-up (the first output is
    the prefill's)."""
    steps = periods[1 + warmup:]
    outs = seen[1 + warmup:]
    us = 1e6

    def median(rows: list[dict[str, float]], key: str) -> float:
        return round(us * statistics.median(r.get(key, 0.0) for r in rows), 1) if rows else 0.0

    engine = {p: median(steps, p) for p in ENGINE_PARTS}
    consumer = {p: median(outs, p) for p in ("handoff", "sse")}
    gaps = [b["arrived"] - a["arrived"] for a, b in zip(outs, outs[1:])]
    period = round(us * statistics.fmean(s["period"] for s in steps), 1) if steps else 0.0
    kernels = sum(engine[p] for p in KERNEL_PARTS)
    return {"decode_steps": len(steps), "engine_thread_us": engine,
            "event_loop_us": consumer, "period_us_mean": period,
            "period_us_median": round(us * statistics.median(s["period"] for s in steps), 1)
            if steps else 0.0,
            "tpot_us_median": round(us * statistics.median(gaps), 1) if gaps else 0.0,
            "kernels_us": round(kernels, 1),
            "everything_else_us": round(sum(engine.values()) - kernels, 1),
            "kernels_share": round(kernels / sum(engine.values()), 4) if steps else 0.0,
            "note": "engine_thread parts make up the period (medians: they need not sum to it "
                    "exactly); event_loop parts overlap the next step (their GIL time slows the "
                    "engine thread's Python)"}


def measure_in_subprocess(options: dict[str, Any], prompt_ids: list[int],
                          decode_steps: int) -> dict[str, Any]:
    """`measure` in a fresh process (see the module's note on OpenMP pools)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "everystop.bench.step_parts",
                           json.dumps(options), json.dumps(prompt_ids), str(decode_steps)],
                          check=True, stdout=subprocess.PIPE)
    result: dict[str, Any] = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    return result


def engine_builder(options: dict[str, Any]) -> Callable[[], Any]:
    """An LLMEngine from LLM options, built where it is called (the engine thread)."""
    def build() -> Any:
        from everystop import LLM
        return LLM(**options).engine
    return build



if __name__ == "__main__":
    import sys

    _options, _prompt, _steps = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(measure(engine_builder(_options), _prompt, decode_steps=_steps)))
