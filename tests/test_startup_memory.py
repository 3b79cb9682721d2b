"""Start-up checkpoints: this process's memory and age at named stages, logged as one line
that `everystop bench startup` parses back."""

from __future__ import annotations

import logging
import mmap

import pytest

from everystop import startup_memory


def test_a_checkpoint_records_the_memory_a_stage_grew() -> None:
    startup_memory.checkpoint("before")
    # Fresh anonymous pages, each written so resident (malloc might reuse pages a long test
    # worker already holds resident).
    grown = mmap.mmap(-1, 64 * 2**20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    grown.write(b"\x01" * (64 * 2**20))
    startup_memory.checkpoint("after")
    before, after = startup_memory.stages()[-2:]
    assert (before["stage"], after["stage"]) == ("before", "after")
    assert after["rss_bytes"] - before["rss_bytes"] >= 60 * 2**20
    assert after["anon_bytes"] - before["anon_bytes"] >= 60 * 2**20
    assert after["peak_rss_bytes"] >= after["rss_bytes"]
    assert 0 < before["t_s"] <= after["t_s"]
    grown.close()


def test_the_logged_line_parses_back_to_the_stages(caplog: pytest.LogCaptureFixture) -> None:
    startup_memory.checkpoint("ready")
    with caplog.at_level(logging.DEBUG, logger=startup_memory.__name__):
        startup_memory.log_stages()
    text = "noise before\n" + caplog.text + "noise after\n"
    assert startup_memory.parse_stages(text) == startup_memory.stages()
    assert startup_memory.parse_stages("no such line\n") == []


def test_nothing_is_logged_above_debug(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=startup_memory.__name__):
        startup_memory.log_stages()
    assert startup_memory.LOG_PREFIX not in caplog.text
