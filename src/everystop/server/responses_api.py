"""/v1/responses: the Responses API's stateless subset (text and message input, function tools,
structured output, streaming in its event shapes), served as a chat completion and reshaped.

Nothing is stored: `store: true`, `previous_response_id`, `background`, reasoning and
non-text input are refused by name. The request becomes a `ChatCompletionRequest` (instructions
as the system turn, function_call / function_call_output items as assistant tool calls and tool
turns), so sampling, tools and grammars behave exactly as on /v1/chat/completions.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import Field, model_validator

from everystop.server.errors import bad_request
from everystop.server.protocol import (
    ChatCompletionRequest,
    StrictModel,
    new_id,
    now_s,
    parse_body,
)
from everystop.server.streaming import SSEResponse


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool | None = None  # stateless: only false (or unset) is honoured
    metadata: dict[str, str] | None = None  # echoed back, as OpenAI does
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    # Declared to be refused with a reason (a stateless server cannot honour them).
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    reasoning: Any = None

    @model_validator(mode="after")
    def _stateless(self) -> ResponsesRequest:
        for field, why in _REFUSED:
            if getattr(self, field) not in (None, False):
                raise ValueError(f"{field}: {why}")
        return self


_REFUSED = (
    ("store", "responses are not stored here; send store: false"),
    ("previous_response_id", "responses are not stored (send the whole conversation as input)"),
    ("conversation", "conversations are not stored (send the whole conversation as input)"),
    ("background", "background responses are not supported"),
    ("reasoning", "this model has no reasoning mode"))


def chat_body(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completion request that computes `req`."""
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req),
                            "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    for ours, theirs in (("max_output_tokens", "max_completion_tokens"),
                         ("temperature", "temperature"), ("top_p", "top_p"),
                         ("parallel_tool_calls", "parallel_tool_calls"), ("user", "user")):
        value = getattr(req, ours)
        if value is not None:
            body[theirs] = value
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(
            exclude_none=True, exclude={"type"})} for t in req.tools]
    if isinstance(req.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "output", "schema": fmt.schema_ or {}}}
    return body


def parse_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    chat: ChatCompletionRequest = parse_body(json.dumps(chat_body(req)).encode(),
                                             ChatCompletionRequest)
    return chat


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for item in req.input:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function", "function": {
                "name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else
                             json.dumps(output)})
        else:
            raise bad_request(f"input: items of type {kind!r} are not supported (messages, "
                              "function_call and function_call_output are)", "input")
    return messages


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("input: a message's content is text or a list of text parts",
                          "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise bad_request(f"input: content parts of type {kind!r} are not supported "
                              "(text only)", "input")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


# -- the response ---------------------------------------------------------------------------------

class ResponseBuilder:
    """The response object and its output items, from a chat completion's message (whole) or
    its chunks (streamed), in the Responses API's shapes."""

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.req, self.model = req, model
        self.id, self.created = new_id("resp"), now_s()
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None

    def body(self, status: str) -> dict[str, Any]:
        req = self.req
        incomplete = status == "incomplete"
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) \
            if req.text and req.text.format else {"type": "text"}
        choice: Any = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction) \
            else (req.tool_choice or "auto")
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "model": self.model, "output": self.output,
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": None, "store": False,
                "temperature": 1.0 if req.temperature is None else req.temperature,
                "top_p": 1.0 if req.top_p is None else req.top_p,
                "text": {"format": fmt}, "tool_choice": choice,
                "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
                "truncation": "disabled", "usage": self.usage, "user": req.user,
                "metadata": req.metadata or {}}

    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def take_usage(self, usage: dict[str, Any] | None) -> None:
        if usage is not None:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            self.usage = {"input_tokens": usage["prompt_tokens"],
                          "input_tokens_details": {"cached_tokens": cached},
                          "output_tokens": usage["completion_tokens"],
                          "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": usage["total_tokens"]}

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        choice = chat["choices"][0]
        message = choice["message"]
        self.finish_reason = choice.get("finish_reason")
        self.take_usage(chat.get("usage"))
        if message.get("content"):
            self.output.append(message_item(new_id("msg"), message["content"], "completed"))
        for call in message.get("tool_calls") or []:
            self.output.append(call_item(new_id("fc"), call["id"], call["function"]["name"],
                                         call["function"]["arguments"], "completed"))
        return self.body(self.status())


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]
            if status == "completed" else []}


