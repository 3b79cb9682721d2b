"""Test doubles for server tests: the toy engine plus a chat template, optional per-step delay
(so streams are observable mid-flight) and made-up logprobs."""

from __future__ import annotations

import time

from everystop.core.outputs import ModelOutput, SchedulerOutput, TokenLogprob
from tests.core.toy_executor import ToyExecutor
from tests.engine.toy_engine import CharTokenizer


class ChatCharTokenizer(CharTokenizer):
    """The char tokenizer with a chat template and a BOS (id 1, added when asked)."""

    bos_token_id = 1

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.bos_token_id] * add_special_tokens + super().encode(text)

    def apply_chat_template(self, conversation: list[dict[str, str]],
                            add_generation_prompt: bool = True,
                            tools: list[dict] | None = None,
                            continue_final_message: bool = False, **kwargs: object) -> str:
        text = "".join(f"<tool>{t.get('function', {}).get('name', '')}\n" for t in tools or [])
        text += "".join(f"<{k}={v}>\n" for k, v in sorted(kwargs.items()))
        text += "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in conversation)
        if continue_final_message:
            return text.removesuffix("\n")
        return text + ("<assistant>" if add_generation_prompt else "")


class SlowToyExecutor(ToyExecutor):
    """The toy model, `step_delay_s` slower per step, with fake logprobs when asked."""

    def __init__(self, num_gpu_blocks: int, block_size: int, step_delay_s: float = 0.0) -> None:
        super().__init__(num_gpu_blocks, block_size)
        self.step_delay_s = step_delay_s

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        out = super().execute(sched)
        for e in sched.scheduled:
            k = e.sampling_params.logprobs
            token = out.sampled_token_ids.get(e.request_id)
            if k is not None and token is not None:
                top = [(token, -0.25)] + [(token + i, -1.0 - i) for i in range(1, k)]
                out.logprobs[e.request_id] = TokenLogprob(token, -0.25, top[:k])
            want, prompt = e.sampling_params.prompt_logprobs, e.prompt_token_ids
            if want is not None and prompt is not None:  # -0.5 for prompt token p+1
                n = min(e.seq_len, len(prompt) - 1) - e.start_pos
                out.prompt_logprobs[e.request_id] = [
                    TokenLogprob(t, -0.5, [(t, -0.5)][:want])
                    for t in prompt[e.start_pos + 1:e.start_pos + 1 + max(n, 0)]]
        return out
