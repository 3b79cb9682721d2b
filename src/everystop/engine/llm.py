"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from everystop.config import EngineConfig
from everystop.core.outputs import RequestOutput
from everystop.engine.llm_engine import LLMEngine
from everystop.engine.offline_outputs import LLMOutput, llm_output
from everystop.sampling_params import SamplingParams

if TYPE_CHECKING:
    from everystop.tokenizer import EngineTokenizer, Tokenizer

Message = dict[str, str]
# A text, token ids, or vLLM's dict prompt ({"prompt": ...} / {"prompt_token_ids": [...]}).
PromptInput = str | list[int] | dict[str, Any]


class LLM:
    """Offline batch generation on one engine. Extra keyword options are engine options
    (max_num_seqs, block_size, dtype, device, kv_cache_memory, ...; see EngineConfig)."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.config = EngineConfig.from_options(model=model, **engine_options)
        self.engine = LLMEngine.from_config(self.config)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """The offline API over an engine built elsewhere (a toy or simulated executor)."""
        llm = cls.__new__(cls)
        llm.config, llm.engine = engine.config, engine
        return llm

    def get_tokenizer(self) -> EngineTokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: int = 1) -> list[LLMOutput]:
        """Raw prompts (no chat template): strings, token-id lists, or vLLM's dicts
        {"prompt": str} / {"prompt_token_ids": [...]}. One result per prompt, in order, in
        vLLM's shape (engine/offline_outputs.py): all n completions in .outputs (with
        logprobs, cumulative_logprob, stop_reason), .prompt_logprobs, and .text, .token_ids and
        .finish_reason of the first completion."""
        one = isinstance(prompts, (str, dict)) or (bool(prompts) and isinstance(prompts[0], int))
        batch = cast("list[PromptInput]", [prompts] if one else list(prompts))
        return self._run([_prompt_of(p) for p in batch], sampling_params, use_tqdm, priority)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[LLMOutput]:
        """Apply the model's chat template to one conversation or a list of them (vLLM's
        keywords: OpenAI-shaped `tools`, extra template variables, an open last turn)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = cast("Tokenizer", self.engine.tokenizer)  # from_config loads a real one
        prompts: list[str | list[int]] = [
            tok.apply_chat_template(cast("list[Message]", conv), add_generation_prompt,
                                    tools, continue_final_message,
                                    **(chat_template_kwargs or {}))
            for conv in conversations]
        return self._run(prompts, sampling_params, use_tqdm, 1)

    def _run(self, prompts: list[str | list[int]],
             params: SamplingParams | Sequence[SamplingParams] | None, use_tqdm: bool,
             priority: int) -> list[LLMOutput]:
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams() for _ in prompts]
        else:
            if len(params) != len(prompts):
                raise ValueError("give one SamplingParams, or one per prompt")
            per_prompt = list(params)
        order: dict[str, tuple[int, int]] = {}  # request id -> (prompt, completion)
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
            for j in range(p.n):  # n completions: seeded ones get seed + j, as the server does
                params = p if j == 0 or p.seed is None else dataclasses.replace(p, seed=p.seed + j)
                req = self.engine.add_request(prompt, params, priority=priority)
                order[req.request_id] = (i, j)
        done: list[list[RequestOutput | None]] = [[None] * p.n for p in per_prompt]
        bar = _progress(len(order)) if use_tqdm and len(order) > 1 else None

        def collect(out: RequestOutput) -> None:
            if out.finished and out.request_id in order:
                i, j = order[out.request_id]
                done[i][j] = out
                if bar is not None:
                    bar.update(1)

        self.engine.run_until_done(collect)
        if bar is not None:
            bar.close()
        tokenizer = self.engine.tokenizer

        def decode(token_id: int) -> str:
            return tokenizer.decode([token_id])

        results = []
        for prompt, p, outs in zip(prompts, per_prompt, done):
            finished = [o for o in outs if o is not None]
            if finished:
                results.append(llm_output(prompt if isinstance(prompt, str) else None, finished,
                                          p.logprobs is not None, decode))
        return results


def _prompt_of(prompt: PromptInput) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return [int(t) for t in prompt["prompt_token_ids"]]
        if "prompt" in prompt:
            return str(prompt["prompt"])
        raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
    return prompt


def _progress(total: int) -> Any:
    from tqdm import tqdm
    return tqdm(total=total, desc="generating", unit="req", dynamic_ncols=True)
