"""A model-free executor that checks the KV cache is used correctly.

It keeps a fake KV pool holding, per slot, the token and position written there. Each step it
writes the scheduled tokens through the block table, then "attends": it reads back the whole
context through the block table and checks it is exactly the sequence's tokens. The next token is
a deterministic function of that context, so a wrong block table, a bad prefix-cache hit or a
broken swap shows up as a different output from the request run alone.

With a sliding window W it is a windowed model: a query at position p reads only positions
p-W+1 .. p (so the blocks before those may be released and reused by others), and the next
token sees the positions outside the last query's window as MASKED.

A speculating row (num_draft_tokens = k) gets the model's token after each of its last 1+k
positions, each from the context up to that position (`verify=False`: an executor that does
not verify, the last position's token only).

A seeded request with temperature > 0 is "sampled": its token at output index i is a known
function of the context, the seed and i (`sampled_token`), so a wrong output index (e.g. of a
speculating row's later positions, or after a preemption) changes its output.
"""

from __future__ import annotations

from collections.abc import Callable

from everystop.core.outputs import ModelOutput, ScheduledSequence, SchedulerOutput
from everystop.core.step_cost import StepShape
from everystop.executor.verify_rows import per_position_rows

MASKED = -1  # what a windowed model's next token sees for a position outside its window


def sampled_token(context: list[int], seed: int, output_index: int) -> int:
    """A seeded sampled request's token: the greedy one, except at about a third of the
    output indices (chosen by the seed), where it draws another."""
    greedy = next_token(context)
    draw = hash((seed, output_index)) % 1_000_003
    return greedy if draw % 3 else 3 + (greedy * 7 + draw) % 997


def model_token(context: list[int], seq: ScheduledSequence) -> int:
    params = seq.sampling_params
    if params.seed is None or params.greedy:
        return next_token(context)
    return sampled_token(context, params.seed, seq.output_index)


class KVCorruption(AssertionError):
    pass


def next_token(context: list[int], vocab: int = 1000) -> int:
    h = 0
    for t in context[-8:]:
        h = (h * 131 + t) % 1_000_003
    return 3 + (h + len(context)) % (vocab - 3)


class ToyExecutor:
    def __init__(self, num_gpu_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 cost_fn: Callable[[StepShape], float] | None = None,
                 sliding_window: int | None = None, verify: bool = True) -> None:
        # With cost_fn, each pass reports that many seconds as its execute time (a machine
        # whose step cost is known exactly).
        self.cost_fn = cost_fn
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.gpu: list[list[tuple[int, int] | None]] = [[None] * block_size
                                                         for _ in range(num_gpu_blocks)]
        self.cpu: list[list[tuple[int, int] | None]] = [[None] * block_size
                                                         for _ in range(num_cpu_blocks)]
        self.num_steps = 0
        self.verify = verify

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        self.num_steps += 1
        for dev, host in sched.blocks_to_swap_out:
            self.cpu[host] = list(self.gpu[dev])
        for host, dev in sched.blocks_to_swap_in:
            self.gpu[dev] = list(self.cpu[host])
        bs = self.block_size
        for e in sched.scheduled:  # every layer writes all new K/V before attention reads
            if e.padding:
                continue  # compute only: a padding row must leave the cache as it was
            for i, tok in enumerate(e.token_ids):
                pos = e.start_pos + i
                self.gpu[e.block_ids[pos // bs]][pos % bs] = (tok, pos)
        out = ModelOutput()
        if self.cost_fn is not None:
            out.execute_time_s = self.cost_fn(StepShape.from_output(sched))
        window = self.sliding_window
        for e in sched.scheduled:
            # The positions this row's queries read: its first query's window onwards.
            first = 0 if window is None else max(0, e.start_pos - window + 1)
            context = [MASKED] * first
            for pos in range(first, e.seq_len):
                cell = self.gpu[e.block_ids[pos // bs]][pos % bs]
                if cell is None or cell[1] != pos:
                    raise KVCorruption(f"{e.request_id}: slot for position {pos} holds {cell}")
                context.append(cell[0])
            if e.sample:
                out.sampled_token_ids[e.request_id] = model_token(masked(context, window), e)
            if e.num_draft_tokens and self.verify:
                first = e.seq_len - 1 - e.num_draft_tokens
                rows = per_position_rows([e] * (e.num_draft_tokens + 1))
                out.verified_token_ids[e.request_id] = [
                    model_token(masked(context[:first + j + 1], window), row)
                    for j, row in enumerate(rows)]
        return out


def masked(context: list[int], window: int | None) -> list[int]:
    """The context as the last query sees it: MASKED outside its window."""
    if window is None or len(context) <= window:
        return context
    return [MASKED] * (len(context) - window) + context[-window:]


def reference_output(prompt: list[int], max_tokens: int,
                     sliding_window: int | None = None, seed: int | None = None) -> list[int]:
    """What the toy model generates for a prompt run alone (ignore_eos; `seed`: sampled)."""
    ctx = list(prompt)
    out = []
    for i in range(max_tokens):
        view = masked(ctx, sliding_window)
        t = next_token(view) if seed is None else sampled_token(view, seed, i)
        out.append(t)
        ctx.append(t)
    return out
