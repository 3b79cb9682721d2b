"""Fault isolation on a real model: a tiny random-weight Llama, sixteen requests in one pass,
one of which makes every pass it is in raise after the model has run (its K/V written). Only
that request fails, and every other greedy output equals the request run alone."""

from __future__ import annotations

import pytest

from everystop import LLM, SamplingParams
from everystop.core.outputs import ModelOutput, SchedulerOutput
from everystop.executor.models.loader import default_model_path
from tests.engine.toy_engine import run_all
from tests.tiny_llama import tiny_llama_dir

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
OPTIONS = dict(tokenizer=default_model_path(), kv_cache_memory=16 << 20, swap_space_gib=0.01,
               max_model_len=256, max_num_batched_tokens=512, chunk_size=512,
               kv_cache_dtype="float32", enable_prefix_caching=False)
# 16 prompts of 3..33 token ids inside the tiny vocabulary (250): 288 tokens, one pass.
PROMPTS = [[(11 * i + 7 * j) % 250 for j in range(3 + 2 * i)] for i in range(16)]
CULPRIT = 5


class RaisesFor:
    """The engine's executor, except that a pass holding `culprit`'s row raises after the
    model has run it (a fault in the step's own bookkeeping, say)."""

    def __init__(self, inner: object, culprit: str) -> None:
        self.inner, self.culprit = inner, culprit
        self.pass_sizes: list[int] = []

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        self.pass_sizes.append(len(sched.scheduled))
        out = self.inner.execute(sched)  # type: ignore[attr-defined]
        if any(e.request_id == self.culprit for e in sched.scheduled):
            raise IndexError("index 1000000 is out of bounds (injected)")
        return out

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_llama_dir(tmp_path_factory, "tiny_fault_isolation", kv_heads=2)


def test_one_raising_request_among_16_fails_alone_and_the_rest_match_solo(tiny: str) -> None:
    solo_llm = LLM(tiny, max_num_seqs=1, **OPTIONS)
    solo = [o.token_ids for o in solo_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    solo_llm.engine.shutdown()

    llm = LLM(tiny, max_num_seqs=16, **OPTIONS)
    engine = llm.engine
    faulty = RaisesFor(engine.executor, f"r{CULPRIT}")
    engine.executor = faulty  # type: ignore[assignment]
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, GREEDY, request_id=f"r{i}")
    final = run_all(engine)
    engine.shutdown()

    assert faulty.pass_sizes[0] == 16  # all sixteen shared the pass that raised
    culprit = final.pop(f"r{CULPRIT}")
    assert culprit.finish_reason == "error" and "IndexError" in (culprit.error or "")
    assert all(out.finish_reason == "length" for out in final.values())
    assert {rid: out.token_ids for rid, out in final.items()} == {
        f"r{i}": solo[i] for i in range(16) if i != CULPRIT}
    assert engine.stats().num_used_blocks == 0
