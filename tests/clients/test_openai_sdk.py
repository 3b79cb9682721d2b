"""The `openai` SDK as users call it: n choices, logprobs (chat and completions), streamed and
not, structured output through `.parse()`, tool calls (required, named, streamed, and a tool
result sent back), and a refused field surfacing as the SDK's
BadRequestError."""

from __future__ import annotations

import json
from enum import StrEnum

import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = [pytest.mark.model, pytest.mark.server]

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)


def test_chat_n_choices_with_logprobs(client: openai.OpenAI, model_name: str) -> None:
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=6,
                                       temperature=0, n=2, logprobs=True, top_logprobs=3)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy: same text
    assert r.usage.completion_tokens == 2 * len(r.choices[0].logprobs.content)
    for entry in r.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 3
        # Greedy picks the most likely token, so it heads its own top list.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0 and bytes(entry.bytes or []).decode(errors="replace")
    assert "".join(e.token for e in r.choices[0].logprobs.content) == \
        r.choices[0].message.content


def test_chat_stream_n_matches_non_streamed(client: openai.OpenAI, model_name: str) -> None:
    full = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=6,
                                          temperature=0)
    texts = ["", ""]
    usage = None
    for chunk in client.chat.completions.create(model=model_name, messages=MESSAGES,
                                                max_tokens=6, temperature=0, n=2, stream=True,
                                                stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert texts == [full.choices[0].message.content] * 2
    assert usage is not None and usage.completion_tokens == 2 * full.usage.completion_tokens


def test_completions_logprobs_streamed_and_not(client: openai.OpenAI, model_name: str) -> None:
    kw = dict(model=model_name, prompt="The capital of France is", max_tokens=5, temperature=0,
              logprobs=2)
    full = client.completions.create(**kw)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == full.usage.completion_tokens
    assert "".join(lp.tokens) == full.choices[0].text
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert len(top) == 2 and max(top, key=top.get) == token
    streamed = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text
    tokens = [t for c in streamed for t in (c.choices[0].logprobs.tokens or [])]
    assert tokens == lp.tokens


def test_completions_two_prompts_times_n(client: openai.OpenAI, model_name: str) -> None:
    r = client.completions.create(model=model_name, prompt=["One, two,", "Red, green,"],
                                  max_tokens=3, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text != r.choices[2].text == r.choices[3].text


def test_refused_field_is_a_bad_request_naming_it(client: openai.OpenAI,
                                                  model_name: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=2,
                                  extra_body={"no_such_field": 1})
    assert "no_such_field" in str(err.value)


class Colour(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)


class Person(BaseModel):
    """Bounded strings and lists: greedy decoding of a small model can repeat a list item
    forever, and the schema is what keeps it finite."""

    name: str = Field(max_length=24)
    age: int
    favourite_colour: Colour
    hobbies: list[str] = Field(max_length=3)
    address: Address


def test_parse_returns_the_pydantic_object(client: openai.OpenAI, model_name: str) -> None:
    messages = [{"role": "user", "content": "Describe a fictional person."}]
    r = client.chat.completions.parse(model=model_name, messages=messages,
                                      response_format=Person, max_tokens=200, temperature=0)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"
    assert isinstance(person.favourite_colour, Colour) and len(person.hobbies) <= 3
    # Without the schema the same request answers in prose.
    plain = client.chat.completions.create(model=model_name, messages=messages, max_tokens=20,
                                           temperature=0).choices[0].message.content
    with pytest.raises(ValueError):
        Person.model_validate_json(plain or "")


def test_invalid_schema_is_a_bad_request_naming_the_field(client: openai.OpenAI,
                                                          model_name: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=2,
                                  extra_body={"guided_json": {"type": "no-such-type"}})
    assert err.value.body["param"] == "guided_json"  # type: ignore[index]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_calls_required_named_and_streamed(client: openai.OpenAI, model_name: str) -> None:
    kw = dict(model=model_name, messages=ASK, tools=[WEATHER, ADD], max_tokens=60,
              temperature=0)
    r = client.chat.completions.create(**kw, tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["unit"] in ("celsius", "fahrenheit")
    named = client.chat.completions.create(
        **kw, tool_choice={"type": "function", "function": {"name": "add"}})
    (add,) = named.choices[0].message.tool_calls
    assert add.function.name == "add"
    assert all(isinstance(v, int) for v in json.loads(add.function.arguments).values())
    streamed = [c for c in client.chat.completions.create(**kw, tool_choice="required",
                                                          stream=True) if c.choices]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    pieces = [t for c in streamed for t in c.choices[0].delta.tool_calls or []]
    # Streamed as generated: the header, then the arguments in pieces (OpenAI's delta shape).
    assert len(pieces) > 3 and pieces[0].id and pieces[0].function.name == call.function.name
    assert {p.index for p in pieces} == {0}
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == args
    # The call and its result go back through the template: the model reads the result.
    back = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees."}]
    answer = client.chat.completions.create(model=model_name, messages=back, max_tokens=30,
                                            temperature=0)
    assert answer.choices[0].message.content


def test_parallel_tool_calls(client: openai.OpenAI, model_name: str) -> None:
    from tests.server.test_openai_fields import parallel_weather_chat

    kw = dict(model=model_name, tools=[WEATHER], tool_choice="required", max_tokens=80,
              temperature=0, messages=parallel_weather_chat(unit=True))
    calls = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "London"]
    assert len({c.id for c in calls}) == 2
    # Streamed: each call by its index, its id in its first piece.
    pieces = [t for c in client.chat.completions.create(**kw, stream=True) if c.choices
              for t in c.choices[0].delta.tool_calls or []]
    assert [p.index for p in pieces if p.id] == [0, 1]
    for i, call in enumerate(calls):
        streamed = "".join(p.function.arguments or "" for p in pieces if p.index == i)
        assert json.loads(streamed) == json.loads(call.function.arguments)
    (one,) = client.chat.completions.create(**kw, parallel_tool_calls=False
                                            ).choices[0].message.tool_calls
    assert json.loads(one.function.arguments)["city"] == "Paris"
