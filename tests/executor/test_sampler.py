"""Sampler: greedy, top-k/top-p support sets, seeded reproducibility, logprobs; the controls
(penalties, min_p, min_tokens, logit_bias) against reference computations."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from everystop.core.outputs import ScheduledSequence
from everystop.executor.logits_controls import apply_controls
from everystop.executor.sampler import Sampler
from everystop.sampling_params import SamplingParams, SamplingParamsError

V = 1000


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = _logits(6)
    sampler = Sampler("cpu", seed=0)
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=1.5, top_k=1)] * 3
    out = sampler(logits, params, [0] * 6)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_seeded_rows_reproducible_across_batch_compositions():
    logits = _logits(8)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = Sampler("cpu", seed=0)(logits[3:4], [seeded], [7]).token_ids[0]
    other = [SamplingParams(temperature=0.8)] * 8
    for trial in range(5):
        sampler = Sampler("cpu", seed=trial)
        params = list(other)
        params[trial] = seeded
        batch = logits.clone()
        batch[trial] = logits[3]
        assert sampler(batch, params, [7] * 8).token_ids[trial] == alone
    # A different output index gives a different stream (checked over many steps).
    draws = {Sampler("cpu")(logits[3:4], [seeded], [i]).token_ids[0] for i in range(30)}
    assert len(draws) > 1


def test_unseeded_rows_vary_and_follow_the_distribution():
    logits = torch.tensor([[0.0, 0.0, -1e9, 2.0]])
    sampler = Sampler("cpu", seed=0)
    params = [SamplingParams(temperature=1.0)]
    counts = torch.zeros(4)
    for _ in range(2000):
        counts[sampler(logits, params, [0]).token_ids[0]] += 1
    probs = torch.softmax(logits, -1)[0]
    assert counts[2] == 0
    assert torch.allclose(counts / counts.sum(), probs, atol=0.04)


def test_top_k_and_top_p_never_leave_the_allowed_set():
    logits = _logits(4, seed=3)
    sampler = Sampler("cpu", seed=0)
    k = 5
    probs = torch.softmax(logits, -1)
    sorted_p, order = probs.sort(-1, descending=True)
    top_k_sets = [set(order[i, :k].tolist()) for i in range(4)]
    # top_p=0.5: the smallest prefix of the sorted distribution whose mass reaches 0.5.
    n_nucleus = ((sorted_p.cumsum(-1) - sorted_p) < 0.5).sum(-1)
    nucleus_sets = [set(order[i, :n_nucleus[i]].tolist()) for i in range(4)]
    seen_k: set[int] = set()
    for step in range(300):
        out = sampler(logits, [SamplingParams(temperature=1.0, top_k=k)] * 2
                      + [SamplingParams(temperature=1.0, top_p=0.5)] * 2, [step] * 4)
        for i in range(2):
            assert out.token_ids[i] in top_k_sets[i]
        seen_k.add(out.token_ids[0])
        for i in range(2, 4):
            assert out.token_ids[i] in nucleus_sets[i]
    assert len(seen_k) > 1  # it does sample, not collapse to greedy


def test_top_p_tiny_keeps_the_best_token():
    logits = _logits(3)
    out = Sampler("cpu")(logits, [SamplingParams(temperature=2.0, top_p=1e-6)] * 3, [0] * 3)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_logprobs_match_log_softmax_of_unmodified_logits():
    logits = _logits(3)
    params = [SamplingParams(temperature=0.7, top_k=3, logprobs=5),
              SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=1.0)]
    out = Sampler("cpu", seed=0)(logits, params, [0, 0, 0])
    ref = torch.log_softmax(logits, -1)
    lp0, lp1 = out.logprobs[0], out.logprobs[1]
    assert lp0 is not None and lp1 is not None and out.logprobs[2] is None
    assert abs(lp0.logprob - ref[0, out.token_ids[0]].item()) < 1e-5
    top_vals, top_ids = ref[0].topk(5)
    assert [t for t, _ in lp0.top] == top_ids.tolist()
    assert torch.allclose(torch.tensor([v for _, v in lp0.top]), top_vals, atol=1e-5)
    assert lp1.top == [] and lp1.token_id == logits[1].argmax().item()


# -- controls: each against a reference computed on the logits by a plain loop ------------------

def _seq(prompt: list[int] | None = None, output: list[int] | None = None,
         eos: int | None = None) -> ScheduledSequence:
    return ScheduledSequence("r", [0], 0, [0], True, SamplingParams(), prompt_token_ids=prompt,
                             output_token_ids=output, eos_token_id=eos)


def test_presence_and_frequency_penalties_follow_openai() -> None:
    logits = _logits(2)
    output = [5, 5, 7, 5, 9]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.3), SamplingParams()]
    seqs = [_seq([1, 2], output), _seq([1, 2], output)]
    got = apply_controls(logits, params, [5, 5], seqs)
    ref = logits.clone()
    for t in set(output):
        ref[0, t] -= 0.5 + 0.3 * output.count(t)
    assert torch.allclose(got, ref)
    assert torch.equal(got[1], logits[1])  # a row without controls is untouched
    # Through the sampler: a strong frequency penalty moves the greedy choice off a repeat.
    top = int(logits[0].argmax())
    greedy = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    out = Sampler("cpu")(logits[:1], [greedy], [20], [_seq([], [top] * 20)])
    assert out.token_ids[0] != top
    assert out.token_ids[0] == int((logits[0] - 40.0 * (torch.arange(V) == top)).argmax())


def test_repetition_penalty_covers_prompt_and_output_hf_style() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    params = [SamplingParams(repetition_penalty=2.0)]
    got = apply_controls(logits, params, [1], [_seq(prompt=[0, 1], output=[3, 3])])
    ref = logits.clone()
    for t in {0, 1, 3}:  # seen: divide a positive logit, multiply a negative one
        ref[0, t] = ref[0, t] / 2.0 if ref[0, t] > 0 else ref[0, t] * 2.0
    assert torch.allclose(got, ref)
    assert got[0, 0] == 1.0 and got[0, 1] == -4.0 and got[0, 3] == -2.0


def test_min_p_keeps_only_tokens_within_a_fraction_of_the_best() -> None:
    logits = _logits(1, seed=5)
    probs = torch.softmax(logits[0] / 0.8, -1)
    allowed = set(torch.nonzero(probs >= 0.1 * probs.max()).flatten().tolist())
    assert 1 < len(allowed) < V
    sampler = Sampler("cpu", seed=0)
    params = [SamplingParams(temperature=0.8, min_p=0.1)]
    seen = {sampler(logits, params, [0]).token_ids[0] for _ in range(300)}
    assert seen <= allowed and len(seen) > 1


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 3] = 5.0  # EOS is the best token
    logits[0, 6] = 4.0  # then a stop token id
    logits[0, 1] = 3.0
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[6])]
    seq = _seq(eos=3)
    sampler = Sampler("cpu")
    assert sampler(logits, params, [0], [seq]).token_ids == [1]
    assert sampler(logits, params, [1], [seq]).token_ids == [1]
    assert sampler(logits, params, [2], [seq]).token_ids == [3]  # reached: EOS allowed again


def test_logit_bias_is_added_and_clamped() -> None:
    logits = _logits(1)
    params = [SamplingParams(temperature=0.0, logit_bias={"7": 250.0, 3: -5.5, V + 10: 9.0})]
    assert params[0].logit_bias == {7: 100.0, 3: -5.5, V + 10: 9.0}
    got = apply_controls(logits, params, [0], None)
    ref = logits.clone()
    ref[0, 7] += 100.0
    ref[0, 3] -= 5.5
    assert torch.allclose(got, ref)
    out = Sampler("cpu")(logits, params, [0])
    assert out.token_ids == [7]
    # Logprobs still describe the model's own distribution.
    assert out.logprobs[0] is None


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
                                 dict(repetition_penalty=0.0), dict(min_p=1.5),
                                 dict(min_tokens=20, max_tokens=10), dict(logit_bias={"a": 1}),
                                 dict(n=0)])
def test_control_parameters_are_validated(bad: dict[str, Any]) -> None:
    with pytest.raises(SamplingParamsError):
        SamplingParams(**bad)


def _packed(allowed: list[set[int]], vocab: int) -> list[torch.Tensor]:
    """Each row's allowed ids as xgrammar packs them: bit t of int32 word t // 32."""
    out = []
    for ids in allowed:
        words = [0] * ((vocab + 31) // 32)
        for t in ids:
            words[t // 32] |= 1 << (t % 32)
        out.append(torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                                dtype=torch.int32))
    return out


def test_token_bitmask_leaves_only_allowed_tokens_and_spares_other_rows() -> None:
    vocab = 70  # not a multiple of 32: the last word is partial
    logits = _logits(3, seed=5)[:, :vocab].contiguous()
    allowed = [{3, 31, 63, 69}, {0}]  # bit 31 is the int32 sign bit
    masks = _packed(allowed, vocab)
    seqs = [_seq(), _seq(), _seq()]
    seqs[0].token_bitmask, seqs[2].token_bitmask = masks
    sampler = Sampler("cpu", seed=1)
    for temperature in (0.0, 1.5):
        params = [SamplingParams(temperature=temperature, logprobs=1) for _ in seqs]
        for _ in range(20):
            out = sampler(logits, params, [0, 0, 0], seqs)
            assert out.token_ids[0] in allowed[0] and out.token_ids[2] == 0
    greedy = sampler(logits, [SamplingParams(temperature=0.0, logprobs=1)] * 3, [0] * 3, seqs)
    best = max(allowed[0], key=lambda t: logits[0, t].item())
    assert greedy.token_ids[0] == best
    assert greedy.token_ids[1] == logits[1].argmax().item()  # no mask: untouched
    # Logprobs still describe the model's own distribution, before the mask.
    ref = torch.log_softmax(logits[0], -1)[best].item()
    assert greedy.logprobs[0] is not None and greedy.logprobs[0].logprob == pytest.approx(ref)


def test_allowed_token_ids_mask_everything_else_beside_an_innocent_row() -> None:
    logits = _logits(2, seed=7)
    allowed = [5, 17, 900]
    params = [SamplingParams(temperature=1.5, allowed_token_ids=allowed),
              SamplingParams(temperature=0.0)]
    sampler = Sampler("cpu", seed=3)
    for _ in range(20):
        out = sampler(logits, params, [0, 0], [_seq(), _seq()])
        assert out.token_ids[0] in allowed
        assert out.token_ids[1] == logits[1].argmax().item()
    greedy = sampler(logits[:1], [SamplingParams(temperature=0.0, allowed_token_ids=allowed)],
                     [0])
    assert greedy.token_ids == [max(allowed, key=lambda t: logits[0, t].item())]


def test_bad_words_ban_single_tokens_and_the_last_token_after_a_matching_prefix() -> None:
    logits = torch.zeros(2, 8)
    logits[:, 4] = 5.0  # the best token: the end of the two-token word [2, 4]
    logits[:, 6] = 4.0  # the next best: a one-token bad word
    logits[:, 1] = 3.0
    words = [[2, 4], [6]]
    params = [SamplingParams(temperature=0.0, bad_words_token_ids=words),
              SamplingParams(temperature=0.0)]
    sampler = Sampler("cpu")
    after_prefix, elsewhere = _seq(), _seq()
    after_prefix.output_token_ids, elsewhere.output_token_ids = [3, 2], [2, 3]
    assert sampler(logits, params, [2, 2], [after_prefix, elsewhere]).token_ids == [1, 4]
    assert sampler(logits[:1], params[:1], [2], [elsewhere]).token_ids == [4]
    assert sampler(logits[:1], params[:1], [0], [_seq()]).token_ids == [4]


def test_bad_words_tokenize_each_word_bare_and_after_a_space() -> None:
    params = SamplingParams(bad_words=["ab", " c"])
    params.tokenize_bad_words(lambda text: [ord(ch) for ch in text])
    assert params.bad_words_token_ids == [[97, 98], [32, 97, 98], [32, 99]]


@pytest.mark.parametrize(("field", "value"), [("allowed_token_ids", [3, V]),
                                              ("bad_words_token_ids", [[1, V + 4]])])
def test_token_ids_outside_the_vocabulary_are_refused_at_intake(field: str, value: Any) -> None:
    params = SamplingParams(**{field: value})
    with pytest.raises(SamplingParamsError) as err:
        params.check_vocab(V)
    assert err.value.param == ("bad_words" if field == "bad_words_token_ids" else field)
    with pytest.raises(SamplingParamsError):
        SamplingParams(allowed_token_ids=[])
