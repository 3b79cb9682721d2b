"""Impossible hardware is refused by name, and no prediction beats the roofline it prints."""

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from everystop.cli import main
from everystop.sim.metrics import summarize
from everystop.sim.node import build_node
from everystop.sim.simulator import simulate
from everystop.sim.specs import hardware_keys, load_hardware
from everystop.workload import synthetic


@pytest.mark.parametrize("override", [
    {"eff_compute": 2.5}, {"eff_memory": 1.01}, {"eff_link": 0.0}, {"peak_flops": -1.0},
    {"hbm_bandwidth": 0.0}, {"iteration_overhead_s": -0.001}, {"overhead_per_seq_s": -1e-6},
])
def test_impossible_figures_refused_by_name(override):
    name = next(iter(override))
    with pytest.raises(ValueError, match=name):
        load_hardware("h100-sxm", **override)


def test_cli_refuses_efficiency_above_one(capsys):
    rc = main(["simulate", "--workload", "n=4", "--eff-compute", "2.5", "--eff-memory", "2.5",
               "--no-plots"])
    assert rc == 2
    assert "eff_compute" in capsys.readouterr().err


def test_model_that_does_not_fit_refused():
    with pytest.raises(ValueError, match="does not fit"):
        build_node("llama-3-70b", "a100-40gb", tp=1)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hardware=st.sampled_from(sorted(hardware_keys())),
       model=st.sampled_from(["llama-3-8b", "llama-3-70b"]),
       tp=st.sampled_from([1, 2, 4, 8]),
       eff_compute=st.floats(0.05, 1.0), eff_memory=st.floats(0.05, 1.0),
       eff_link=st.floats(0.05, 1.0), overhead=st.floats(0.0, 0.01),
       rate=st.sampled_from(["inf", "50", "500"]), seed=st.integers(0, 1000))
def test_no_prediction_exceeds_its_roofline(hardware, model, tp, eff_compute, eff_memory,
                                            eff_link, overhead, rate, seed):
    overrides = {"eff_compute": eff_compute, "eff_memory": eff_memory, "eff_link": eff_link,
                 "iteration_overhead_s": overhead}
    try:
        node = build_node(model, hardware, tp, hw_overrides=overrides)
    except ValueError as exc:
        assume("does not fit" not in str(exc))
        raise
    wl = synthetic(f"n=6,prompt=uniform:16:600,output=uniform:2:24,rate={rate},seed={seed}")
    result = simulate(wl, node.setup, node.cost.latency)
    for it in result.iterations:
        assert it.latency_s >= node.cost.roofline_s(it.shape)
    s = summarize(result, node.cost)
    assert s["output_tokens_per_s"] <= s["bound"]["roofline_output_tokens_per_s"]
