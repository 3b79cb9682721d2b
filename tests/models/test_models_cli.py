"""`everystop models` lists every registered family with the names it accepts and its decode
path."""

from __future__ import annotations

from everystop.cli import main
from everystop.executor.models.registry import FAMILIES


def _sections(out: str) -> dict[str, str]:
    """Family name -> its indented lines."""
    sections: dict[str, str] = {}
    for line in out.splitlines():
        if line and not line.startswith(" "):
            current = line
            sections[current] = ""
        else:
            sections[current] += line + "\n"
    return sections


def test_lists_every_family_and_its_names(capsys) -> None:
    assert main(["models"]) == 0
    sections = _sections(capsys.readouterr().out)
    assert list(sections) == [f.name for f in FAMILIES]
    for family in FAMILIES:
        for name in (*family.hf_architectures, *family.gguf_architectures):
            assert name in sections[family.name]
    assert "decode: decoder stack" in sections["qwen2"] and "q/k/v bias" in sections["qwen2"]
    assert "paged attention (window)" in sections["mistral"]
    assert "decode: decoder stack" in sections["gemma3"] and "GeGLU" in sections["gemma3"]
    for moe in ("qwen3_moe", "mixtral"):
        assert "decode: decoder stack with the experts in it" in sections[moe]


def test_a_llama_gguf_is_claimed_by_its_experts_or_its_window() -> None:
    from everystop.executor.models.registry import family_for_gguf

    def family(**fields: int) -> str:
        return family_for_gguf("llama", "f.gguf", fields).name

    assert family() == "llama"
    assert family(**{"llama.attention.sliding_window": 4096}) == "mistral"
    assert family(**{"llama.expert_count": 8}) == "mixtral"
    assert family(**{"llama.expert_count": 8, "llama.attention.sliding_window": 4096}) == "mixtral"
