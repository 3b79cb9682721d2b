"""Every family, the mixture-of-experts ones included, takes the one-call C++ decoder stack
for decode passes, and the start-up log says which path runs: nothing for a dense family, the
experts inside the stack for an MoE one."""

from __future__ import annotations

import logging

import pytest

from everystop.executor.layers.cpu_kernels import load_cpu_kernels, runnable_isas
from everystop.executor.models.decoder import Backends
from everystop.executor.models.loader import load_model

from .family_builders import MOE_SPECS, SPECS, hf_model, save_hf

FAMILIES = sorted({**SPECS, **MOE_SPECS})


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_takes_the_decoder_stack_and_the_log_says_so(name, tmp_path,
                                                                  caplog) -> None:
    spec = SPECS.get(name) or MOE_SPECS[name]
    save_hf(spec, hf_model(spec), tmp_path)
    backends = Backends(load_cpu_kernels(runnable_isas()[0]), "auto", decoder_stack=True)
    with caplog.at_level(logging.INFO, logger="everystop.executor.models.loader"):
        model = load_model(str(tmp_path), backends=backends)
    said = [r.getMessage() for r in caplog.records]
    assert model.stack_ready
    assert not any("layer by layer on the CPU kernels" in m for m in said)
    experts = [m for m in said if "decoder stack with the experts in it" in m]
    assert len(experts) == (1 if name in MOE_SPECS else 0)
    if experts:
        assert experts[0].startswith(f"{spec.name}: ")
