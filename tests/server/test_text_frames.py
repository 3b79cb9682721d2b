"""The template-built SSE frame of a text-only chunk is byte for byte the long way's."""

from __future__ import annotations

import time
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from everystop.server.formatting import ChatFormat, CompletionFormat, Format
from everystop.server.streaming import sse

# Line separators JSON leaves raw, quotes, backslashes, control characters, astral characters.
TRICKY = st.text(st.sampled_from(list("a \"\\\n\t\x00\x1f\x7f\x85\u2028\u2029é€😀</")) |
                 st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=24)


def _long_way(fmt: Format, index: int, text: str) -> bytes:
    return sse(fmt.body([fmt.chunk_choice(index, text, None, None, False)], None, chunk=True))


def _formats(model: str) -> list[Format]:
    return [CompletionFormat(model, None), ChatFormat(model, None),
            ChatFormat(model, None, echo="Once upon")]


@settings(max_examples=150, deadline=None)
@given(text=TRICKY, index=st.integers(0, 3))
def test_text_frame_matches_the_long_way(text: str, index: int) -> None:
    with mock.patch("time.time", return_value=1_700_000_000.5):  # one `created` for both
        for fmt in _formats("default-model\u2028x\"y"):
            assert fmt.text_frame(index, text) == _long_way(fmt, index, text)


def test_text_frame_follows_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """`created` is the second the chunk is sent, as the long way's."""
    now = [1_700_000_000.2]
    monkeypatch.setattr(time, "time", lambda: now[0])
    fmt = CompletionFormat("m", None)
    first = fmt.text_frame(0, "a")
    now[0] += 1.0
    later = fmt.text_frame(0, "a")
    assert first is not None and b'"created":1700000000,' in first
    assert later == _long_way(fmt, 0, "a") and b'"created":1700000001,' in later


@mock.patch("time.time", lambda: 1_700_000_000.5)
def test_no_frame_where_the_shape_differs() -> None:
    chat = ChatFormat("m", None)
    assert chat.text_frame(0, "") is None  # an empty delta has no content key
    assert ChatFormat("m", None, tool_names={"get_weather"}).text_frame(0, "x") is None
    # A model named as the template's marker: the body cannot be cut, the long way instead.
    assert CompletionFormat("\x00everystop-text\x00", None).text_frame(0, "x") is None
    near = CompletionFormat("a\x00everystop-text\x00b", None)
    assert near.text_frame(0, "x") == _long_way(near, 0, "x")
