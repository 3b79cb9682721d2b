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

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from everystop.sampling_params import StructuredOutput
from everystop.server.errors import APIError, bad_request
from everystop.server.fields import reason, strip_accepted, strip_message_bookkeeping
from everystop.server.limits import RequestLimits, check_token_ids, loads
from everystop.server.tools import tool_constraint

NonNegInt = Annotated[int, Field(ge=0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class StrictModel(BaseModel):
    """Every body and part of one we parse: an unknown field or a loosely typed value is a 400."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False
    # vLLM's: the usage so far in every chunk (guidellm reads it), not only in a final one.
    continuous_usage_stats: bool = False


class StructuredOutputsParams(StrictModel):
    """vLLM's `structured_outputs`: one of these constraints (its names for guided_*)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(populate_by_name=True)  # merged with StrictModel's

    def constraints(self) -> list[StructuredOutput]:
        found = []
        if self.json_ is not None:
            found.append(StructuredOutput("json_schema", self.json_ if isinstance(
                self.json_, str) else json.dumps(self.json_)))
        if self.regex is not None:
            found.append(StructuredOutput("regex", self.regex))
        if self.choice is not None:
            found.append(StructuredOutput("choice", json.dumps(self.choice)))
        if self.grammar is not None:
            found.append(StructuredOutput("grammar", self.grammar))
        if self.json_object:
            found.append(StructuredOutput("json_object"))
        return found


class _GenerationRequest(StrictModel):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
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
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(default=None, ge=0)
    # vLLM's: each prompt token's logprob given its prefix, with this many alternatives.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    logit_bias: dict[str, Bias] | None = None  # OpenAI's range: a finite nudge
    # vLLM's structured-output extras (one at most; chat also has response_format).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: keep only the prompt's last N tokens.
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    # vLLM's output shaping: keep the matched stop string (or stop token's text) in the text;
    # the detokenizer's options; logprob tokens as "token_id:N".
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False
    # vLLM's token restrictions: sample only these ids; never generate these words.
    allowed_token_ids: list[NonNegInt] | None = Field(default=None, min_length=1)
    bad_words: list[str] | None = None
    # Speculative decoding (--speculative): true decodes this request one token per pass
    # (the name of vLLM's per-request switch, SamplingParams.disable_spec_decode).
    disable_spec_decode: StrictBool = False
    # Bookkeeping keys inside `messages` accepted and ignored (fields.MESSAGE_BOOKKEEPING).
    _ignored: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def ignored_fields(self) -> list[str]:
        return self._ignored

    def note_ignored(self, names: list[str]) -> None:
        """The request's fields accepted but not acted on (counted on /metrics)."""
        self._ignored = names

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and (self.stream_options.include_usage
                                             or self.stream_options.continuous_usage_stats))

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def constrained(self) -> bool:
        """Whether a field asks for structured output (its grammar compiles off the loop)."""
        return any(getattr(self, name) is not None for name in
                   ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                    "structured_outputs"))

    def structured_output(self) -> tuple[str, StructuredOutput] | None:
        """(the field that asked, the constraint), or None; two constraints are a 400."""
        found = self._constraints()
        if len(found) > 1:
            raise bad_request(f"{found[0][0]} and {found[1][0]} cannot be combined",
                              found[1][0])
        return found[0] if found else None

    def _constraints(self) -> list[tuple[str, StructuredOutput]]:
        found = []
        if self.guided_json is not None:
            spec = self.guided_json if isinstance(self.guided_json, str) else \
                json.dumps(self.guided_json)
            found.append(("guided_json", StructuredOutput("json_schema", spec)))
        if self.guided_regex is not None:
            found.append(("guided_regex", StructuredOutput("regex", self.guided_regex)))
        if self.guided_choice is not None:
            found.append(("guided_choice",
                          StructuredOutput("choice", json.dumps(self.guided_choice))))
        if self.guided_grammar is not None:
            found.append(("guided_grammar", StructuredOutput("grammar", self.guided_grammar)))
        if self.structured_outputs is not None:
            found.extend(("structured_outputs", c)
                         for c in self.structured_outputs.constraints())
        return found


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 with echo: score the prompt only (lm-eval's and vLLM's idiom).
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    # Chat's name, accepted here too: the alternatives per token, over `logprobs`'s number.
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    # vLLM's: tokenize a text prompt with the tokenizer's special tokens (e.g. BOS).
    add_special_tokens: bool = False

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo (score the prompt)")
        if self.top_logprobs is not None:
            if self.logprobs is None:
                raise ValueError("top_logprobs: only allowed when logprobs is set")
            self.logprobs = self.top_logprobs
        return self

    @property
    def scores_prompt_only(self) -> bool:
        """max_tokens 0 with echo: the prompt and its logprobs, no generated token."""
        return self.max_tokens == 0

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


class ContentPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the grammar is always enforced under required/named


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # accepted; the chat template has no place for it
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call this is the result of
    # Not sent to the template (it has no place for them): the thinking of an earlier reply.
    reasoning_content: str | None = None

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