def call_item(item_id: str, call_id: str, name: str, arguments: str,
              status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


# -- streaming ------------------------------------------------------------------------------------

class _EventStream:
    """Chat completion chunks in, Responses API events out (each with its sequence number)."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.b = builder
        self.seq = 0
        self.text_item: dict[str, Any] | None = None
        self.text = ""
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    def start(self) -> list[bytes]:
        return [self.event("response.created", response=self.b.body("in_progress")),
                self.event("response.in_progress", response=self.b.body("in_progress"))]

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        self.b.take_usage(chunk.get("usage"))
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call_delta(call)
            if choice.get("finish_reason"):
                self.b.finish_reason = choice["finish_reason"]
        return out

    def _text_delta(self, piece: str) -> list[bytes]:
        out = []
        if self.text_item is None:
            self.text_item = message_item(new_id("msg"), "", "in_progress")
            self.b.output.append(self.text_item)
            out += [self.event("response.output_item.added", output_index=self._index(
                        self.text_item), item=self.text_item),
                    self.event("response.content_part.added", item_id=self.text_item["id"],
                               output_index=self._index(self.text_item), content_index=0,
                               part={"type": "output_text", "text": "", "annotations": []})]
        self.text += piece
        out.append(self.event("response.output_text.delta", item_id=self.text_item["id"],
                              output_index=self._index(self.text_item), content_index=0,
                              delta=piece, logprobs=[]))
        return out

    def _call_delta(self, call: dict[str, Any]) -> list[bytes]:
        out = []
        item = self.calls.get(call.get("index", 0))
        fn = call.get("function") or {}
        if item is None:
            item = call_item(new_id("fc"), call.get("id") or new_id("call"), fn.get("name", ""),
                             "", "in_progress")
            self.calls[call.get("index", 0)] = item
            self.b.output.append(item)
            out.append(self.event("response.output_item.added",
                                  output_index=self._index(item), item=dict(item)))
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self._index(item), delta=fn["arguments"]))
        return out

    def finish(self) -> list[bytes]:
        out = []
        if self.text_item is not None:
            index = self._index(self.text_item)
            part = {"type": "output_text", "text": self.text, "annotations": []}
            self.text_item.update(message_item(self.text_item["id"], self.text, "completed"))
            out += [self.event("response.output_text.done", item_id=self.text_item["id"],
                               output_index=index, content_index=0, text=self.text,
                               logprobs=[]),
                    self.event("response.content_part.done", item_id=self.text_item["id"],
                               output_index=index, content_index=0, part=part),
                    self.event("response.output_item.done", output_index=index,
                               item=self.text_item)]
        for item in self.calls.values():
            item["status"] = "completed"
            index = self._index(item)
            out += [self.event("response.function_call_arguments.done", item_id=item["id"],
                               output_index=index, arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=index, item=item)]
        status = self.b.status()
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        out.append(self.event(kind, response=self.b.body(status)))
        return out

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, x in enumerate(self.b.output) if x is item)


def stream(builder: ResponseBuilder, chat_sse: SSEResponse) -> SSEResponse:
    """The chat completion's SSE frames re-emitted as Responses API events."""
    events = _EventStream(builder)

    async def frames() -> AsyncIterator[bytes]:
        chat = chat_sse.body_iterator
        try:
            for b in events.start():
                yield b
            pending = b""
            async for raw in chat:
                pending += raw if isinstance(raw, bytes) else str(raw).encode()
                while b"\n\n" in pending:
                    frame, pending = pending.split(b"\n\n", 1)
                    data = frame.decode().removeprefix("data: ")
                    if data == "[DONE]":
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        yield events.event("error", code=chunk["error"].get("code"),
                                           message=chunk["error"].get("message"), param=None)
                        return
                    for b in events.chunk(chunk):
                        yield b
            for b in events.finish():
                yield b
        finally:
            # A client that leaves (or an error event) closes the chat stream too: its own
            # cleanup aborts the engine requests and frees their blocks.
            aclose = getattr(chat, "aclose", None)
            if aclose is not None:
                await aclose()

    return SSEResponse(frames())
