"""A chat request -> its prompt text: the tools checked against the structured-output size
limits (the template renders every tool, whatever `tool_choice` says, and a forced choice
compiles their schemas), then the conversation rendered by the model's chat template.

Blocking (a template over a large conversation or tool list takes seconds): the route runs it
on a PrepPool worker.
"""

from __future__ import annotations

import json
from typing import Any

from jinja2 import TemplateError

from everystop.config import StructuredOutputConfig
from everystop.engine.client import EngineClient
from everystop.engine.grammar_limits import SpecOverLimit, check_schema
from everystop.server.errors import APIError, bad_request
from everystop.server.offload import check_text_fits
from everystop.server.protocol import ChatCompletionRequest


def render_chat(engine: EngineClient, body: ChatCompletionRequest) -> str:
    """The prompt of `body`'s conversation (and tools), or an APIError(400)."""
    template = getattr(engine.tokenizer, "apply_chat_template", None)
    if template is None:
        raise APIError(400, "this model has no chat template; use /v1/completions",
                       code="no_chat_template")
    functions = body.functions()
    if functions:
        limits = getattr(engine, "structured_output_config", None) or StructuredOutputConfig()
        check_tools(functions, limits)
    conversation = body.conversation()
    check_text_fits(engine, sum(len(m.get("content") or "") for m in conversation))
    tools = {"tools": [t.model_dump(exclude_none=True) for t in body.tools or []]} \
        if functions else {}  # the model's template renders them
    try:
        prompt: str = template(conversation, add_generation_prompt=body.add_generation_prompt,
                               continue_final_message=body.continue_final_message,
                               **tools, **body.template_kwargs())
    except (TypeError, ValueError, TemplateError) as exc:  # the template refused its inputs
        raise APIError(400, f"the chat template could not render this request: {exc}",
                       param="messages") from None
    return prompt


def check_tools(functions: list[dict[str, Any]], limits: StructuredOutputConfig) -> None:
    """The tools' parameter schemas, all together, within the JSON-schema limits (depth,
    enum values, properties, then bytes): a 400 naming the limit."""
    schemas = [f.get("parameters") or {} for f in functions]
    try:
        check_schema(schemas, limits, "the tools' parameter schemas")
        num_bytes = len(json.dumps(schemas))
        if num_bytes > limits.max_spec_bytes:
            raise SpecOverLimit("max_spec_bytes", f"the tools' parameter schemas are "
                                f"{num_bytes} bytes, over max_spec_bytes "
                                f"({limits.max_spec_bytes})")
    except SpecOverLimit as exc:
        raise bad_request(str(exc), "tools", code=exc.limit) from None
