"""The design's KV arithmetic, reproduced from the spec files and checked by hand."""

import pytest

from everystop.sim.capacity import design_capacity_table, design_seq_division, kv_capacity
from everystop.sim.specs import load_hardware, load_model

M70 = load_model("llama-3-70b")
A100 = load_hardware("a100-80gb")


def test_kv_bytes_per_token_matches_design():
    # 2 KV heads/GPU * 128 dim * 2 bytes * 80 layers * 2 (K+V) = 81,920 bytes/GPU/token
    cap = kv_capacity(M70, A100, 4)
    assert cap.kv_bytes_per_token_per_gpu == 2 * 128 * 2 * 80 * 2 == 81_920
    assert cap.kv_bytes_per_token == 4 * 81_920
    assert cap.block_bytes == 16 * 327_680 == 5_242_880


def test_exact_capacity_with_design_inputs():
    # 0.90 * 80e9 * 4 = 288e9; - 140e9 weights - 8e9 reserve = 140e9 bytes of KV
    cap = kv_capacity(M70, A100, 4, weight_bytes=140e9)
    assert cap.usable_bytes == pytest.approx(288e9)
    assert cap.kv_budget_bytes == pytest.approx(140e9)
    assert cap.num_blocks == 140_000_000_000 // 5_242_880 == 26_702
    assert cap.max_seqs(2048) == 26_702 // 128 == 208


def test_design_rounding_reproduces_the_design_figures():
    cap = kv_capacity(M70, A100, 4, weight_bytes=140e9, design_rounding=True)
    assert cap.block_bytes == pytest.approx(5.12e6)  # "5.12 MB"
    assert cap.num_blocks == 27_343  # "~27,340 blocks" = 140e9 / 5.12e6
    assert cap.max_seqs(2048) == 213  # consistent with those blocks
    assert design_seq_division(cap, 2048) == pytest.approx(140 * 1024 / 655.36)  # "~218"
    assert int(design_seq_division(cap, 2048)) == 218


def test_real_parameter_count_and_table():
    assert M70.num_params == pytest.approx(70.55e9, rel=1e-3)
    rows = design_capacity_table(M70, A100, 4)
    assert [r["num_blocks"] for r in rows] == [27_343, 26_702,
                                                int((288e9 - M70.weight_bytes - 8e9) // 5_242_880)]
    assert rows[2]["max_seqs"] == rows[2]["num_blocks"] // 128


def test_capacity_scales_with_memory_and_tp():
    small = kv_capacity(M70, load_hardware("a100-40gb"), 4)
    assert small.num_blocks < kv_capacity(M70, A100, 4).num_blocks < \
        kv_capacity(M70, A100, 8).num_blocks
    # 0.9 * 40e9 * 4 = 144e9 barely holds the weights: almost nothing left for KV.
    assert small.num_blocks == max(0, int((144e9 - M70.weight_bytes - 8e9) // 5_242_880))
