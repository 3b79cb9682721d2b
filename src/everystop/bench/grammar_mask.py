"""Per-step cost of structured-output token masks at 128 running sequences: xgrammar vs
llguidance, on the default model's tokenizer (49,152 tokens).

    everystop bench grammar-mask [--seqs 128] [--rounds 2]
        [--out benchmarks/results/grammar_mask.json]

Each of the --seqs sequences has its own matcher for one JSON schema (objects, an enum, an
array, nesting) and walks the tokens of its own valid document; every step fills the whole
[seqs, vocab] bitmask (each engine's batched/parallel call, and a plain per-matcher loop), then
advances every matcher by one token. Both engines run in one process, alternating rounds (the
machine is shared: compare ratios within a run). A token a matcher refuses is an error, so a
fast engine cannot be fast by being wrong.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from typing import Any

from everystop.results import write_result
from everystop.stats import percentile

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "colour", "tags", "address"],
}
WORDS = ["alpha", "bravo", "Paris", "kilo", "tango", "zulu", "x-ray", "delta"]


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [json.dumps({"name": rng.choice(WORDS), "age": rng.randrange(100),
                        "colour": rng.choice(["red", "green", "blue"]),
                        "tags": rng.sample(WORDS, rng.randrange(4)),
                        "address": {"city": rng.choice(WORDS), "zip": str(rng.randrange(99999))}})
            for _ in range(n)]


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tok: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info)
        self.vocab_size = vocab_size

    def compile(self) -> Any:
        return self.compiler.compile_json_schema(json.dumps(SCHEMA))

    def matchers(self, grammar: Any, n: int) -> list[Any]:
        return [self.xgr.GrammarMatcher(grammar) for _ in range(n)]

    def bitmask(self, n: int) -> Any:
        return self.xgr.allocate_token_bitmask(n, self.vocab_size)

    def fill_batched(self, ms: list[Any], mask: Any) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, mask)

    def fill_loop(self, ms: list[Any], mask: Any) -> None:
        for i, m in enumerate(ms):
            m.fill_next_token_bitmask(mask, i)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))

    def setup_batch(self, threads: int) -> None:
        self.batch = self.xgr.BatchGrammarMatcher(threads)


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tok: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.lt = llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def compile(self) -> Any:
        return self.llg.LLMatcher.grammar_from_json_schema(SCHEMA)

    def matchers(self, grammar: Any, n: int) -> list[Any]:
        return [self.llg.LLMatcher(self.tok, grammar) for _ in range(n)]

    def bitmask(self, n: int) -> Any:
        return self.lt.allocate_token_bitmask(n, self.vocab_size)

    def fill_batched(self, ms: list[Any], mask: Any) -> None:
        self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)],
                                            mask)

    def fill_loop(self, ms: list[Any], mask: Any) -> None:
        for i, m in enumerate(ms):
            self.lt.fill_next_token_bitmask(m, mask, i)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token)) and not m.is_error()

    def setup_batch(self, threads: int) -> None:
        self.executor = self.llg.LLExecutor(num_threads=threads)


def time_masks(engine: Any, docs_ids: list[list[int]], eos: int,
               batched: bool) -> dict[str, Any]:
    """One pass of every document through its own matcher: mask time per step, per 128 rows."""
    t0 = time.perf_counter()
    grammar = engine.compile()
    compile_s = time.perf_counter() - t0
    ms = engine.matchers(grammar, len(docs_ids))
    mask = engine.bitmask(len(docs_ids))
    steps = max(map(len, docs_ids))
    times = []
    for step in range(steps):
        live = [(m, ids) for m, ids in zip(ms, docs_ids) if step < len(ids)]
        t = time.perf_counter()
        (engine.fill_batched if batched else engine.fill_loop)([m for m, _ in live], mask)
        times.append((time.perf_counter() - t) / len(live) * len(docs_ids))  # per 128 rows
        for i, (m, ids) in enumerate(live):
            allowed = (int(mask[i, ids[step] // 32]) >> (ids[step] % 32)) & 1
            if not allowed or not engine.accept(m, ids[step]):
                raise RuntimeError(f"{engine.name} refused token {ids[step]} at step {step}")
    # Every document is complete: EOS must now be allowed.
    (engine.fill_batched if batched else engine.fill_loop)(ms, mask)
    assert all((int(mask[i, eos // 32]) >> (eos % 32)) & 1 for i in range(len(ms)))
    times.sort()
    return {"compile_ms": compile_s * 1e3, "steps": steps,
            "mask_ms_per_step_median": statistics.median(times) * 1e3,
            "mask_ms_per_step_p90": percentile(times, 90, empty=math.nan) * 1e3,
            "mask_us_per_row_median": statistics.median(times) * 1e6 / len(docs_ids)}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")


def run(args: argparse.Namespace) -> int:
    from everystop.tokenizer import load_tokenizer

    tok = load_tokenizer()
    hf = tok._tok
    vocab = tok.vocab_size
    docs_ids = [tok.encode(d) for d in documents(args.seqs)]
    engines = [XGrammar(hf, vocab), LLGuidance(hf, vocab)]
    for e in engines:
        e.setup_batch(args.threads)
    results: dict[str, list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for e in engines if r % 2 == 0 else engines[::-1]:
            for batched in (True, False):
                key = f"{e.name}/{'batched' if batched else 'loop'}"
                results.setdefault(key, []).append(time_masks(e, docs_ids, tok.eos_token_id,
                                                               batched))
    write_result({"bench": "grammar_mask", "seqs": args.seqs, "vocab": vocab,
                  "threads": args.threads,
          "mean_doc_tokens": statistics.mean(map(len, docs_ids)),
          "load_avg": os.getloadavg(), "results": results}, args.out)
    return 0
