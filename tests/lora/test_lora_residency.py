"""--max-cpu-loras: with 3 adapters and a cap of 2, the least recently used adapter no running
request uses is dropped from memory (logged, no longer counted in the weights' bytes) and read
again from its path on its next use, with the same outputs as peft's."""

from __future__ import annotations

import logging
import shutil

import pytest

from everystop.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from everystop.core.outputs import ScheduledSequence
from everystop.engine.llm_engine import LLMEngine
from everystop.executor.factory import create_executor
from everystop.executor.lora.peft_adapter import load_peft_adapter
from everystop.sampling_params import SamplingParams

from .conftest import GREEDY, greedy_generate, make_runner, peft_reference
from .test_lora_serving import SmallCharTokenizer

NAMES = ("all7", "qv", "kod")  # ids 0, 1, 2
LOG = "everystop.executor.lora.manager"


def _rows(lora_ids: list[int]) -> list[ScheduledSequence]:
    return [ScheduledSequence(f"r{i}", [3 + i], 0, [i], True, GREEDY, lora_id=lora_id)
            for i, lora_id in enumerate(lora_ids)]


def _resident(runner) -> list[int]:
    return list(runner.lora.adapters)  # least recently used first


@pytest.fixture
def capped(lora_dirs):
    base, adapters = lora_dirs
    return make_runner(base, {n: adapters[n] for n in NAMES}, max_cpu_loras=2)


def test_loading_a_third_adapter_evicts_the_first_and_frees_its_bytes(lora_dirs, capped,
                                                                      caplog):
    adapters = lora_dirs[1]
    assert _resident(capped) == [1, 2]
    args = capped.model.args
    sizes = [load_peft_adapter(adapters[n], args, capped.dtype).nbytes for n in NAMES]
    assert capped.lora.nbytes == sizes[1] + sizes[2]
    with caplog.at_level(logging.INFO, logger=LOG):
        capped.lora.pass_for(_rows([0]), None)
    assert _resident(capped) == [2, 0]  # 0 read back, 1 the least recently used: dropped
    assert capped.lora.nbytes == sizes[0] + sizes[2]
    assert "LoRA adapter 0 reloaded from" in caplog.text
    assert "LoRA adapter 1 evicted from memory (least recently used; --max-cpu-loras 2)" \
        in caplog.text


def test_a_reloaded_adapter_generates_what_peft_does(lora_dirs, capped):
    base, adapters = lora_dirs
    prompt = [7, 100, 33, 250, 12, 5]
    ours, _ = greedy_generate(capped, [prompt], [0], 8)  # id 0 was evicted at start-up
    assert capped.lora.num_reloads == 1
    assert ours[0] == peft_reference(base, adapters["all7"], prompt, 8)[0]


def test_an_adapter_of_a_running_request_is_never_evicted(capped, caplog):
    capped.lora.pass_for(_rows([0]), None)  # resident [2, 0]
    # 2 is the least recently used but a running request uses it: 0 goes instead.
    capped.lora.pass_for(_rows([1]), None, running=frozenset({2}))
    assert _resident(capped) == [2, 1]
    # Every resident adapter in use: above the cap until one is idle, and said so.
    with caplog.at_level(logging.WARNING, logger=LOG):
        capped.lora.pass_for(_rows([0]), None, running=frozenset({1, 2}))
    assert sorted(_resident(capped)) == [0, 1, 2]
    assert "3 adapters resident, above --max-cpu-loras 2" in caplog.text
    capped.lora.pass_for(_rows([-1]), None, running=frozenset({1}))
    assert _resident(capped) == [1, 0]  # 2: the least recently used of the idle


def test_without_a_cap_every_adapter_stays(lora_dirs):
    base, adapters = lora_dirs
    runner = make_runner(base, {n: adapters[n] for n in NAMES})
    assert _resident(runner) == [0, 1, 2]


def _engine(base: str, adapters: dict[str, str], **scheduler: object) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model=base, dtype="float32", max_cpu_loras=2,
                          lora_modules=tuple((n, adapters[n]) for n in NAMES)),
        cache=CacheConfig(block_size=16, num_gpu_blocks_override=64, swap_space_gib=0.0,
                          kv_cache_dtype="float32"),
        scheduler=SchedulerConfig(max_model_len=512, max_num_seqs=8,
                                  **scheduler))  # type: ignore[arg-type]
    return LLMEngine(config, create_executor(config), SmallCharTokenizer())


def test_an_engine_cycling_three_adapters_under_a_cap_of_two(lora_dirs):
    base, adapters = lora_dirs
    engine = _engine(base, adapters, max_loras=2)
    runner = engine.executor.runner
    manager = runner.lora
    sizes = [load_peft_adapter(adapters[n], runner.model.args, runner.dtype).nbytes
             for n in NAMES]
    prompt = [ord(c) for c in "cycling adapters"]
    names: dict[str, str] = {}
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                tokens[names[out.request_id]] = out.token_ids
        assert len(manager.adapters) <= 2
        assert engine.memory().weight_bytes == runner.weight_bytes + sum(
            sizes[i] for i in manager.adapters)

    # A long request on all7 runs throughout; qv and kod come after it, beside it.
    for i, name in enumerate(NAMES):
        req = engine.make_request(prompt, SamplingParams(temperature=0.0,
                                                         max_tokens=4 if i else 12), lora=name)
        names[req.request_id] = name
        engine.add_request(req)
        for _ in range(2):
            step()
            assert 0 in manager.adapters  # all7's request is running: never dropped
    while engine.has_work():
        step()
    assert manager.num_evictions >= 2 and manager.num_reloads >= 1
    for name in NAMES:
        assert tokens[name] == peft_reference(base, adapters[name], prompt,
                                              len(tokens[name]))[0], name


def test_max_cpu_loras_below_max_loras_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"--max-cpu-loras \(2\) must be at least "
                                          r"--max-loras \(3\)"):
        EngineConfig(model=ModelConfig(max_cpu_loras=2), scheduler=SchedulerConfig(max_loras=3))
    with pytest.raises(ConfigError, match="max_cpu_loras must be >= 0"):
        ModelConfig(max_cpu_loras=-1)


def test_an_evicted_adapter_whose_files_are_gone_fails_only_its_requests(lora_dirs, tmp_path):
    base, adapters = lora_dirs
    copies = {n: shutil.copytree(adapters[n], tmp_path / n) for n in NAMES}
    engine = _engine(base, {n: str(p) for n, p in copies.items()})  # all7 evicted at start
    shutil.rmtree(copies["all7"])
    finished = {}
    for name in ("all7", None):
        engine.add_request(engine.make_request([5, 6, 7], SamplingParams(max_tokens=3),
                                               request_id=str(name), lora=name))
    while engine.has_work():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["all7"].finish_reason == "error"
    assert "cannot read adapter_config.json" in (finished["all7"].error or "")
    assert finished["None"].finish_reason == "length"
