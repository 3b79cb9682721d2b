"""Spec files load, every figure carries a source, parameter counts come out right."""

import json

import pytest

from everystop.sim.specs import SPEC_DIR, hardware_keys, load_hardware, load_model, model_keys


def test_all_required_specs_present():
    assert {"a100-40gb", "a100-80gb", "h100-sxm", "h200"} <= set(hardware_keys())
    assert {"llama-3-8b", "llama-3-70b", "smollm2-135m"} <= set(model_keys())


@pytest.mark.parametrize("name", ["hardware.json", "models.json"])
def test_every_figure_has_a_source(name):
    data = json.loads((SPEC_DIR / name).read_text())
    for key, entry in data.items():
        if key.startswith("_"):
            continue
        for fig, value in entry.items():
            if fig == "name":
                continue
            assert isinstance(value, dict) and set(value) == {"value", "source"}, (key, fig)
            assert len(value["source"]) > 10, (key, fig)


def test_all_load_with_sane_values():
    for key in hardware_keys():
        hw = load_hardware(key)
        assert hw.peak_flops > 1e14 and hw.hbm_bandwidth > 1e12 and hw.hbm_bytes >= 40e9
        assert 0 < hw.eff_compute <= 1 and 0 < hw.eff_memory <= 1
        assert hw.sources["peak_flops"] and hw.sources["eff_memory"].startswith("assumption")
    for key in model_keys():
        m = load_model(key)
        assert m.num_heads * m.head_dim == m.hidden_size
        assert m.sources["num_kv_heads"]


def test_parameter_counts_derived_from_shapes():
    assert load_model("llama-3-8b").num_params == pytest.approx(8.03e9, rel=2e-3)
    assert load_model("llama-3-70b").num_params == pytest.approx(70.55e9, rel=2e-3)
    assert load_model("smollm2-135m").num_params == pytest.approx(134.5e6, rel=5e-3)


def test_unknown_keys_raise():
    with pytest.raises(KeyError):
        load_hardware("tpu-v9")
    with pytest.raises(KeyError):
        load_model("gpt-5")
