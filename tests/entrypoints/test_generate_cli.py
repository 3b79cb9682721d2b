"""`everystop generate` on the default model, and its one-line errors on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.model


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "everystop", "generate", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_answers_capital_of_france() -> None:
    res = _run("Tell me the capital of France.", "--max-tokens", "24")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


def _assert_one_line_error(res: subprocess.CompletedProcess, fragment: str) -> None:
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr  # one clear line, no traceback
    assert lines[0].startswith("everystop: error:") and fragment in lines[0].lower(), lines[0]


def test_missing_model_path(tmp_path) -> None:
    _assert_one_line_error(_run("hi", "--model", str(tmp_path / "nope.gguf")), "does not exist")


def test_corrupt_gguf(tmp_path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(os.urandom(4096))
    _assert_one_line_error(_run("hi", "--model", str(bad)), "gguf")


def test_unsupported_architecture(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    _assert_one_line_error(_run("hi", "--model", str(tmp_path)), "gpt2")


def test_inconsistent_flags() -> None:
    res = _run("hi", "--max-num-seqs", "256", "--max-num-batched-tokens", "64")
    assert res.returncode == 2 and "max_num_batched_tokens" in res.stderr
    assert "Traceback" not in res.stderr
