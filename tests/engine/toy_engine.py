"""An LLMEngine over the toy executor and a character tokenizer: engine logic without a model."""

from __future__ import annotations

from everystop.config import CacheConfig, EngineConfig, SchedulerConfig
from everystop.core.outputs import RequestOutput
from everystop.engine.llm_engine import LLMEngine
from tests.core.toy_executor import ToyExecutor


class CharDetokenizer:
    def __init__(self) -> None:
        self.text = ""

    def push(self, token_ids: list[int]) -> str:
        new = "".join(chr(t) for t in token_ids)
        self.text += new
        return new


class CharTokenizer:
    """Token id = code point; id 2 is EOS."""

    eos_token_id = 2
    eos_token_ids = frozenset({2})
    vocab_size = 1000

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]  # no special tokens to add

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)  # no special tokens to skip

    def make_detokenizer(self, params: object = None) -> CharDetokenizer:
        return CharDetokenizer()


def toy_engine_config(block_size: int = 4, **sched: object) -> EngineConfig:
    """No watermark, a 4096-token context, 8 sequences in 64-token steps of 16-token chunks;
    `sched` overrides the scheduler's fields."""
    defaults: dict[str, object] = dict(max_num_seqs=8, max_num_batched_tokens=64, chunk_size=16,
                                       max_model_len=4096)
    defaults.update(sched)
    return EngineConfig(cache=CacheConfig(block_size=block_size, watermark=0.0),
                        scheduler=SchedulerConfig(**defaults))  # type: ignore[arg-type]


def make_toy_engine(num_blocks: int = 256, block_size: int = 4, **sched: object) -> LLMEngine:
    return LLMEngine(toy_engine_config(block_size, **sched), ToyExecutor(num_blocks, block_size),
                     CharTokenizer())


def run_all(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step the engine until it has no work, checking the scheduler's books after every step;
    returns each request's final output by id."""
    final = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.scheduler.check_integrity()
    return final
