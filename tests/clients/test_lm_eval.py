"""EleutherAI lm-eval's `local-completions` model running a six-question multiple-choice task
shipped beside this file (no download). lm-eval finds the server's /tokenizer_info and
tokenizes remotely, sends `echo: true, logprobs: 1, max_tokens: 1`, and sums the continuation's
prompt logprobs; every one of those loglikelihoods must match transformers' float32 log-softmax
on the same GGUF weights, tokenized the way lm-eval splits context and continuation. The same
holds with vLLM's scoring idiom, `max_tokens: 0` with echo, sent through lm-eval's own model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.model, pytest.mark.server,
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

DATA = Path(__file__).parent / "data"


def _transformers_loglikelihoods(hf: Any, pairs: list[tuple[str, str]]
                                 ) -> list[tuple[float, bool]]:
    """(sum of the continuation's logprobs, whether greedy decoding would produce it) per pair,
    from one right-padded transformers forward pass (causal: padding after a row's end never
    reaches its logits)."""
    from everystop.tokenizer import load_tokenizer

    # transformers' tokenizer from the GGUF, through the on-disk converted copy (parsing the
    # vocabulary out of the GGUF again would cost seconds).
    tok = load_tokenizer().hf_tokenizer
    # lm-eval's split: encode the whole; the continuation is what follows the context's tokens.
    wholes = [tok.encode(c + x, add_special_tokens=False) for c, x in pairs]
    ctxlens = [len(tok.encode(c, add_special_tokens=False)) for c, _ in pairs]
    width = max(map(len, wholes))
    ids = torch.tensor([w + [0] * (width - len(w)) for w in wholes])
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits.float(), -1)
    out = []
    for row, whole, ctxlen in zip(logp, wholes, ctxlens):
        cont = torch.tensor(whole[ctxlen:])
        scores = row[ctxlen - 1:len(whole) - 1]
        greedy = bool((scores.argmax(-1) == cont).all())
        out.append((scores[torch.arange(len(cont)), cont].sum().item(), greedy))
    return out


def _scoring_only_model(base_url: str, model_name: str) -> Any:
    """lm-eval's local-completions, sending vLLM's scoring idiom instead of its own request:
    `max_tokens: 0` with echo, the prompt's logprobs and nothing generated."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    class ScoringOnly(LocalCompletionsAPI):
        def _create_payload(self, messages: Any, generate: bool = False,
                            gen_kwargs: dict[str, Any] | None = None, seed: int = 1234,
                            eos: Any = None, **kwargs: Any) -> dict[str, Any]:
            payload: dict[str, Any] = super()._create_payload(messages, generate, gen_kwargs,
                                                              seed, eos, **kwargs)
            if not generate:
                payload["max_tokens"] = 0
            return payload

        @staticmethod
        def parse_logprobs(outputs: Any, tokens: list[list[int]] | None = None,
                           ctxlens: list[int] | None = None, **kwargs: Any
                           ) -> list[tuple[float, bool]]:
            """lm-eval's parser cuts the last entry off (the token max_tokens 1 generates);
            here nothing is generated, so each choice is exactly the prompt's tokens, and a
            placeholder entry stands in for the token that is not there."""
            outputs = outputs if isinstance(outputs, list) else [outputs]
            padded = []
            for out in outputs:
                assert out["usage"]["completion_tokens"] == 0
                choices = []
                for choice, ids in zip(sorted(out["choices"], key=lambda c: c["index"]),
                                       tokens or []):
                    lp = choice["logprobs"]
                    assert len(lp["token_logprobs"]) == len(ids)
                    choices.append({**choice, "logprobs": {
                        **lp, "token_logprobs": [*lp["token_logprobs"], 0.0],
                        "top_logprobs": [*lp["top_logprobs"], {"": 0.0}]}})
                padded.append({**out, "choices": choices})
            return list(LocalCompletionsAPI.parse_logprobs(padded, tokens, ctxlens))

    return ScoringOnly(base_url=base_url + "/completions", model=model_name, batch_size=6,
                       num_concurrent=3, max_retries=1)


@pytest.mark.parametrize("request_kind", ["lm-eval", "max_tokens_0"])
def test_multiple_choice_loglikelihoods_match_transformers(
        base_url: str, model_name: str, hf_float32_model: Any,
        monkeypatch: pytest.MonkeyPatch, request_kind: str) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(DATA)  # the task's data_files path is relative to it
    model: Any = "local-completions"
    model_args: dict[str, Any] | None = {
        "base_url": base_url + "/completions", "model": model_name, "batch_size": 6,
        "num_concurrent": 3, "max_retries": 1}
    if request_kind == "max_tokens_0":
        model, model_args = _scoring_only_model(base_url, model_name), None
    result = simple_evaluate(
        model=model, model_args=model_args, tasks=["everystop_tiny_mc"],
        task_manager=TaskManager(include_path=str(DATA), include_defaults=False),
        log_samples=True)
    samples = result["samples"]["everystop_tiny_mc"]
    assert len(samples) == 6
    pairs = [tuple(arg) for s in samples for arg in s["arguments"]]
    ours = [tuple(resp[0]) for s in samples for resp in s["resps"]]
    reference = _transformers_loglikelihoods(hf_float32_model, pairs)
    for (pair, (ll, greedy), (ref_ll, ref_greedy)) in zip(pairs, ours, reference):
        assert ll == pytest.approx(ref_ll, abs=5e-3), pair
        assert greedy == ref_greedy, pair
    # The accuracy lm-eval reports follows from those loglikelihoods.
    picks = [max(range(len(s["resps"])), key=lambda i, s=s: s["resps"][i][0][0])
             for s in samples]
    acc = sum(p == s["doc"]["answer"] for p, s in zip(picks, samples)) / len(samples)
    assert result["results"]["everystop_tiny_mc"]["acc,none"] == pytest.approx(acc)


def test_remote_tokenizer_round_trip(base_url: str) -> None:
    """lm-eval's own RemoteTokenizer over /tokenizer_info, /tokenize and /detokenize."""
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    assert check_remote_tokenizer_support(base_url + "/completions")
    tok = RemoteTokenizer(base_url + "/completions")
    ids = tok.encode("Question: what is 2 + 2?")
    assert tok.decode(ids) == "Question: what is 2 + 2?"
    assert tok.eos_token == "<|im_end|>" and tok.decode([tok.eos_token_id]) == tok.eos_token
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user",
                                                                 "content": "Hi"}])
