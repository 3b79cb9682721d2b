"""Engine flags, the expected-wait estimate and SSE framing, without a server."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from everystop.core.request import Request, RequestStatus
from everystop.engine.args import (
    add_engine_args,
    engine_config_from_args,
    parse_bytes,
    parse_tpot_target,
)
from everystop.sampling_params import SamplingParams
from everystop.server.admission import AdmissionConfig, AdmissionController, AdmissionRefused
from everystop.server.cli import served_model_names
from everystop.server.metrics import TenantLabels
from everystop.server.streaming import DONE, sse

ROOT = Path(__file__).resolve().parents[2]


def test_parse_bytes_units() -> None:
    assert parse_bytes("2GiB") == 2 << 30
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")


def test_engine_flags_map_onto_config() -> None:
    parser = add_engine_args(argparse.ArgumentParser())
    args = parser.parse_args(["--max-num-seqs", "4", "--max-num-batched-tokens", "256",
                              "--kv-cache-memory", "64MiB", "--no-prefix-caching",
                              "--max-queued-per-tier", "1,2,3", "--scheduling", "static",
                              "--dtype", "bfloat16", "--aging-interval", "2.5", "--swap-space",
                              "0.5", "--no-chunked-prefill"])
    cfg = engine_config_from_args(args)
    assert cfg.scheduler.max_num_seqs == 4 and cfg.scheduler.max_num_batched_tokens == 256
    assert cfg.cache.kv_cache_memory == 64 << 20 and not cfg.cache.enable_prefix_caching
    assert cfg.scheduler.max_queued_per_tier == (1, 2, 3)
    assert cfg.scheduler.scheduling == "static" and not cfg.scheduler.enable_chunked_prefill
    assert cfg.model.dtype == "bfloat16" and cfg.scheduler.aging_interval_s == 2.5
    assert cfg.cache.swap_space_gib == 0.5
    defaults = engine_config_from_args(parser.parse_args([]))
    assert defaults.cache.enable_prefix_caching and defaults.scheduler.max_num_seqs == 128


def test_tpot_target_flag_plain_off_and_per_tier() -> None:
    assert parse_tpot_target("100") == (100.0, (None, None, None))
    assert parse_tpot_target("off") == (0.0, (None, None, None))
    assert parse_tpot_target("0:50,1:100,2:200") == (None, (50.0, 100.0, 200.0))
    assert parse_tpot_target("150, 0:40") == (150.0, (40.0, None, None))
    for bad in ("fast", "3:50", "0:-5", "", "0:50,,"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_tpot_target(bad)
    parser = add_engine_args(argparse.ArgumentParser())
    cfg = engine_config_from_args(parser.parse_args(["--tpot-target-ms", "2:300,80"]))
    assert cfg.scheduler.tpot_target_ms == 80.0
    assert cfg.scheduler.tpot_target_ms_per_tier == (None, None, 300.0)
    auto = engine_config_from_args(parser.parse_args([])).scheduler
    assert auto.tpot_target_ms is None and auto.tpot_target_ms_per_tier == (None, None, None)
    off = engine_config_from_args(parser.parse_args(["--tpot-target-ms", "0"])).scheduler
    assert off.tpot_target_ms == 0.0


def test_bad_config_prints_one_line_and_exits_2() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-m", "everystop", "serve", "--max-num-seqs", "64",
                           "--max-num-batched-tokens", "8"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "max_num_batched_tokens" in proc.stderr


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _req(i: int, priority: int, status: RequestStatus) -> Request:
    r = Request(f"r{i}", [1, 2, 3], SamplingParams(), priority=priority)
    r.status = status
    return r


def test_expected_wait_counts_only_better_or_equal_tiers_and_uses_completion_rate() -> None:
    clock = _Clock()
    running, slots = [2], [2]
    ctl = AdmissionController(AdmissionConfig(max_queue_wait_s=(0, 5.0, 1.0), min_samples=2),
                              max_num_seqs=lambda: slots[0], num_running=lambda: running[0],
                              clock=clock)
    for i, prio in enumerate([0, 1, 1, 2]):
        ctl.track(_req(i, prio, RequestStatus.WAITING))
    ctl.track(_req(9, 0, RequestStatus.RUNNING))
    assert ctl.expected_wait_s(1) is None  # no completions yet: no estimate, nothing refused
    ctl.check(2)
    for _ in range(4):  # four completions over 10 s: 0.4 requests/s
        clock.t += 2.5
        ctl.done(_req(50, 1, RequestStatus.FINISHED_LENGTH), completed=True)
    assert ctl.admission_rate() == pytest.approx(0.4)
    assert ctl.queued_ahead(0) == 1 and ctl.queued_ahead(1) == 3 and ctl.queued_ahead(2) == 4
    assert ctl.expected_wait_s(1) == pytest.approx(4 / 0.4)
    with pytest.raises(AdmissionRefused) as exc:
        ctl.check(1)  # 10 s > 5 s
    assert exc.value.reason == "expected_wait" and exc.value.retry_after_header == "5"
    ctl.check(0)  # tier 0 has no threshold
    running[0] = 0  # two free slots take two of the five: three wait
    assert ctl.expected_wait_s(2) == pytest.approx(3 / 0.4)
    slots[0] = 8  # enough free slots for the whole queue: no wait
    assert ctl.expected_wait_s(2) == 0.0
    clock.t += 60  # old completions age out of the window
    running[0] = 2
    assert ctl.admission_rate() is None


def test_tenant_labels_are_bounded() -> None:
    labels = TenantLabels(max_tenants=2)
    assert [labels(t) for t in ("a", "b", "c", "a", "d")] == ["a", "b", "other", "a", "other"]


def test_sse_frames() -> None:
    frame = sse({"x": "é"})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert json.loads(frame[6:]) == {"x": "é"}
    assert DONE == b"data: [DONE]\n\n"


def test_sse_frame_is_one_line_for_any_text() -> None:
    text = "".join(chr(c) for c in range(1, 0x3000))
    frame = sse({"t": text})
    assert len(frame[:-2].decode().splitlines()) == 1
    assert json.loads(frame[6:])["t"] == text


def test_missing_model_file_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-m", "everystop", "serve", "--model",
                           str(tmp_path / "nope.gguf")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "nope.gguf" in proc.stderr


def test_step_budget_gauges_show_the_fit_and_the_budget() -> None:
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from everystop.server.metrics import ServerMetrics
    from tests.core.toy_executor import ToyExecutor
    from tests.telemetry.helpers import make_engine, params, run

    machine = ToyExecutor(256, 4, cost_fn=lambda s: 0.01 + 0.002 * s.num_decode_rows)
    eng = make_engine(executor=machine, tpot_target_ms=30)
    eng.add_request("a" * 40, params(30))
    eng.add_request("b" * 40, params(30))
    run(eng)
    metrics = ServerMetrics()
    # What ServerMetrics reads of an AsyncEngine, served by the LLMEngine underneath.
    metrics.attach(SimpleNamespace(add_listeners=eng.add_listeners, stats=eng.stats,
                                   memory=eng.memory, cache_config=eng.config.cache,
                                   num_in_flight=0, draining=False, num_watchdog_aborts=0,
                                   lora_adapters=eng.lora_adapters))
    got = {(s.name, s.labels.get("term")): s.value
           for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    stats = eng.stats()
    # the last step decodes both requests: 10 ms + 2 rows * 2 ms
    assert got[("everystop:step_cost_measured_seconds", None)] == pytest.approx(0.014)
    assert got[("everystop:step_cost_predicted_seconds", None)] == stats.step_predicted_s > 0
    assert got[("everystop:prefill_budget_tokens", None)] == stats.prefill_budget_tokens
    assert stats.prefill_budget_tokens < 64  # the 30 ms target binds, not the token cap
    for term in ("fixed", "prefill_token", "decode_row", "context_token"):
        assert got[("everystop:step_cost_coefficient_seconds", term)] == stats.step_cost[term]
    assert stats.step_predicted_s == pytest.approx(stats.step_measured_s, rel=0.1)  # it learnt


@pytest.mark.parametrize(("path", "names"), [
    (None, ["SmolLM2-135M-Instruct"]),
    ("/m/SmolLM2-135M-Instruct.Q4_1.gguf", ["SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1"]),
    ("/m/Meta-Llama-3-8B-Instruct-Q4_K_M.gguf",
     ["Meta-Llama-3-8B-Instruct", "Meta-Llama-3-8B-Instruct-Q4_K_M"]),
    ("/m/tiny.f16.gguf", ["tiny", "tiny.f16"]),
    ("/m/Llama-2-7b-hf", ["Llama-2-7b-hf"]),  # an HF directory: its name, nothing stripped
])
def test_served_model_name_drops_the_quantization_suffix(path: str | None,
                                                         names: list[str]) -> None:
    assert served_model_names(path) == names
