"""The draft-model proposer's K/V reuse: whatever contexts it is asked about, in any order (a
sequence growing by accepted proposals, one whose proposals were rejected, new sequences
sharing a prefix, more than its pool holds), its proposals are transformers' own greedy
continuation of the context, computed from scratch."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from everystop.core.step_cost import StepShape
from everystop.executor.draft_proposer import REFRESH_INTERVAL, DraftModelProposer
from everystop.executor.models.loader import load_model

from ..models.family_builders import SPECS, hf_model, save_hf

BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    spec = SPECS["qwen2"]
    return str(save_hf(spec, hf_model(spec), tmp_path_factory.mktemp("draft") / "qwen2"))


@pytest.fixture(scope="module")
def reference(tiny: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32)
    model.eval()

    @torch.no_grad()
    def greedy(context: list[int], k: int) -> list[int]:
        ids = list(context)
        for _ in range(k):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
        return ids[len(context):]
    return greedy


def _proposer(path: str, num_blocks: int) -> DraftModelProposer:
    model = load_model(path, "float32", "cpu")
    return DraftModelProposer(model, num_blocks, BLOCK, torch.float32, torch.device("cpu"))


def test_proposals_are_the_greedy_continuation_whatever_the_order(tiny: str, reference) -> None:
    rng = random.Random(3)
    # A pool of 12 blocks (48 tokens): three sequences of up to ~30 tokens do not fit at once,
    # so entries are evicted and recomputed along the way.
    proposer = _proposer(tiny, num_blocks=12)
    evicted: list[int] = []
    drop = proposer._drop
    proposer._drop = lambda key: (evicted.append(key), drop(key))[1]  # type: ignore[method-assign]
    shared = [rng.randrange(256) for _ in range(6)]
    seqs = {name: shared + [rng.randrange(256) for _ in range(rng.randint(1, 5))]
            for name in "abc"}
    for step in range(16):
        name = rng.choice("abc")
        context, k = seqs[name], rng.randint(1, 4)
        proposals = proposer.propose(context, k)
        assert proposals == reference(context, k), (step, name)
        # The target keeps some proposals (a real one, or a token the draft did not guess).
        kept = rng.randint(0, k)
        seqs[name] = context + proposals[:kept] + [rng.randrange(256)]
    assert evicted  # the pool ran out on the way
    for entry in proposer._entries.values():  # every block is one entry's, or free
        assert len(entry.tokens) <= len(entry.block_ids) * BLOCK
    held = [b for e in proposer._entries.values() for b in e.block_ids]
    assert sorted(held + proposer._free) == list(range(12))


def test_proposals_stop_at_what_the_pool_holds(tiny: str, reference) -> None:
    proposer = _proposer(tiny, num_blocks=3)  # 12 positions: the context, then k - 1 fed back
    assert proposer.propose(list(range(10, 20)), 4) == reference(list(range(10, 20)), 3)
    assert proposer.propose(list(range(10, 23)), 4) == []
    assert proposer.propose([], 4) == []


def test_a_batch_proposes_what_each_context_alone_would(tiny: str, reference) -> None:
    rng = random.Random(5)
    proposer = _proposer(tiny, num_blocks=64)
    shared = [rng.randrange(256) for _ in range(5)]
    contexts = [shared + [rng.randrange(256) for _ in range(rng.randint(1, 6))]
                for _ in range(4)]
    contexts.append(list(contexts[0]))  # two sequences at the same point: two entries
    for _ in range(3):
        ks = [rng.randint(1, 4) for _ in contexts]
        proposals = proposer.propose_batch(contexts, ks)
        assert proposals == [reference(c, k) for c, k in zip(contexts, ks)]
        contexts = [c + p[:rng.randint(0, len(p))] + [rng.randrange(256)]
                    for c, p in zip(contexts, proposals)]


def test_a_batch_larger_than_the_pool_drafts_for_those_that_fit(tiny: str, reference) -> None:
    proposer = _proposer(tiny, num_blocks=6)  # 24 positions: two of these 11
    contexts = [list(range(10 * i, 10 * i + 10)) for i in range(1, 4)]
    proposals = proposer.propose_batch(contexts, [2, 2, 2])
    assert proposals == [reference(contexts[0], 2), reference(contexts[1], 2), []]


def test_each_draft_pass_is_timed_into_its_cost_fit(tiny: str) -> None:
    proposer = _proposer(tiny, num_blocks=32)
    proposer.pass_cost = proposer.measure_pass_cost()
    assert sorted(proposer._free) == list(range(32))  # the measurement's blocks are back
    # A decode-shaped seed pass of more rows than the pool holds is not run (a row is then
    # priced as a prompt token), and gives back what it had reserved.
    assert proposer.measure_pass_s(1, num_rows=33) == 0.0
    assert sorted(proposer._free) == list(range(32))
    assert proposer.pass_cost.predict(StepShape(0, 1, 1)) > 0
    assert proposer.pass_cost.num_observations == 0
    proposer.propose_batch([list(range(10, 20)), list(range(30, 35))], [3, 1])
    assert proposer.pass_cost.num_observations == 3  # one pass per depth: rows 2, 1, 1
    assert proposer.pass_cost.last_measured_s > 0


def test_an_idle_draft_times_one_pass_every_refresh_interval(tiny: str) -> None:
    """Sized off, the draft runs no pass its fit could learn from: the REFRESH_INTERVAL-th
    scheduler pass in a row without one times a one-token pass into the fit; a draft pass
    restarts the count."""
    proposer = _proposer(tiny, num_blocks=32)
    for _ in range(REFRESH_INTERVAL - 1):
        proposer.idle_pass()
    assert proposer.pass_cost.num_observations == 0
    proposer.idle_pass()
    assert proposer.pass_cost.num_observations == 1
    assert proposer.pass_cost.last_measured_s > 0
    assert sorted(proposer._free) == list(range(32))  # the measurement's blocks are back
    for _ in range(REFRESH_INTERVAL - 1):
        proposer.idle_pass()
    proposer.propose_batch([list(range(10, 20))], [1])  # one draft pass
    for _ in range(REFRESH_INTERVAL - 1):
        proposer.idle_pass()
    assert proposer.pass_cost.num_observations == 2


def test_the_draft_pool_costs_memory_only_where_written(tiny: str, reference) -> None:
    """A pool as large as the target's stays out of memory while the draft is sized off: its
    pages become resident as blocks are first written."""
    from everystop.executor.residency import resident_bytes

    proposer = _proposer(tiny, num_blocks=4096)
    pool = proposer._pool.device_pool
    size = pool.numel() * pool.element_size()
    before = resident_bytes(pool.data_ptr(), size)
    if before is None:
        pytest.skip("mincore cannot tell resident pages here")
    assert before < size // 100
    assert proposer.propose(list(range(10, 20)), 3) == reference(list(range(10, 20)), 3)
    after = resident_bytes(pool.data_ptr(), size)
    assert after is not None and before < after < size // 10
