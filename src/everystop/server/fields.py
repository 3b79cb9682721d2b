"""Request fields we do not model: the few that are safe to ignore, the ones whose default
value we accept, and the reason we give for refusing the rest.

A field is either honoured (declared on a request model in `protocol.py`) or answered with a
400 that names it, never dropped. docs/openai-fields.md is the table users read; keep the two
in step (tests/server/test_openai_fields.py walks that table).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

# Safe to ignore: they change bookkeeping on OpenAI's side, never the generated text.
IGNORED = frozenset({"metadata", "store", "service_tier"})

# OpenAI fields accepted only at the value that means "the default behaviour".
DEFAULT_ONLY: dict[str, Callable[[Any, dict[str, Any]], bool]] = {
    "response_format": lambda v, _: v is None or v == {"type": "text"},
    "functions": lambda v, _: not v,
    "function_call": lambda v, _: v in (None, "none"),
    "modalities": lambda v, _: v in (None, ["text"]),
    # best_of == n draws exactly the n choices it returns.
    "best_of": lambda v, body: v is None or v == body.get("n", 1),
}

# Why a field is refused (anything not listed: "unknown or unsupported field").
REASONS = {
    "response_format": "a chat field: on /v1/completions use guided_json, guided_regex, "
                       "guided_choice or guided_grammar",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "modalities": "text output only",
    "audio": "text output only",
    "best_of": "best_of other than n is not supported (no server-side ranking)",
    "suffix": "fill-in-the-middle (suffix) is not supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "this model has no reasoning mode",
    "web_search_options": "web search is not supported",
}


# Keys inside `messages` that describe an earlier response or are a client's own bookkeeping:
# accepted and dropped (counted in everystop:ignored_request_fields_total), as OpenAI and vLLM
# accept them back from the replies they sent. Any other unknown key is still a 400.
MESSAGE_BOOKKEEPING = frozenset({
    "refusal", "annotations", "audio", "provider_specific_fields", "reasoning",
    "thinking_blocks", "id", "index"})
# Keys of a content part that only hint at a provider's caching: accepted and dropped.
CONTENT_PART_BOOKKEEPING = frozenset({"cache_control"})


def strip_message_bookkeeping(data: dict[str, Any]) -> list[str]:
    """Drop, in place, the bookkeeping keys (and null values: "not set") of every message and
    content part of `data`; returns the names of the non-null keys dropped, for the metric."""
    messages = data.get("messages")
    if not isinstance(messages, list):
        return []
    dropped: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        for key in [k for k, v in message.items() if v is None or k in MESSAGE_BOOKKEEPING]:
            value = message.pop(key)
            if value is not None:
                dropped.append(key)
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict):
                    for key in [k for k in part if k in CONTENT_PART_BOOKKEEPING]:
                        del part[key]
                        dropped.append(key)
    return dropped


def strip_accepted(data: dict[str, Any], declared: Collection[str] = ()) -> dict[str, Any]:
    """The body without the fields that are ignored or at their default value (null always is:
    clients send `"suffix": null` for "not set"); whatever is left that the model does not
    declare is refused by name. A field the model `declared` is its own to judge."""
    return {k: v for k, v in data.items()
            if v is not None and (k in declared or (
                k not in IGNORED and not (k in DEFAULT_ONLY and DEFAULT_ONLY[k](v, data))))}


def reason(field: str) -> str:
    return REASONS.get(field, "unknown or unsupported field")
