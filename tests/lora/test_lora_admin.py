"""Loading and unloading LoRA adapters while serving: POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (operator routes), an adapter in use is not unloaded (409), a request
made for an adapter unloaded before it was queued is refused by name."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from everystop.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from everystop.engine.async_engine import AsyncEngine
from everystop.engine.llm_engine import LLMEngine
from everystop.engine.lora_registry import LoraConflict, UnknownLoraAdapter
from everystop.executor.factory import create_executor
from everystop.sampling_params import SamplingParams
from everystop.server.app import build_app
from everystop.server.lora_admin import install_lora_routes

from .conftest import peft_reference, save_adapter, tiny_config, transformers
from .test_gguf_adapter import write_gguf_adapter
from .test_lora_serving import SmallCharTokenizer

ADMIN_KEY = "the-admin-key"  # operator routes: loopback only without one


def _engine(base: str, **model_options: object) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model=base, dtype="float32", **model_options),  # type: ignore[arg-type]
        cache=CacheConfig(block_size=16, num_gpu_blocks_override=64, swap_space_gib=0.0,
                          kv_cache_dtype="float32"),
        scheduler=SchedulerConfig(max_model_len=512, max_num_seqs=8))
    return LLMEngine(config, create_executor(config), SmallCharTokenizer())


def _client(engine: LLMEngine) -> Iterator[TestClient]:
    front = AsyncEngine(engine)
    try:
        app = build_app(front, "tiny-base", admin_key=ADMIN_KEY,
                        extensions=[install_lora_routes])
        with TestClient(app, headers={"X-Admin-Key": ADMIN_KEY}) as c:
            yield c
    finally:
        front.shutdown()


@pytest.fixture(scope="module")
def client(lora_dirs) -> Iterator[TestClient]:
    yield from _client(_engine(lora_dirs[0], enable_lora=True, max_lora_rank=8))


def _load(client: TestClient, name: str, path: str):
    return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def test_an_adapter_loaded_at_run_time_serves_and_unloads(client, lora_dirs):
    base, adapters = lora_dirs
    assert _load(client, "late", adapters["qv"]).status_code == 200
    assert "late" in [m["id"] for m in client.get("/v1/models").json()["data"]]
    prompt = "loaded while serving"
    r = client.post("/v1/completions", json={"model": "late", "prompt": prompt,
                                             "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    theirs, _ = peft_reference(base, adapters["qv"], [ord(c) for c in prompt], 6)
    assert [ord(c) for c in r.json()["choices"][0]["text"]] == theirs
    assert _load(client, "late", adapters["all7"]).status_code == 409  # the name is taken
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 200
    r = client.post("/v1/completions", json={"model": "late", "prompt": "x", "max_tokens": 1})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")


@pytest.mark.parametrize("adapter,message", [("kod", "rank 16 is above the maximum LoRA rank 8"),
                                             (None, "cannot read adapter_config.json")])
def test_an_unloadable_adapter_is_a_400_naming_why(client, lora_dirs, tmp_path, adapter,
                                                   message):
    path = lora_dirs[1][adapter] if adapter else str(tmp_path)
    r = _load(client, "bad", path)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert "bad" not in [m["id"] for m in client.get("/v1/models").json()["data"]]


def test_unloading_an_unknown_adapter_is_a_404_and_a_body_without_a_name_a_400(client):
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "never"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")
    r = client.post("/v1/load_lora_adapter", json={"lora_path": "/x"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "lora_name")


def test_without_enable_lora_loading_is_refused_by_name(lora_dirs):
    for client in _client(_engine(lora_dirs[0])):
        r = _load(client, "a", lora_dirs[1]["qv"])
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]


def test_an_adapter_in_use_is_not_unloaded_until_its_requests_finish(lora_dirs):
    base, adapters = lora_dirs
    engine = _engine(base, lora_modules=(("qv", adapters["qv"]),))
    engine.add_request(engine.make_request([5, 6, 7], SamplingParams(max_tokens=4), lora="qv"))
    made_before = engine.make_request([5, 6], SamplingParams(max_tokens=2), lora="qv")
    with pytest.raises(LoraConflict, match="in use by 1 request"):
        engine.unload_lora("qv")
    while engine.has_work():
        engine.step()
    engine.unload_lora("qv")
    assert engine.lora_adapters() == []
    with pytest.raises(UnknownLoraAdapter, match="unloaded"):
        engine.add_request(made_before)
    engine.load_lora("qv", adapters["qv"])  # the name again: a new id, no stale cache entries
    assert engine.make_request([5], SamplingParams(max_tokens=1), lora="qv").lora_id == 1


def test_loaded_adapters_count_in_the_weight_memory(lora_dirs):
    base, adapters = lora_dirs
    engine = _engine(base, enable_lora=True)
    before = engine.memory().weight_bytes
    engine.load_lora("qv", adapters["qv"])
    # Rank 8 on q and v, held as the fused [q; k; v] pair of each of the 2 layers, fp32:
    # A stacks q's and v's [8, 64]; B is [64 + 32 + 32, 16], block diagonal.
    added = 2 * (16 * 64 + 128 * 16) * 4
    assert engine.memory().weight_bytes == before + added
    engine.unload_lora("qv")
    assert engine.memory().weight_bytes == before


def test_an_adapter_of_another_base_is_a_400_naming_the_tensor(client, tmp_path):
    other = transformers.LlamaForCausalLM(tiny_config(hidden_size=32, intermediate_size=64))
    other.save_pretrained(str(tmp_path / "other"))
    save_adapter(str(tmp_path / "other"), str(tmp_path / "wrong"), 1, r=4, lora_alpha=8,
                 target_modules=["v_proj"])
    r = _load(client, "wrong", str(tmp_path / "wrong"))
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_lora_adapter")
    assert "v_proj.lora_A.weight' has shape (4, 32)" in r.json()["error"]["message"]


def test_a_gguf_adapter_loads_at_run_time_and_serves_as_peft_does(client, lora_dirs, tmp_path):
    base, adapters = lora_dirs
    path = write_gguf_adapter(adapters["qv"], tmp_path / "qv.gguf")
    assert _load(client, "qv-gguf", str(path)).status_code == 200
    prompt = "from a gguf file"
    r = client.post("/v1/completions", json={"model": "qv-gguf", "prompt": prompt,
                                             "max_tokens": 6, "temperature": 0})
    theirs, _ = peft_reference(base, adapters["qv"], [ord(c) for c in prompt], 6)
    assert [ord(c) for c in r.json()["choices"][0]["text"]] == theirs
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "qv-gguf"}).status_code \
        == 200


def test_unloading_an_adapter_a_request_is_using_is_a_409(client, lora_dirs):
    assert _load(client, "busy", lora_dirs[1]["all7"]).status_code == 200
    # Long enough to still be generating when the unload arrives (the context is 512).
    body = {"model": "busy", "prompt": "in use", "max_tokens": 500, "temperature": 0}
    done: list[int] = []
    worker = threading.Thread(target=lambda: done.append(
        client.post("/v1/completions", json=body).status_code))
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while 'running_lora_adapters="busy"' not in client.get("/metrics").text:
            assert not done and time.monotonic() < deadline, "the request never ran"
            time.sleep(0.005)
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "busy"})
    finally:
        worker.join()
    assert (r.status_code, r.json()["error"]["code"]) == (409, "lora_adapter_in_use")
    assert done == [200]
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "busy"}).status_code == 200
