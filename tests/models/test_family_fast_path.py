"""Which families take the one-call C++ decoder stack for decode passes (every dense one,
Gemma 2/3 included), and that every one that does not says so by name in the start-up log,
with what the stack lacks."""

from __future__ import annotations

import logging

import pytest

from everystop.executor.layers.cpu_kernels import load_cpu_kernels, runnable_isas
from everystop.executor.models.decoder import Backends
from everystop.executor.models.loader import load_model

from .family_builders import MOE_SPECS, SPECS, hf_model, save_hf

# Where the stack lacks the family's layer: what the log must name.
LAYER_BY_LAYER = {"mixtral": ("experts",), "qwen3_moe": ("experts",)}
FAMILIES = sorted({**SPECS, **MOE_SPECS})


@pytest.mark.parametrize("name", FAMILIES)
def test_start_up_log_names_a_family_off_the_decoder_stack(name, tmp_path, caplog) -> None:
    spec = SPECS.get(name) or MOE_SPECS[name]
    save_hf(spec, hf_model(spec), tmp_path)
    backends = Backends(load_cpu_kernels(runnable_isas()[0]), "auto", decoder_stack=True)
    with caplog.at_level(logging.INFO, logger="everystop.executor.models.loader"):
        model = load_model(str(tmp_path), backends=backends)
    said = [r.getMessage() for r in caplog.records if "layer by layer" in r.getMessage()]
    family = spec.name.split("-")[0]  # phi3-longrope is Phi-3
    if name in LAYER_BY_LAYER:
        assert not model.stack_ready
        assert len(said) == 1 and said[0].startswith(f"{family}: ")
        assert all(part in said[0] for part in LAYER_BY_LAYER[name])
    else:
        assert model.stack_ready and said == []
