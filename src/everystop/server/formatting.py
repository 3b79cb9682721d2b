"""Engine outputs -> OpenAI JSON: completion and chat choices, deltas and logprobs."""

from __future__ import annotations

from typing import Any

from everystop.core.outputs import TokenLogprob
from everystop.server import protocol
from everystop.server.streaming import TextFrames
from everystop.server.tool_stream import ToolCallStream
from everystop.server.tools import parse_tool_calls


class _Tokens:
    """Token id -> text, for logprob entries (cached: the same ids recur constantly); with
    `as_ids` (vLLM's return_tokens_as_token_ids) "token_id:N", which survives tokens that are
    not whole characters."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}
        self.as_ids = False

    def __call__(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        s = self._cache.get(token_id)
        if s is None:
            s = self._tok.decode([token_id])
            if len(self._cache) < 65536:
                self._cache[token_id] = s
        return s


def prompt_logprobs(token_text: _Tokens, prompt_ids: list[int],
                    scored: list[TokenLogprob] | None) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first has none), its own entry and the
    top alternatives, keyed by token id; `rank` is given for the top ones."""
    out: list[dict[str, Any] | None] = [None]
    for tid, e in zip(prompt_ids[1:], scored or []):
        entry = {str(t): {"logprob": v, "rank": r, "decoded_token": token_text(t)}
                 for r, (t, v) in enumerate(e.top, 1)}
        entry.setdefault(str(tid), {"logprob": e.logprob, "decoded_token": token_text(tid)})
        out.append(entry)
    return out


class CompletionFormat:
    """/v1/completions: choices carry `text`; logprobs in the legacy four-list form."""

    kind = "completion"

    def __init__(self, model: str, tokenizer: Any) -> None:
        self.model = model
        self.id = protocol.new_id("cmpl")
        self.token_text = _Tokens(tokenizer)
        self._frames: dict[int, TextFrames] = {}

    def text_frame(self, index: int, text: str) -> bytes | None:
        """The SSE frame of choice `index`'s text-only chunk past its first (None: build it
        with chunk_choice and body)."""
        return _text_frame(self, self._frames, index, text)

    def logprobs(self, lps: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
        tokens, offsets = [], []
        for lp in lps:
            s = self.token_text(lp.token_id)
            tokens.append(s)
            offsets.append(text_offset)
            text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in lps],
                "text_offset": offsets}

    def with_echo(self, prompt: str, prompt_ids: list[int], scored: list[TokenLogprob] | None,
                  text: str, logprobs: dict[str, Any] | None
                  ) -> tuple[str, dict[str, Any] | None]:
        """Prepend the prompt (echo) to a choice's text and, with logprobs, its tokens' entries:
        the first token has none (no prefix), as OpenAI's legacy completions answer."""
        if logprobs is None:
            return prompt + text, None
        scored = list(scored or [])
        entries: list[TokenLogprob | None] = [None] + scored
        entries += [None] * (len(prompt_ids) - len(entries))
        head = self.logprobs([], 0)
        offset = 0
        for tid, e in zip(prompt_ids, entries):
            s = self.token_text(tid)
            head["tokens"].append(s)
            head["text_offset"].append(offset)
            offset += len(s)
            head["token_logprobs"].append(None if e is None else e.logprob)
            head["top_logprobs"].append(
                None if e is None else {self.token_text(t): v for t, v in e.top})
        return prompt + text, {k: head[k] + logprobs[k] for k in head}

    def chunk_choice(self, index: int, text: str, logprobs: dict[str, Any] | None,
                     finish_reason: str | None, first: bool) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def final_choice(self, index: int, text: str, logprobs: dict[str, Any] | None,
                     finish_reason: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def body(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None, *,
             chunk: bool) -> dict[str, Any]:
        return protocol.completion_body(self.id, self.model, choices, usage, chunk=chunk)


class ChatFormat:
    """/v1/chat/completions: `message` / `delta` objects; logprobs as `content` entries."""

    kind = "chat"

    def __init__(self, model: str, tokenizer: Any, tool_names: set[str] | None = None,
                 parallel_tool_calls: bool = True, echo: str = "") -> None:
        self.model = model
        self.echo = echo  # vLLM's chat echo: the continued turn's text, before each reply
        self.id = protocol.new_id("chatcmpl")
        self.token_text = _Tokens(tokenizer)
        self.tool_names = tool_names
        self.parallel_tool_calls = parallel_tool_calls
        self._frames: dict[int, TextFrames] = {}
        # With tools, each streamed choice's text goes through a ToolCallStream: content and
        # call argument deltas as they are generated.
        self._streams: dict[int, ToolCallStream] = {}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        s = self.token_text(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    def logprobs(self, lps: list[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
                            for lp in lps]}

    def chunk_choice(self, index: int, text: str, logprobs: dict[str, Any] | None,
                     finish_reason: str | None, first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
        if text and not first:
            delta["content"] = text
        if self.tool_names is not None:
            stream = self._streams.setdefault(
                index, ToolCallStream(self.tool_names, self.parallel_tool_calls))
            pieces = stream.feed(text)
            if finish_reason is not None:
                self._streams.pop(index)
                for key, value in stream.finish().items():
                    pieces[key] = pieces.get(key, "" if key == "content" else []) + value
                if stream.calls and finish_reason == "stop":
                    finish_reason = "tool_calls"
            delta = {"role": "assistant"} if first else {}
            if "content" in pieces or first:
                delta["content"] = pieces.get("content") or (
                    "" if stream.mode == "content" else None)
            if "tool_calls" in pieces:
                delta["tool_calls"] = pieces["tool_calls"]
        if first and self.echo:
            delta["content"] = self.echo + (delta.get("content") or "")
        return {"index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def text_frame(self, index: int, text: str) -> bytes | None:
        """As CompletionFormat's; None with tools (the text goes through a ToolCallStream)."""
        if self.tool_names is not None:
            return None
        return _text_frame(self, self._frames, index, text)

    def final_choice(self, index: int, text: str, logprobs: dict[str, Any] | None,
                     finish_reason: str | None) -> dict[str, Any]:
        message, finish_reason = self._message(text, finish_reason)
        if self.echo:
            message["content"] = self.echo + (message["content"] or "")
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def _message(self, text: str, finish_reason: str | None
                 ) -> tuple[dict[str, Any], str | None]:
        calls = parse_tool_calls(text, self.tool_names) if self.tool_names else None
        if calls is not None and not self.parallel_tool_calls:
            calls = calls[:1]  # parallel_tool_calls=false: at most one call per turn
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return {"role": "assistant", "content": None, "tool_calls": calls}, reason

    def body(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None, *,
             chunk: bool) -> dict[str, Any]:
        return protocol.chat_body(self.id, self.model, choices, usage, chunk=chunk)


Format = CompletionFormat | ChatFormat


def _text_frame(fmt: Format, frames: dict[int, TextFrames], index: int,
                text: str) -> bytes | None:
    """`sse(fmt.body([fmt.chunk_choice(index, text, None, None, False)], None, chunk=True))`,
    from a template kept per choice. Empty text has a shape of its own (chat: no content)."""
    if not text:
        return None
    template = frames.get(index)
    if template is None:
        def build(t: str) -> dict[str, Any]:
            return fmt.body([fmt.chunk_choice(index, t, None, None, False)], None, chunk=True)
        template = frames[index] = TextFrames(build)
    return template.frame(text)
