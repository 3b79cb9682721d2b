"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from everystop.config import EngineConfig
from everystop.core.outputs import RequestOutput
from everystop.engine.llm_engine import LLMEngine
from everystop.sampling_params import SamplingParams

if TYPE_CHECKING:
    from everystop.tokenizer import Tokenizer

Message = dict[str, str]


class LLM:
    """Offline batch generation on one engine. Extra keyword options are engine options
    (max_num_seqs, block_size, dtype, device, kv_cache_memory, ...; see EngineConfig)."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.config = EngineConfig.from_options(model=model, **engine_options)
        self.engine = LLMEngine.from_config(self.config)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: int = 1) -> list[RequestOutput]:
        """Raw prompts (no chat template), strings or token-id lists; one result per prompt,
        in order, each with .text, .token_ids and .finish_reason."""
        one = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        batch = [prompts] if one else list(prompts)
        return self._run(cast("list[str | list[int]]", batch), sampling_params, use_tqdm,
                         priority)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = cast("Tokenizer", self.engine.tokenizer)  # from_config loads a real one
        prompts: list[str | list[int]] = [
            tok.apply_chat_template(cast("list[Message]", conv), add_generation_prompt=True)
            for conv in conversations]
        return self._run(prompts, sampling_params, use_tqdm, 1)

    def _run(self, prompts: list[str | list[int]],
             params: SamplingParams | Sequence[SamplingParams] | None, use_tqdm: bool,
             priority: int) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams() for _ in prompts]
        else:
            if len(params) != len(prompts):
                raise ValueError("give one SamplingParams, or one per prompt")
            per_prompt = list(params)
        order: dict[str, int] = {}
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
            req = self.engine.add_request(prompt, p, priority=priority)
            order[req.request_id] = i
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = _progress(len(prompts)) if use_tqdm and len(prompts) > 1 else None

        def collect(out: RequestOutput) -> None:
            if out.finished and out.request_id in order:
                results[order[out.request_id]] = out
                if bar is not None:
                    bar.update(1)

        self.engine.run_until_done(collect)
        if bar is not None:
            bar.close()
        return [r for r in results if r is not None]


def _progress(total: int) -> Any:
    from tqdm import tqdm
    return tqdm(total=total, desc="generating", unit="req", dynamic_ncols=True)
