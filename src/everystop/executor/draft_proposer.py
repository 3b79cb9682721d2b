"""The draft-model proposer (--speculative draft:PATH): a smaller model with the target's
tokenizer guesses each speculating sequence's next k tokens by decoding greedily.

Greedy drafting makes each proposal a point mass (q(d) = 1), so the scheduler's equality rule
(core/verification.py) is the exact rejection rule and sampled output keeps the target's
distribution.

The draft keeps K/V of its own per context it has seen, in a paged pool as large as the
target's that takes memory only where written::

    entry:   c1 .. cn   d1 .. d(k-1)        (K/V of the context it was asked about, then of
             num_context                     the drafts it fed back; dk is never fed)
    next:    c1 .. cn   d1 .. da  g  ...    (the same sequence a pass later: the accepted
                                             drafts, then the target's token)

A new context reuses the entry whose num_context tokens it starts with (the longest such),
keeps the K/V of their common prefix, and prefills only the rest before its k greedy steps;
a context no entry starts (a new sequence, or one after preemption) is prefilled whole. Entries
are evicted least recently used when the pool runs out of blocks. Each pass is timed into
`pass_cost`, a step-cost fit of the draft's own (seeded by three passes measured at load, each
the fastest of SEED_RUNS after a warm-up, so that neither a first call nor another process's
burst sets it), which the scheduler's sizing rule prices draft passes with. A fit learns only
from the passes the draft runs, and the rule runs none while it sizes every sequence off: so
after REFRESH_INTERVAL scheduler passes with no draft pass (`idle_pass`) one one-token pass is
timed into the fit, and a price taken on a busier host does not keep speculation off for good.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from everystop.config import ConfigError
from everystop.core.outputs import ScheduledSequence
from everystop.core.step_cost import (
    SEED_PROMPT_TOKENS,
    StepCoefficients,
    StepCostModel,
    StepShape,
)
from everystop.executor.dtype_choice import weights_are_blocks
from everystop.executor.inputs import build_inputs
from everystop.executor.kv_pool import KVPool
from everystop.executor.model_runner import ModelRunner, select_backends, shared_model
from everystop.executor.models.decoder import DecoderForCausalLM, KVCache
from everystop.executor.models.errors import ModelLoadError
from everystop.executor.models.loader import resolve_model_path, weight_memory
from everystop.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
SEED_RUNS = 3  # timed runs of each seed pass at load (the fastest counts)
SEED_ROWS = 32  # rows of the seed's decode-shaped pass (a busy batch's size)
REFRESH_INTERVAL = 256  # scheduler passes without a draft pass before one is timed
SUMMARY_INTERVAL_S = 60.0  # how often the passes' predicted and measured time is logged


@dataclass
class _Entry:
    tokens: list[int]  # whose K/V the entry's blocks hold, in order
    num_context: int  # how many of them were the context it was last asked about
    block_ids: list[int] = field(default_factory=list)


@dataclass
class _Job:
    """One sequence of a propose_batch call: what the next forward pass feeds for it."""

    index: int  # in the call's contexts
    k: int
    entry: _Entry
    feed: list[int]  # tokens to run, at positions start_pos..
    start_pos: int


class DraftModelProposer:
    """Proposes by greedy decoding on a draft model, with K/V reused across calls."""

    def __init__(self, model: DecoderForCausalLM, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype, device: torch.device,
                 pass_cost: StepCostModel | None = None) -> None:
        self.model, self.block_size, self.device = model, block_size, device
        # What one of its forward passes costs, fitted to every pass it runs: the scheduler's
        # sizing rule prices a proposal plan's draft passes with it (core/spec_sizing.py).
        self.pass_cost = pass_cost or StepCostModel.from_prefill_rate(1e4)
        args = model.args
        # The target's pool layout, untouched until written (KVPool): a pool as large as the
        # target's costs no memory while the sizing rule keeps the draft off (a busy batch).
        self._pool = KVPool(args.num_layers, model.num_local_kv_heads, args.head_dim,
                            block_size, num_blocks, 0, kv_dtype, device)
        self.kv_caches: list[KVCache] = self._pool.kv_caches
        self.max_len = min(args.max_position_embeddings, num_blocks * block_size)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._next_id = 0
        self._idle_passes = 0  # scheduler passes since the last draft pass
        self._totals = [0.0, 0.0, 0.0]  # passes, predicted and measured seconds since the log
        self._totals_since = time.monotonic()

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """k tokens (fewer near the draft's context limit) the draft decodes greedily after
        `token_ids`."""
        return self.propose_batch([token_ids], [k])[0]

    def propose_batch(self, contexts: Sequence[Sequence[int]], ks: Sequence[int]
                      ) -> list[list[int]]:
        """propose() for several sequences at once: each of the k steps is one forward pass
        over all of them (the first also runs each context's tokens the draft has not seen)."""
        out: list[list[int]] = [[] for _ in contexts]
        jobs: list[_Job] = []
        pinned: set[int] = set()  # entries this batch writes: not reused twice, not evicted
        for i, (context, k) in enumerate(zip(contexts, ks)):
            tokens = list(context)
            n = len(tokens)
            k = min(k, self.max_len - n + 1)
            if k <= 0 or n == 0:
                continue
            key, entry = self._entry_for(tokens, pinned)
            reuse = min(_common_prefix(entry.tokens, tokens), n - 1)
            pinned.add(key)
            if not self._reserve(entry, n + k - 1, pinned):
                pinned.discard(key)
                self._drop(key)
                continue
            entry.tokens, entry.num_context = tokens, n
            jobs.append(_Job(i, k, entry, tokens[reuse:], reuse))
        while jobs:
            for job, token in zip(jobs, self._timed_run(jobs)):
                out[job.index].append(token)
                job.start_pos += len(job.feed)
                job.feed = [token]
            # Those with drafts to go feed their last one back (its K/V joins the entry's);
            # the last draft of each is never fed.
            jobs = [job for job in jobs if len(out[job.index]) < job.k]
            for job in jobs:
                job.entry.tokens.append(job.feed[0])
        return out

    def _timed_run(self, jobs: list[_Job]) -> list[int]:
        """_run, its time folded into pass_cost (the tokens are on the host when it returns)."""
        start = time.perf_counter()
        tokens = self._run(jobs)
        seconds = time.perf_counter() - start
        self._idle_passes = 0
        fed = sum(len(job.feed) for job in jobs)
        context = sum(job.start_pos + len(job.feed) for job in jobs)
        shape = StepShape(fed - len(jobs), len(jobs), context)
        self._log_pass(shape, seconds)
        self.pass_cost.observe(shape, seconds)
        return tokens

    def _log_pass(self, shape: StepShape, seconds: float) -> None:
        """What the sizing rule was told a pass costs against what it took: a debug line per
        pass, an info summary every SUMMARY_INTERVAL_S."""
        predicted = self.pass_cost.predict(shape)
        logger.debug("draft pass: %d rows, %d more tokens, predicted %.4f s, took %.4f s",
                     shape.num_decode_rows, shape.num_prefill_tokens, predicted, seconds)
        totals = self._totals
        totals[0] += 1
        totals[1] += predicted
        totals[2] += seconds
        now = time.monotonic()
        if now - self._totals_since >= SUMMARY_INTERVAL_S:
            logger.info("draft passes: %d, predicted %.2f s, took %.2f s", int(totals[0]),
                        totals[1], totals[2])
            self._totals, self._totals_since = [0.0, 0.0, 0.0], now

    def idle_pass(self) -> None:
        """A scheduler pass ran no draft pass: the REFRESH_INTERVAL-th in a row times one
        one-token pass into pass_cost."""
        self._idle_passes += 1
        if self._idle_passes >= REFRESH_INTERVAL:
            seconds = self.measure_pass_s(1, runs=1, warm_up=False)
            if seconds > 0:
                self.pass_cost.observe(StepShape(0, 1, 1), seconds)
            self._idle_passes = 0

    def measure_pass_s(self, num_tokens: int, runs: int = SEED_RUNS,
                       warm_up: bool = True, num_rows: int = 1) -> float:
        """Seconds of one pass over `num_rows` sequences of `num_tokens` tokens each (a prompt,
        or with many rows of one token a decode pass): the fastest of `runs` (after a warm-up
        run), on blocks given back afterwards (0 when the pool cannot hold them)."""
        jobs: list[_Job] = []
        for i in range(num_rows):
            entry = _Entry([], 0)
            if not self._reserve(entry, num_tokens, set()):
                for job in jobs:
                    self._free.extend(job.entry.block_ids)
                self._free.extend(entry.block_ids)
                return 0.0
            jobs.append(_Job(i, 1, entry, [1] * num_tokens, 0))
        if warm_up:
            self._run(jobs)
        seconds = float("inf")
        for _ in range(runs):
            start = time.perf_counter()
            self._run(jobs)
            seconds = min(seconds, time.perf_counter() - start)
        for job in jobs:
            self._free.extend(job.entry.block_ids)
        return seconds

    def measure_pass_cost(self) -> StepCostModel:
        """A pass_cost seeded by three measured passes: one token (the fixed cost a draft step
        mostly is), one prompt of SEED_PROMPT_TOKENS tokens (the cost per prompt token beyond
        it) and SEED_ROWS one-token rows (the cost per row beyond the first: a decode row
        takes other kernels than a prompt token: 2-4x its time on the default model's Q4_1);
        a context token at 1/1000 of a prompt token, as the target's prior has it. Where the
        pool cannot hold the rows, a row is priced as a prompt token."""
        one, many = self.measure_pass_s(1), self.measure_pass_s(SEED_PROMPT_TOKENS)
        per_token = max(many - one, 0.0) / (SEED_PROMPT_TOKENS - 1)
        rows = self.measure_pass_s(1, num_rows=SEED_ROWS)
        per_row = max(rows - one, 0.0) / (SEED_ROWS - 1) if rows > 0 else per_token
        return StepCostModel(StepCoefficients(max(one - per_row, 0.0), per_token, per_row,
                                              per_token / 1000))

    @torch.inference_mode()
    def _run(self, jobs: list[_Job]) -> list[int]:
        """Write K/V for each job's feed at its start_pos.. and return the greedy token after
        each."""
        seqs = [ScheduledSequence(request_id=f"draft{j}", token_ids=job.feed,
                                  start_pos=job.start_pos, block_ids=job.entry.block_ids,
                                  sample=True, sampling_params=_GREEDY)
                for j, job in enumerate(jobs)]
        inputs = build_inputs(seqs, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                            inputs.sample_indices)
        logits = self.model.compute_logits(hidden)
        assert logits is not None  # one process: it always has the LM head
        return [int(t) for t in logits.argmax(dim=-1).tolist()]

    # -- the entries ----------------------------------------------------------------------------
    def _entry_for(self, tokens: list[int], pinned: set[int]) -> tuple[int, _Entry]:
        """The entry whose context `tokens` extends (the longest, not pinned), or a new empty
        one."""
        best: tuple[int, _Entry] | None = None
        for key, entry in self._entries.items():
            m = entry.num_context
            if key not in pinned and m <= len(tokens) and (
                    best is None or m > best[1].num_context) and entry.tokens[:m] == tokens[:m]:
                best = (key, entry)
        if best is None:
            best = (self._next_id, _Entry([], 0))
            self._next_id += 1
            self._entries[best[0]] = best[1]
        self._entries.move_to_end(best[0])
        return best

    def _reserve(self, entry: _Entry, num_tokens: int, pinned: set[int]) -> bool:
        """Give the entry blocks for num_tokens positions, evicting the least recently used
        entries not pinned as needed; False when the pool cannot hold them."""
        need = -(-num_tokens // self.block_size) - len(entry.block_ids)
        while need > len(self._free):
            victim = next((other for other in self._entries if other not in pinned), None)
            if victim is None:
                return False
            self._drop(victim)
        for _ in range(max(need, 0)):
            entry.block_ids.append(self._free.pop())
        return True

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._free.extend(entry.block_ids)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (a binary search over C-speed slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def draft_proposer_for(runner: ModelRunner, path: str) -> DraftModelProposer:
    """The draft model at `path` loaded as the target's runner runs (dtype, device, kernels,
    KV element type and block size), with a KV pool of as many tokens as the target's.
    ConfigError when it has more parameters than the target (the engine checks the
    tokenizers first)."""
    cfg = runner.model_config
    device = torch.device(cfg.device)
    try:
        path = resolve_model_path(path)
        # Kernels chosen for the draft's own weights: a block-weight draft of a 16-bit target
        # takes the integer-dot GEMV its format runs fastest on (ModelConfig.int8_decode_dot).
        draft_cfg = dataclasses.replace(cfg, model=path)
        backends = select_backends(draft_cfg, weights_are_blocks(path, "auto"),
                                   log=False)
        model = shared_model(path, cfg.dtype, cfg.device, backends)  # one copy for itself
    except ModelLoadError as exc:
        raise ConfigError(f"speculative: the draft model: {exc}") from None
    _, params = weight_memory(model)
    if params > runner.num_params:
        raise ConfigError(f"speculative: the draft model has more parameters than the target "
                          f"({params:,} > {runner.num_params:,}): {path}")
    kernels = backends.kernels
    logger.info("draft model %s: %.1fM parameters, KV pool of %d blocks, int8 activations %s",
                path, params / 1e6, runner.num_gpu_blocks,
                "on" if kernels is not None and kernels.int8_decode_dot else "off")
    proposer = DraftModelProposer(model, runner.num_gpu_blocks, runner.block_size,
                                  runner.kv_dtype, device)
    proposer.pass_cost = proposer.measure_pass_cost()
    return proposer
