"""LoRA adapters through the OpenAI API: a request picks one by `model`, /v1/models lists
them with their parent, an unknown name is a 404, and the prefix cache never serves one
adapter's blocks to another."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from everystop.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from everystop.engine.async_engine import AsyncEngine
from everystop.engine.llm_engine import LLMEngine
from everystop.engine.lora_registry import UnknownLoraAdapter
from everystop.executor.factory import create_executor
from everystop.sampling_params import SamplingParams
from everystop.server.app import build_app
from tests.engine.toy_engine import CharTokenizer

from .conftest import VOCAB, peft_reference

SERVED = ("all7", "qv")


class SmallCharTokenizer(CharTokenizer):
    """Token id = code point, within the tiny model's vocabulary."""

    vocab_size = VOCAB


def _engine(base: str, adapters: dict[str, str]) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model=base, dtype="float32",
                          lora_modules=tuple((n, adapters[n]) for n in SERVED)),
        cache=CacheConfig(block_size=16, num_gpu_blocks_override=64, swap_space_gib=0.0,
                          kv_cache_dtype="float32"),
        scheduler=SchedulerConfig(max_model_len=512, max_num_seqs=8))
    return LLMEngine(config, create_executor(config), SmallCharTokenizer())


@pytest.fixture(scope="module")
def front(lora_dirs) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(_engine(*lora_dirs))
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(front) -> Iterator[TestClient]:
    with TestClient(build_app(front, "tiny-base")) as c:
        yield c


def _complete(client: TestClient, model: str, prompt: str, max_tokens: int = 8) -> dict:
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt,
                                             "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_models_lists_the_base_and_each_adapter_with_its_parent(client):
    data = client.get("/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [
        ("tiny-base", None), ("all7", "tiny-base"), ("qv", "tiny-base")]
    assert client.get("/v1/models/qv").json()["parent"] == "tiny-base"


def test_unknown_adapter_is_a_404_model_not_found(client):
    r = client.post("/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")


@pytest.mark.parametrize("model", [None, *SERVED])
def test_a_request_runs_with_the_adapter_its_model_names(client, lora_dirs, model):
    base, adapters = lora_dirs
    prompt = "the adapter named by model"
    body = _complete(client, model or "tiny-base", prompt)
    assert body["model"] == (model or "tiny-base")
    ours = [ord(c) for c in body["choices"][0]["text"]]
    theirs, _ = peft_reference(base, adapters[model] if model else None,
                               [ord(c) for c in prompt], 8)
    assert ours == theirs


def test_the_same_prompt_under_two_adapters_misses_the_cache(client):
    prompt = "a prompt long enough to fill three blocks of sixteen tokens each.."
    cached = lambda body: body["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    assert cached(_complete(client, "all7", prompt, 2)) == 0
    assert cached(_complete(client, "all7", prompt, 2)) > 0  # the control: a hit
    assert cached(_complete(client, "qv", prompt, 2)) == 0
    assert cached(_complete(client, "tiny-base", prompt, 2)) == 0


def test_the_engine_refuses_an_unknown_adapter_by_name(front):
    assert front.lora_adapters() == list(SERVED)
    with pytest.raises(UnknownLoraAdapter, match="'other'"):
        front.make_request([1, 2], SamplingParams(max_tokens=2), lora="other")
    assert front.make_request([1, 2], SamplingParams(max_tokens=2), lora="qv").lora_id == 1