class JsonSchemaFormat(StrictModel):
    model_config = ConfigDict(populate_by_name=True)  # merged with StrictModel's
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the grammar is always enforced


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # OpenAI's default (null) is true: a reply may hold several calls.
    parallel_tool_calls: bool | None = None
    # vLLM's chat-template controls.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: a reply that continues an assistant turn starts with that turn's text.
    echo: bool = False

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: only allowed when logprobs is true")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ValueError("continue_final_message: cannot be combined with "
                                 "add_generation_prompt (set it to false)")
            if self.messages[-1].role != "assistant":
                raise ValueError("continue_final_message: the last message must be the "
                                 "assistant's")
        return self

    def echoed_text(self) -> str:
        """What vLLM's `echo` puts before the reply: the last message's text when that
        message is the assistant's (the turn the reply continues), else nothing."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    def template_kwargs(self) -> dict[str, Any]:
        """`chat_template_kwargs` for the template, refused where they would replace the
        request's own arguments."""
        kwargs = dict(self.chat_template_kwargs or {})
        taken = sorted(set(kwargs) & {"messages", "conversation", "tools", "tokenize",
                                      "add_generation_prompt", "continue_final_message"})
        if taken:
            raise bad_request(f"chat_template_kwargs: {', '.join(taken)} cannot be set here",
                              "chat_template_kwargs")
        return kwargs

    @property
    def constrained(self) -> bool:
        fmt = self.response_format
        return (super().constrained or (fmt is not None and fmt.type != "text")
                or self.tool_choice not in (None, "none", "auto"))

    @property
    def parallel(self) -> bool:
        return self.parallel_tool_calls is not False

    def functions(self) -> list[dict[str, Any]]:
        return [t.function.model_dump(exclude_none=True) for t in self.tools or []]

    def tool_names(self) -> set[str] | None:
        """The functions whose calls are parsed out of the output (None: no tool calling)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return {t.function.name for t in self.tools}

    def _tool_choice(self) -> str | None:
        """"required", a function's name, or None (free choice, or no tools)."""
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return None
        if not self.tools:
            raise bad_request("tool_choice needs tools", "tool_choice")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in (self.tool_names() or set()):
                raise bad_request(f"tool_choice names {choice.function.name!r}, which is "
                                  "not in tools", "tool_choice")
            return choice.function.name
        return str(choice)

    def _constraints(self) -> list[tuple[str, StructuredOutput]]:
        found = super()._constraints()
        choice = self._tool_choice()
        if choice is not None:
            tool = tool_constraint(self.functions(), choice, self.parallel)
            assert tool is not None
            found.append(("tool_choice", tool))
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return found
        if fmt.type == "json_object":
            return [("response_format", StructuredOutput("json_object")), *found]
        if fmt.json_schema is None:
            raise bad_request("response_format.json_schema is required with type "
                              "json_schema", "response_format")
        # An empty schema means any JSON value; an object is what clients expect.
        schema = fmt.json_schema.schema_ or {"type": "object"}
        return [("response_format", StructuredOutput("json_schema", json.dumps(schema))),
                *found]

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as chat templates read them (tool call arguments as objects)."""
        out = []
        for m in self.messages:
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                   "content": m.text()}
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                    for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.reasoning_content is not None:  # the template decides whether it is shown
                msg["reasoning_content"] = m.reasoning_content
            out.append(msg)
        return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = False


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[NonNegInt]


def parse_body(raw: bytes, model: type[BaseModel], max_json_depth: int = 32,
               max_token_ids: int = RequestLimits.max_token_ids) -> Any:
    """Bytes -> a validated request, or an APIError(400) naming the offending field."""
    data = loads(raw, max_json_depth)
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    check_token_ids(data, max_token_ids)
    ignored = strip_message_bookkeeping(data)
    try:
        req = model.model_validate(strip_accepted(data, model.model_fields))
    except ValidationError as exc:
        errors = exc.errors()
        # A key nothing declares is the clearest thing to report, even inside a union (a
        # content part with an extra key is first a "not a string" error).
        err = next((e for e in errors if e.get("type") == "extra_forbidden"), errors[0])
        loc = [str(p) for p in err.get("loc", ()) if not _union_branch(str(p))]
        param = loc[0] if loc else None
        detail = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        kind = str(err.get("type", ""))
        if kind == "extra_forbidden":
            raise APIError(400, f"{'.'.join(loc)}: {reason(loc[-1])}", param=param,
                           code="unsupported_parameter") from None
        code = ("missing_required_parameter" if kind == "missing" else
                "invalid_type" if kind.endswith(("_type", "_parsing")) or "union" in kind
                else "invalid_value")
        if not loc:  # a whole-body check: its message starts with the field it is about
            named = detail.split(":", 1)[0]
            if named in model.model_fields:
                raise APIError(400, detail, param=named, code=code) from None
        raise APIError(400, f"{'.'.join(loc) or 'body'}: {detail}", param=param,
                       code=code) from None
    if isinstance(req, _GenerationRequest):
        req.note_ignored(ignored)
    return req


def _union_branch(part: str) -> bool:
    """Whether a pydantic error location part names a union's branch (`str`,
    `list[ContentPart]`, `NamedToolChoice`) rather than a field or an index."""
    return part in ("str", "int", "float", "bool") or "[" in part or part[:1].isupper()


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


def model_info(model: str, max_model_len: int, parent: str | None = None) -> dict[str, Any]:
    """A model card; a LoRA adapter's names its base model as `parent` (vLLM's field)."""
    return {"id": model, "object": "model", "created": now_s(), "owned_by": "everystop",
            "max_model_len": max_model_len, **({"parent": parent} if parent else {})}


def model_list(model: str, max_model_len: int, adapters: list[str] | None = None
               ) -> dict[str, Any]:
    """The base model, then each LoRA adapter served beside it."""
    return {"object": "list", "data": [model_info(model, max_model_len)] + [
        model_info(name, max_model_len, model) for name in adapters or []]}
