"""`everystop serve` refuses a speculative configuration it cannot run at start-up, in one line
naming the option (exit 2, no traceback, no server): K out of range, a draft whose tokenizer
differs from the target's, a draft with more parameters than the target."""

from __future__ import annotations

from pathlib import Path

import pytest

from everystop.cli import main

from ..bench.test_speculative_bench import tiny_llama


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_llama(tmp_path_factory.mktemp("startup") / "target.gguf", layers=1, kind="f16")


def _refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    try:
        code = main(["serve", "--port", "0", *argv])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Uvicorn running" not in err
    return err


@pytest.mark.parametrize("k", ["0", "33"])
def test_k_out_of_range_is_refused_by_name(target: str, k: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    err = _refusal(capsys, "--model", target, "--speculative", "ngram",
                   "--num-speculative-tokens", k)
    assert "num_speculative_tokens must be 1 .. 32" in err


def test_a_draft_with_another_tokenizer_is_refused_by_name(
        target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The same shape, but its vocabulary padded with 32 tokens the target does not have.
    draft = tiny_llama(tmp_path / "draft.gguf", layers=1, kind="q8_0", extra_tokens=32)
    err = _refusal(capsys, "--model", target, "--speculative", f"draft:{draft}")
    assert "cannot start: speculative: the draft model's tokenizer differs" in err


def test_a_draft_larger_than_the_target_is_refused_by_name(
        target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    draft = tiny_llama(tmp_path / "draft.gguf", layers=3, kind="q8_0")
    err = _refusal(capsys, "--model", target, "--speculative", f"draft:{draft}")
    assert "cannot start: speculative: the draft model has more parameters" in err
