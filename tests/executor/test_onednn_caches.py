"""oneDNN's caches of compiled GEMMs are bounded (unbounded, a soak's malloc'd memory grows with
every new batch shape): the setting, its route from the CLI, and its effect on a process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from everystop.config import ConfigError, ModelConfig
from everystop.engine.args import add_engine_args, engine_config_from_args
from everystop.executor.onednn_caches import (
    CAPACITY_VARIABLES,
    DEFAULT_CAPACITY,
    bound_onednn_caches,
)


@pytest.fixture
def clean_env(monkeypatch):
    for name in CAPACITY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_default_bound_yields_to_the_environment_and_a_capacity_overrides_it(
        clean_env, monkeypatch):
    assert bound_onednn_caches() == dict.fromkeys(CAPACITY_VARIABLES, str(DEFAULT_CAPACITY))
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "200")
    assert bound_onednn_caches()["LRU_CACHE_CAPACITY"] == "200"  # the user's own setting
    assert bound_onednn_caches(32) == dict.fromkeys(CAPACITY_VARIABLES, "32")
    with pytest.raises(ValueError):
        bound_onednn_caches(0)


def test_flag_reaches_the_model_config():
    import argparse
    args = add_engine_args(argparse.ArgumentParser()).parse_args(["--onednn-cache-capacity", "9"])
    assert engine_config_from_args(args).model.onednn_cache_capacity == 9
    with pytest.raises(ConfigError, match="onednn_cache_capacity"):
        ModelConfig(onednn_cache_capacity=0)


@pytest.mark.model
def test_model_runner_applies_the_bound_before_loading(default_runner, monkeypatch, clean_env):
    from everystop.config import CacheConfig
    from everystop.executor.model_runner import ModelRunner

    ModelRunner(ModelConfig(onednn_cache_capacity=37), CacheConfig(num_gpu_blocks_override=8),
                max_model_len=64)  # the model is shared with default_runner: no second load
    assert {name: os.environ[name] for name in CAPACITY_VARIABLES} == dict.fromkeys(
        CAPACITY_VARIABLES, "37")


# A fresh process (the variables are read once, at first use): torch imported first, as in the
# server, then the bound, then 256 GEMM shapes never seen before. Unbounded, each keeps a
# compiled primitive of ~0.3-0.45 MiB alive (~100 MiB here); bounded to 8, a few MiB.
_NEW_SHAPES = textwrap.dedent("""
    import ctypes, torch
    from everystop.executor.onednn_caches import bound_onednn_caches
    bound_onednn_caches(8)
    libc = ctypes.CDLL("libc.so.6")
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
                    "keepcost".split()]
    libc.mallinfo2.restype = Info
    def in_use():
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd
    torch.set_num_threads(1)
    weights = [torch.randn(960, 576), torch.randn(3072, 576)]
    gemm = torch.ops.mkldnn._linear_pointwise
    with torch.inference_mode():
        for w in weights:
            gemm(torch.randn(300, 576), w, None, "none", [], "")
        before = in_use()
        for rows in range(9, 137):
            for w in weights:
                gemm(torch.randn(rows, 576), w, None, "none", [], "")
        print((in_use() - before) / 2**20)
""")


def test_new_gemm_shapes_do_not_grow_a_bounded_process(clean_env):
    import torch
    if not torch.backends.mkldnn.is_available():
        pytest.fail("torch without oneDNN: the prefill GEMMs this bounds are not in use")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _NEW_SHAPES], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    grown_mib = float(out.stdout.strip().splitlines()[-1])
    assert grown_mib < 16, f"malloc'd memory grew {grown_mib:.1f} MiB over 256 new GEMM shapes"
