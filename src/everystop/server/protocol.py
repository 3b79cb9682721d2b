"""The OpenAI request bodies we accept (pydantic, strict types) and the response shapes we send.

Parsing is strict on purpose: a string where a number belongs is a client bug, answered with
400 rather than silently coerced. So is a field we do not honour: it gets a 400 naming it
(`fields.py` lists the few that are safe to ignore), never a quietly different answer.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from everystop.server.errors import APIError, bad_request
from everystop.server.fields import reason, strip_accepted

NonNegInt = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Scheduling tier: 0 premium, 1 standard, 2 best-effort.
    priority: int = Field(default=1, ge=0, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # vLLM's extras, honoured by the sampler.
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(default=None, ge=0)
    logit_bias: dict[str, float] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompt field normalised to a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # accepted; the chat template has no place for it

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"text content only: a {kind!r} content part is not "
                                     "supported")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[NonNegInt]


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Bytes -> a validated request, or an APIError(400) naming the offending field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        req = model.model_validate(strip_accepted(data))
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ())]
        param = loc[0] if loc else None
        detail = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        kind = str(err.get("type", ""))
        if kind == "extra_forbidden":
            raise APIError(400, f"{'.'.join(loc)}: {reason(loc[-1])}", param=param,
                           code="unsupported_parameter") from None
        code = ("missing_required_parameter" if kind == "missing" else
                "invalid_type" if kind.endswith(("_type", "_parsing")) or "union" in kind
                else "invalid_value")
        raise APIError(400, f"{'.'.join(loc) or 'body'}: {detail}", param=param,
                       code=code) from None
    return req


# -- responses ----------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now_s() -> int:
    return int(time.time())


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_body(rid: str, model: str, choices: list[dict[str, Any]],
                    usage: dict[str, Any] | None, *, chunk: bool = False) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": now_s(), "model": model,
            "choices": choices, **({"usage": usage} if usage is not None or not chunk else {})}


def chat_body(rid: str, model: str, choices: list[dict[str, Any]],
              usage: dict[str, Any] | None, *, chunk: bool = False) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": now_s(), "model": model, "choices": choices,
            **({"usage": usage} if usage is not None or not chunk else {})}


def model_info(model: str, max_model_len: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": now_s(), "owned_by": "everystop",
            "max_model_len": max_model_len}


def model_list(model: str, max_model_len: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_info(model, max_model_len)]}
