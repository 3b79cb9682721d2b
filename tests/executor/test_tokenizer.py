"""Tokenizer wrapper and incremental detokenization on the default model's tokenizer."""

from __future__ import annotations

import subprocess
import sys

import pytest

from everystop.tokenizer import IncrementalDetokenizer, load_tokenizer

pytestmark = pytest.mark.model

TEXT = "Hello, wörld! 😀🎉 日本語のテキスト, 中文字符, and an emoji family 👨‍👩‍👧 end."


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_roundtrip_and_properties(tok):
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert tok.vocab_size == 49152
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1
    im_end = tok.encode("<|im_end|>")
    assert len(im_end) == 1 and im_end[0] in tok.eos_token_ids
    assert load_tokenizer() is tok  # cached


def test_chat_template(tok):
    text = tok.render_chat([{"role": "user", "content": "What is 2+2?"}])
    assert "What is 2+2?" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_incremental_detokenizer_matches_full_decode(tok):
    ids = tok.encode(TEXT)
    for chunk in (1, 2, 3):
        detok = IncrementalDetokenizer(tok, prompt_ids_tail=tok.encode("Say: "))
        pieces = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
        pieces.append(detok.flush())
        assert "".join(pieces) == tok.decode(ids)
        assert all("\ufffd" not in p for p in pieces)


def test_incremental_detokenizer_holds_back_split_characters(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # byte-level BPE splits the emoji's bytes across tokens
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:1]) == ""
    assert detok.push(ids[1:]) == "😀"


def test_import_is_light():
    code = ("import sys, everystop.tokenizer; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def _long_text() -> str:
    """Over LONG_TEXT_CHARS of varied text: this repository's sources and README (code,
    indentation, CRLF-free newlines, punctuation) and the probe's unicode, spaces and
    special-token strings, shuffled word by word."""
    import random
    from pathlib import Path

    from everystop import tokenizer as module

    root = Path(module.__file__).resolve().parents[2]
    text = "".join(p.read_text() for p in sorted((root / "src/everystop/server").glob("*.py")))
    words = (module._PROBE + (root / "README.md").read_text()).split(" ")
    rng = random.Random(0)
    return text + " ".join(rng.choice(words) for _ in range(40_000))


def test_a_long_text_encoded_in_pieces_gives_the_ids_of_one_encode(tok):
    from everystop.tokenizer import LONG_TEXT_CHARS, split_points

    text = _long_text()
    assert len(text) > 4 * LONG_TEXT_CHARS and tok._can_split()
    assert len(split_points(text, 1 << 15)) > 4
    whole = list(tok.hf_tokenizer.encode(text, add_special_tokens=False))
    assert tok.encode(text) == whole
    assert tok.encode(text, add_special_tokens=True) == list(
        tok.hf_tokenizer.encode(text, add_special_tokens=True))


def test_pieces_are_refused_when_a_cut_would_change_the_ids(tok, monkeypatch):
    import re

    from everystop import tokenizer as module
    from everystop.tokenizer import Tokenizer

    # Cutting after any newline splits "\r\n" apart before a word (GPT-2's `\s+(?!\S)`):
    # the probe catches it and the tokenizer keeps encoding whole.
    monkeypatch.setattr(module, "_SPLIT_POINT", re.compile(r"(?<=\S)(?= [^\W\d_])|(?<=\n)"))
    fresh = Tokenizer(tok.hf_tokenizer)
    assert not fresh._can_split()
    text = "line one\r\nline two " * 5000
    assert fresh.encode(text) == list(tok.hf_tokenizer.encode(text, add_special_tokens=False))


def test_special_tokens_wrap_a_long_text_as_one_encode_wraps_it(tok):
    import copy

    from tokenizers.processors import TemplateProcessing

    from everystop.tokenizer import Tokenizer

    hf = copy.deepcopy(tok.hf_tokenizer)
    start, end = hf.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    hf.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A <|im_end|>",
        special_tokens=[("<|im_start|>", start), ("<|im_end|>", end)])
    wrapped = Tokenizer(hf)
    text = _long_text()
    assert wrapped._can_split() and wrapped._special_wrap == ([start], [end])
    assert wrapped.encode(text, add_special_tokens=True) == list(
        hf.encode(text, add_special_tokens=True))


def test_special_tokens_are_skipped_or_kept_spaced_apart_as_asked() -> None:
    tok = load_tokenizer()
    end = tok.encode("<|im_end|>")
    assert len(end) == 1 and end[0] in tok.special_token_ids
    ids = tok.encode("Hi") + end + tok.encode("there")

    def stream(**options: bool) -> str:
        detok = IncrementalDetokenizer(tok, **options)
        return "".join(detok.push([t]) for t in ids) + detok.flush()

    assert stream() == "Hithere"
    assert stream(skip_special_tokens=False) == "Hi <|im_end|> there"
    assert stream(skip_special_tokens=False, spaces_between_special_tokens=False) == \
        "Hi<|im_end|>there"


def test_the_cached_copy_loads_as_converted_without_parsing_its_json_in_python(
        tmp_path, monkeypatch):
    """The converted copy on disk names its added tokens in tokenizer_config.json, so loading
    it leaves tokenizer.json to the Rust parser (the Python parse cost ~20 MiB of start-up
    peak); what loads is the tokenizer the conversion made."""
    import json
    from pathlib import Path

    from everystop import tokenizer as module
    from everystop.config import CACHE_ENV
    from everystop.executor.models.loader import default_model_path

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    converted = module._from_gguf(default_model_path())
    parsed: list[str] = []
    real_load = json.load

    def spy(f, *args, **kwargs):
        parsed.append(Path(getattr(f, "name", "")).name)
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(json, "load", spy)
    cached = module._from_gguf(default_model_path())
    assert "tokenizer.json" not in parsed and "tokenizer_config.json" in parsed
    assert cached.added_tokens_decoder == converted.added_tokens_decoder
    assert cached.all_special_ids == converted.all_special_ids
    assert cached.special_tokens_map == converted.special_tokens_map
    assert cached.get_vocab() == converted.get_vocab()
    assert cached.chat_template == converted.chat_template
    text = TEXT + " <|im_start|>user\nhi<|im_end|> <|endoftext|>"
    for special in (False, True):
        ids = converted.encode(text, add_special_tokens=special)
        assert cached.encode(text, add_special_tokens=special) == ids
        for skip in (False, True):
            assert cached.decode(ids, skip_special_tokens=skip) == \
                converted.decode(ids, skip_special_tokens=skip)
