"""Every row of docs/openai-fields.md, on every endpoint it names: a request carrying the
example either shows the documented effect or gets the documented 400 naming the field.

Fields that shape the response run on the toy engine (no model); sampling controls need real
logits and run on the default model (greedy unless the row is about sampling)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.core.toy_executor import reference_output

from .conftest import ROOT, ServerProcess, start_model_server

MODEL = "SmolLM2-135M-Instruct"  # the default model, under its served name
PATHS = {"C": "/v1/completions", "CC": "/v1/chat/completions"}
# Honoured rows whose effect needs the model's own logits.
SAMPLING = {"temperature", "seed", "top_p", "top_k", "min_p", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias", "ignore_eos",
            "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
            "structured_outputs", "allowed_token_ids", "bad_words", "skip_special_tokens",
            "spaces_between_special_tokens",
            "tools", "tool_choice", "parallel_tool_calls"}


@dataclass(frozen=True)
class Row:
    field: str
    endpoints: tuple[str, ...]
    status: str
    example: Any


def table() -> list[Row]:
    rows = []
    for line in (ROOT / "docs" / "openai-fields.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[3].startswith("`"):
            continue
        rows.append(Row(cells[0].strip("`"), tuple(cells[1].split()), cells[2],
                        json.loads(cells[3].strip("`"))))
    return rows


ROWS = table()


def cases() -> Iterator[Any]:
    for row in ROWS:
        for ep in row.endpoints:
            model = row.status == "honoured" and row.field in SAMPLING
            marks = [pytest.mark.server] + ([pytest.mark.model] if model else [])
            yield pytest.param(row, ep, marks=marks, id=f"{ep}-{row.field}")


def test_the_table_covers_every_request_field() -> None:
    from everystop.server.protocol import ChatCompletionRequest, CompletionRequest

    documented = {(r.field, ep) for r in ROWS for ep in r.endpoints}
    for ep, model in (("C", CompletionRequest), ("CC", ChatCompletionRequest)):
        for name in model.model_fields:
            assert (name, ep) in documented, f"{name} on {ep} is not in docs/openai-fields.md"
    assert {r.status for r in ROWS} == {"honoured", "ignored", "400"}


def test_null_means_not_set_and_default_values_are_accepted() -> None:
    from everystop.server.errors import APIError
    from everystop.server.protocol import ChatCompletionRequest, parse_body

    body = {"messages": [{"role": "user", "content": "x"}], "suffix": None, "tools": None,
            "tool_choice": "none", "response_format": {"type": "text"}, "store": False,
            "parallel_tool_calls": False, "max_tokens": None}
    assert parse_body(json.dumps(body).encode(), ChatCompletionRequest).max_tokens is None
    with pytest.raises(APIError) as err:
        parse_body(json.dumps({**body, "modalities": ["audio"]}).encode(), ChatCompletionRequest)
    assert err.value.param == "modalities"
    assert err.value.code == "unsupported_parameter"


# -- servers -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_model_server(tmp_path_factory.mktemp("fields"))
    yield proc
    proc.stop()


def post(server: ServerProcess, ep: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + PATHS[ep], json=body, timeout=120)


def base(ep: str, model: str, content: str = "fields", max_tokens: int = 6) -> dict[str, Any]:
    if ep == "C":
        return {"model": model, "prompt": content, "max_tokens": max_tokens}
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens}


def text_of(body: dict[str, Any], ep: str) -> str:
    choice = body["choices"][0]
    return str(choice["text"] if ep == "C" else choice["message"]["content"])


def ok(server: ServerProcess, ep: str, body: dict[str, Any]) -> dict[str, Any]:
    r = post(server, ep, body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def toy_text(ep: str, content: str, n: int) -> str:
    prompt = content if ep == "C" else f"<user>{content}\n<assistant>"
    return "".join(chr(t) for t in reference_output([ord(c) for c in prompt], n))


# -- the rows ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("row", "ep"), list(cases()))
def test_field(row: Row, ep: str, request: pytest.FixtureRequest) -> None:
    if row.status == "400":
        server = request.getfixturevalue("toy_server")
        body = base(ep, "toy")
        if row.field == "content part other than text":
            body["messages"][0]["content"] = row.example
            err = post(server, ep, body).json()["error"]
            assert err["param"] == "messages" and "text content only" in err["message"]
            return
        body[row.field] = row.example
        r = post(server, ep, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == (row.field, "unsupported_parameter"), err
        return
    if row.status == "ignored":
        server = request.getfixturevalue("toy_server")
        plain = ok(server, ep, base(ep, "toy"))
        assert text_of(ok(server, ep, {**base(ep, "toy"), row.field: row.example}), ep) == \
            text_of(plain, ep)
        return
    key = effect_key(row.field, ep)
    if row.field in SAMPLING:
        server = request.getfixturevalue("model_server")
        SAMPLING_EFFECTS[key](server, ep, row.example)
    else:
        TOY_EFFECTS[key](request.getfixturevalue("toy_server"), ep, row.example)


def effect_key(field: str, ep: str) -> str | tuple[str, str]:
    """A field honoured on one row checks with one effect; a field honoured on a row per
    endpoint (their meanings differ) has one effect per endpoint."""
    rows = sum(r.field == field and r.status == "honoured" for r in ROWS)
    return (field, ep) if rows > 1 else field


@pytest.mark.server
@pytest.mark.parametrize("ep", ["C", "CC"])
def test_a_field_outside_the_table_is_refused_by_name(toy_server: ServerProcess,
                                                      ep: str) -> None:
    documented = {r.field for r in ROWS}
    for field, value in (("no_such_field", 1), ("best_of_n", 2), ("logprob", 1)):
        assert field not in documented
        r = post(toy_server, ep, {**base(ep, "toy"), field: value})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == (field, "unsupported_parameter"), err
        assert "unknown or unsupported field" in err["message"]
    # Inside an object the table documents, an unknown key is refused the same way.
    r = post(toy_server, ep, {**base(ep, "toy"), "stream": True,
                              "stream_options": {"include_usage": True, "extra": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text


Effect = Callable[[ServerProcess, str, Any], None]


def _model(s: ServerProcess, ep: str, v: Any) -> None:
    r = post(s, ep, {**base(ep, "toy"), "model": v})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def _prompt(s: ServerProcess, ep: str, v: Any) -> None:
    body = {**base(ep, "toy"), "prompt" if ep == "C" else "messages": v}
    assert text_of(ok(s, ep, body), ep) == toy_text(ep, "other", 6) != toy_text(ep, "fields", 6)


def _max_tokens(s: ServerProcess, ep: str, v: Any) -> None:
    field = "max_completion_tokens" if ep == "CC" else "max_tokens"
    out = ok(s, ep, {**base(ep, "toy", max_tokens=5), field: v})
    assert out["usage"]["completion_tokens"] == v and text_of(out, ep) == toy_text(ep, "fields", v)
    if ep == "C":  # 0 with echo: the prompt scored, nothing generated
        for stream in (False, True):
            _score_prompt_only(s, stream)
        r = post(s, ep, {**base(ep, "toy"), "max_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def _score_prompt_only(s: ServerProcess, stream: bool) -> None:
    body = {**base("C", "toy"), "max_tokens": 0, "echo": True, "logprobs": 1, "stream": stream}
    if not stream:
        out = ok(s, "C", body)
        choice = out["choices"][0]
        assert out["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert choice["text"] == "fields" and lp["tokens"] == list("fields")
        assert lp["token_logprobs"] == [None] + [-0.5] * 5
        return
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", s.url + PATHS["C"], json=body, timeout=30) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "fields"
    assert chunks[-1]["usage"]["completion_tokens"] == 0


def _n(s: ServerProcess, ep: str, v: Any) -> None:
    assert len(ok(s, ep, {**base(ep, "toy"), "n": v})["choices"]) == v


def _stream(s: ServerProcess, ep: str, v: Any, options: Any = None) -> None:
    body = {**base(ep, "toy"), "stream": v}
    if options is not None:
        body["stream_options"] = options
    with httpx.stream("POST", s.url + PATHS[ep], json=body, timeout=30) as r:
        frames = [line[6:] for line in r.iter_lines() if line]
    assert frames[-1] == "[DONE]" and len(frames) > 2
    chunks = [json.loads(f) for f in frames[:-1]]
    assert chunks[0]["object"] in ("text_completion", "chat.completion.chunk")
    if options is not None:
        assert chunks[-1]["usage"]["completion_tokens"] == 6 and not chunks[-1]["choices"]


def _stop(s: ServerProcess, ep: str, v: Any) -> None:
    full = toy_text(ep, "fields", 6)
    by_id = v == "STOP_ID_AT_3"
    stop: Any = [ord(full[3])] if by_id else full[3:5]
    out = ok(s, ep, {**base(ep, "toy"), "stop_token_ids" if by_id else "stop": stop})
    cut = full.index(full[3]) if by_id else full.index(full[3:5])
    assert text_of(out, ep) == full[:cut] and out["choices"][0]["finish_reason"] == "stop"


def _logprobs(s: ServerProcess, ep: str, v: Any) -> None:
    body = {**base(ep, "toy"), "logprobs": v}
    if ep == "CC":
        body["top_logprobs"] = 2
    lp = ok(s, ep, body)["choices"][0]["logprobs"]
    if ep == "C":
        assert len(lp["tokens"]) == 6 and len(lp["top_logprobs"][0]) == v
    else:
        assert len(lp["content"]) == 6 and len(lp["content"][0]["top_logprobs"]) == 2


def _top_logprobs(s: ServerProcess, ep: str, v: Any) -> None:
    lp = ok(s, ep, {**base(ep, "toy"), "logprobs": True, "top_logprobs": v})["choices"][0]
    assert all(len(e["top_logprobs"]) == v for e in lp["logprobs"]["content"])


def _completion_top_logprobs(s: ServerProcess, ep: str, v: Any) -> None:
    """Chat's name on completions: it sets the alternatives per token, over `logprobs`."""
    for logprobs in (0, 1, v + 1):
        lp = ok(s, ep, {**base(ep, "toy"), "logprobs": logprobs, "top_logprobs": v})
        tops = lp["choices"][0]["logprobs"]["top_logprobs"]
        assert len(tops) == 6 and all(len(t) == v for t in tops)
    r = post(s, ep, {**base(ep, "toy"), "top_logprobs": v})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text


def _user(s: ServerProcess, ep: str, v: Any, priority: int | None = None) -> None:
    tenant = f"{v}-{ep}-{priority}"
    body = {**base(ep, "toy"), "user": tenant}
    if priority is not None:
        body["priority"] = priority
    ok(s, ep, body)
    metrics = httpx.get(s.url + "/metrics", timeout=10).text
    label = f'tenant="{tenant}"' if priority is None else \
        f'tenant="{tenant}",tier="{priority}"'
    assert label in metrics


def _echo(s: ServerProcess, ep: str, v: Any) -> None:
    plain = text_of(ok(s, ep, base(ep, "toy")), ep)
    assert text_of(ok(s, ep, {**base(ep, "toy"), "echo": v}), ep) == "fields" + plain
    out = ok(s, ep, {**base(ep, "toy"), "echo": v, "logprobs": 1})
    lp = out["choices"][0]["logprobs"]
    assert lp["tokens"] == list("fields" + plain)
    # The toy scores every prompt token after the first -0.5, every sampled one -0.25.
    assert lp["token_logprobs"] == [None] + [-0.5] * 5 + [-0.25] * 6
    assert lp["text_offset"] == list(range(12)) and lp["top_logprobs"][0] is None
    body = {**base(ep, "toy"), "echo": v, "logprobs": 1, "stream": True}
    with httpx.stream("POST", s.url + PATHS[ep], json=body, timeout=30) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "fields" + plain
    streamed = [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]


def _chat_echo(s: ServerProcess, ep: str, v: Any) -> None:
    """vLLM's: a reply continuing the assistant's turn starts with that turn's text."""
    messages = [{"role": "user", "content": "fields"},
                {"role": "assistant", "content": "part"}]
    body = {**base(ep, "toy"), "messages": messages, "continue_final_message": True,
            "add_generation_prompt": False}
    continued = _toy_from("<user>fields\n<assistant>part")
    assert text_of(ok(s, ep, body), ep) == continued
    assert text_of(ok(s, ep, {**body, "echo": v}), ep) == "part" + continued
    with httpx.stream("POST", s.url + PATHS[ep], json={**body, "echo": v, "stream": True},
                      timeout=30) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line and line != "data: [DONE]"]
    assert chunks[0]["choices"][0]["delta"]["content"].startswith("part")
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == \
        "part" + continued
    # After the user's turn there is nothing to echo.
    plain = text_of(ok(s, ep, base(ep, "toy")), ep)
    assert text_of(ok(s, ep, {**base(ep, "toy"), "echo": v}), ep) == plain


def _prompt_logprobs(s: ServerProcess, ep: str, v: Any) -> None:
    out = ok(s, ep, {**base(ep, "toy"), "prompt_logprobs": v})
    # vLLM's places: in each completion choice; at a chat response's top level.
    scored = out["choices"][0]["prompt_logprobs"] if ep == "C" else out["prompt_logprobs"]
    # The toy scores every prompt token after the first -0.5 (one token per character).
    assert scored[0] is None and len(scored) == out["usage"]["prompt_tokens"]
    if ep == "C":
        assert len(scored) == 6  # "fields"
        for char, entry in zip("ields", scored[1:]):
            assert entry[str(ord(char))]["decoded_token"] == char
    assert all(e is not None and [x["logprob"] for x in e.values()] == [-0.5] * len(e)
               for e in scored[1:])
    plain = ok(s, ep, base(ep, "toy"))
    assert "prompt_logprobs" not in plain and "prompt_logprobs" not in plain["choices"][0]


def _full_prompt(ep: str, content: str = "fields") -> str:
    return content if ep == "C" else f"<user>{content}\n<assistant>"


def _toy_from(prompt: str, n: int = 6) -> str:
    return "".join(chr(t) for t in reference_output([ord(c) for c in prompt], n))


def _truncate(s: ServerProcess, ep: str, v: Any) -> None:
    out = ok(s, ep, {**base(ep, "toy"), "truncate_prompt_tokens": v})
    assert out["usage"]["prompt_tokens"] == v
    assert text_of(out, ep) == _toy_from(_full_prompt(ep)[-v:]) != toy_text(ep, "fields", 6)


def _template_kwargs(s: ServerProcess, ep: str, v: Any) -> None:
    # The toy template writes each variable as a line "<name=value>" before the turns.
    rendered = "".join(f"<{k}={x}>\n" for k, x in sorted(v.items())) + _full_prompt(ep)
    out = ok(s, ep, {**base(ep, "toy"), "chat_template_kwargs": v})
    assert text_of(out, ep) == _toy_from(rendered) != toy_text(ep, "fields", 6)
    bad = post(s, ep, {**base(ep, "toy"), "chat_template_kwargs": {"tools": []}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def _add_generation_prompt(s: ServerProcess, ep: str, v: Any) -> None:
    out = ok(s, ep, {**base(ep, "toy"), "add_generation_prompt": v})
    assert text_of(out, ep) == _toy_from("<user>fields\n") != toy_text(ep, "fields", 6)


def _continue_final_message(s: ServerProcess, ep: str, v: Any) -> None:
    messages = [{"role": "user", "content": "fields"},
                {"role": "assistant", "content": "part"}]
    body = {**base(ep, "toy"), "messages": messages, "continue_final_message": v,
            "add_generation_prompt": False}
    assert text_of(ok(s, ep, body), ep) == _toy_from("<user>fields\n<assistant>part")
    for wrong in ({**body, "add_generation_prompt": True},
                  {**body, "messages": messages[:1]}):
        r = post(s, ep, wrong)
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def _include_stop_str(s: ServerProcess, ep: str, v: Any) -> None:
    full = toy_text(ep, "fields", 6)
    by_string = ok(s, ep, {**base(ep, "toy"), "stop": full[3:5], "include_stop_str_in_output": v})
    by_id = ok(s, ep, {**base(ep, "toy"), "stop_token_ids": [ord(full[3])],
                       "include_stop_str_in_output": v})
    assert (text_of(by_string, ep), text_of(by_id, ep)) == (full[:5], full[:4])
    assert by_string["choices"][0]["finish_reason"] == "stop"


def _tokens_as_ids(s: ServerProcess, ep: str, v: Any) -> None:
    body = {**base(ep, "toy"), "return_tokens_as_token_ids": v,
            "logprobs": 1 if ep == "C" else True}
    out = ok(s, ep, body)
    lp = out["choices"][0]["logprobs"]
    tokens = lp["tokens"] if ep == "C" else [e["token"] for e in lp["content"]]
    assert tokens == [f"token_id:{ord(c)}" for c in toy_text(ep, "fields", 6)]


def _add_special_tokens(s: ServerProcess, ep: str, v: Any) -> None:
    out = ok(s, ep, {**base(ep, "toy"), "add_special_tokens": v})
    with_bos = [1] + [ord(c) for c in "fields"]  # the toy tokenizer's BOS is id 1
    assert out["usage"]["prompt_tokens"] == 7
    assert text_of(out, ep) == "".join(chr(t) for t in reference_output(with_bos, 6)) \
        != toy_text(ep, "fields", 6)


def _disable_spec_decode(s: ServerProcess, ep: str, v: Any) -> None:
    """The same text either way (tests/server/test_speculation_api.py shows the request then
    proposes nothing on a speculating server); a value that is not a boolean is refused."""
    out = ok(s, ep, {**base(ep, "toy"), "disable_spec_decode": v})
    assert text_of(out, ep) == toy_text(ep, "fields", 6)
    r = post(s, ep, {**base(ep, "toy"), "disable_spec_decode": "maybe"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "disable_spec_decode"


TOY_EFFECTS: dict[str | tuple[str, str], Effect] = {
    "include_stop_str_in_output": _include_stop_str,
    "disable_spec_decode": _disable_spec_decode,
    "return_tokens_as_token_ids": _tokens_as_ids, "add_special_tokens": _add_special_tokens,
    "truncate_prompt_tokens": _truncate, "chat_template_kwargs": _template_kwargs,
    "add_generation_prompt": _add_generation_prompt,
    "continue_final_message": _continue_final_message,
    "prompt_logprobs": _prompt_logprobs,
    "model": _model, "prompt": _prompt, "messages": _prompt, "max_tokens": _max_tokens,
    "max_completion_tokens": _max_tokens, "n": _n, "stream": _stream,
    "stream_options": lambda s, ep, v: _stream(s, ep, True, v), "stop": _stop,
    "stop_token_ids": _stop, ("logprobs", "C"): _logprobs, ("logprobs", "CC"): _logprobs,
    ("top_logprobs", "CC"): _top_logprobs, ("top_logprobs", "C"): _completion_top_logprobs,
    "user": _user, "priority": lambda s, ep, v: _user(s, ep, "prio", v),
    ("echo", "C"): _echo, ("echo", "CC"): _chat_echo,
}

# On the model: a story (its greedy text repeats words), and a question it answers and ends.
STORY = "Once upon a time, in a small village,"
ANSWER = "What is 2+2? Answer with one number."


def _gen(s: ServerProcess, ep: str, content: str = STORY, max_tokens: int = 12,
         **extra: Any) -> dict[str, Any]:
    body = base(ep, MODEL, content, max_tokens)
    if ep == "C" and content == ANSWER:  # the chat turn, written out for completions
        body["prompt"] = f"<|im_start|>user\n{ANSWER}<|im_end|>\n<|im_start|>assistant\n"
    return ok(s, ep, {"temperature": 0, **body, **extra})


_GREEDY: dict[str, dict[str, Any]] = {}


def _greedy(s: ServerProcess, ep: str, content: str = STORY, max_tokens: int = 12,
            **extra: Any) -> dict[str, Any]:
    """`_gen` for a greedy request that several rows make alike (the plain text they compare
    with, the unconstrained answer, the special-token rows' shared check): sent once per
    server, endpoint and body. Greedy output is a function of the request (the temperature
    row checks that on each endpoint)."""
    key = json.dumps([s.url, ep, content, max_tokens, extra], sort_keys=True)
    if key not in _GREEDY:
        _GREEDY[key] = _gen(s, ep, content, max_tokens, **extra)
    return _GREEDY[key]


def _greedy_equivalent(field: str) -> Effect:
    def check(s: ServerProcess, ep: str, v: Any) -> None:
        greedy = text_of(_greedy(s, ep, "The capital of France is"), ep)
        hot = [text_of(_gen(s, ep, "The capital of France is", temperature=2.0, seed=i,
                             **{field: v}), ep) for i in range(3)]
        assert hot == [greedy] * 3
    return check


def _temperature(s: ServerProcess, ep: str, v: Any) -> None:
    texts = {text_of(_gen(s, ep, "Once upon a time", temperature=v), ep) for _ in range(2)}
    assert len(texts) == 1
    hot = {text_of(_gen(s, ep, "Once upon a time", temperature=1.5, seed=i), ep)
           for i in range(4)}
    assert len(hot) > 1


def _seed(s: ServerProcess, ep: str, v: Any) -> None:
    a, b = (text_of(_gen(s, ep, "Once upon a time", temperature=1.0, seed=v), ep)
            for _ in range(2))
    others = {text_of(_gen(s, ep, "Once upon a time", temperature=1.0, seed=v + i), ep)
              for i in range(1, 4)}
    assert a == b and others != {a}


def _penalty(field: str) -> Effect:
    def check(s: ServerProcess, ep: str, v: Any) -> None:
        # Greedy text that repeats tokens: penalized, it must take another path.
        plain = text_of(_greedy(s, ep, STORY, 24), ep)
        words = re.findall(r"\w+", plain)
        assert len(set(words)) < len(words)
        assert text_of(_gen(s, ep, STORY, 24, **{field: v}), ep) != plain
    return check


def _min_tokens(s: ServerProcess, ep: str, v: Any) -> None:
    natural = _greedy(s, ep, ANSWER, 48)
    assert natural["choices"][0]["finish_reason"] == "stop"
    n = natural["usage"]["completion_tokens"]
    longer = _gen(s, ep, ANSWER, 48, min_tokens=n + 4)
    assert longer["usage"]["completion_tokens"] >= n + 4


def _ignore_eos(s: ServerProcess, ep: str, v: Any) -> None:
    assert _greedy(s, ep, ANSWER, 48)["choices"][0]["finish_reason"] == "stop"
    out = _gen(s, ep, ANSWER, 48, ignore_eos=v)
    assert out["usage"]["completion_tokens"] == 48


def _logit_bias(s: ServerProcess, ep: str, v: Any) -> None:
    lp: Any = 0 if ep == "C" else True
    out = _gen(s, ep, "The capital of France is", 5, logit_bias=v, logprobs=lp)
    logprobs = out["choices"][0]["logprobs"]
    tokens = logprobs["tokens"] if ep == "C" else [e["token"] for e in logprobs["content"]]
    assert len(tokens) == 5 and len(set(tokens)) == 1
    plain = text_of(_greedy(s, ep, "The capital of France is", 5), ep)
    assert text_of(out, ep) != plain


def _json_with_int_n(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == {"n"} and isinstance(value["n"], int)


def _constrained(field: str, holds: Callable[[str], bool]) -> Effect:
    """The unconstrained greedy text breaks the rule; with the field, the text keeps it and
    ends on its own (EOS once the grammar is complete)."""
    def check(s: ServerProcess, ep: str, v: Any) -> None:
        question = "How many legs does a cat have?"
        assert not holds(text_of(_greedy(s, ep, question, 24), ep))
        out = _gen(s, ep, question, 24, **{field: v})
        assert holds(text_of(out, ep)), text_of(out, ep)
        assert out["choices"][0]["finish_reason"] == "stop"
    return check


ADD = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}]


def _tools(s: ServerProcess, ep: str, v: Any) -> None:
    """The tools reach the prompt (the template renders them)."""
    plain = _greedy(s, ep, "What is 2 + 3?", 4)
    with_tools = _gen(s, ep, "What is 2 + 3?", 4, tools=v)
    assert with_tools["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 20


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"]}}}


def _tool_choice(s: ServerProcess, ep: str, v: Any) -> None:
    out = _gen(s, ep, "What is 2 + 3?", 40, tools=ADD, tool_choice=v)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "add" and set(args) == {"a", "b"}
    assert all(isinstance(x, int) for x in args.values())


def parallel_weather_chat(unit: bool = False) -> list[dict[str, Any]]:
    """An earlier turn that called get_weather for two cities at once (and got the results),
    then a new question about two cities: the model follows its own example."""
    args = [{"city": c, **({"unit": "celsius"} if unit else {})} for c in ("Rome", "Madrid")]
    calls = [{"id": f"c{i}", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps(a)}}
             for i, a in enumerate(args)]
    return [{"role": "user", "content": "What is the weather in Rome and in Madrid?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c0", "content": "Sunny, 20 degrees."},
            {"role": "tool", "tool_call_id": "c1", "content": "Cloudy, 15 degrees."},
            {"role": "assistant", "content": "Rome: sunny, 20 degrees. Madrid: cloudy, 15."},
            {"role": "user", "content": "What is the weather in Paris and in London?"}]


def _parallel_tool_calls(s: ServerProcess, ep: str, v: Any) -> None:
    body = {**base(ep, MODEL, max_tokens=80), "messages": parallel_weather_chat(),
            "temperature": 0, "tools": [WEATHER], "tool_choice": "required"}
    calls = [ok(s, ep, {**body, "parallel_tool_calls": p})["choices"][0]["message"]
             ["tool_calls"] for p in (True, v)]
    # Allowed, the model calls once per city, each call with its own id; not allowed, once.
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls[0]] == \
        ["Paris", "London"]
    assert len({c["id"] for c in calls[0]}) == 2 and len(calls[1]) == 1


SPECIAL = re.compile(r"<\|[a-z_]+\|>")  # SmolLM2's special tokens: <|im_end|>, <|im_start|>


def _special_tokens(s: ServerProcess, ep: str, v: Any) -> None:
    """Past EOS (ignore_eos) the model writes its turn markers: skipped by default."""
    def text(**extra: Any) -> str:
        return text_of(_greedy(s, ep, ANSWER, 16, ignore_eos=True, **extra), ep)

    plain, spaced = text(), text(skip_special_tokens=False)
    joined = text(skip_special_tokens=False, spaces_between_special_tokens=False)
    assert not SPECIAL.search(plain) and SPECIAL.search(joined)
    assert SPECIAL.sub("", joined) == plain and spaced != joined
    assert spaced.replace(" ", "") == joined.replace(" ", "")


def _allowed_token_ids(s: ServerProcess, ep: str, v: Any) -> None:
    lp: Any = 1 if ep == "C" else True
    out = _gen(s, ep, STORY, 8, temperature=1.0, seed=3, allowed_token_ids=v, logprobs=lp,
               return_tokens_as_token_ids=True)
    entries = out["choices"][0]["logprobs"]
    tokens = entries["tokens"] if ep == "C" else [e["token"] for e in entries["content"]]
    assert len(tokens) == 8 and {int(t.split(":")[1]) for t in tokens} <= set(v)


def _bad_words(s: ServerProcess, ep: str, v: Any) -> None:
    prompt = "The capital of France is" if ep == "C" else "Tell me the capital of France."
    assert v[0] in text_of(_greedy(s, ep, prompt), ep)
    assert v[0] not in text_of(_gen(s, ep, prompt, bad_words=v), ep)


SAMPLING_EFFECTS: dict[str | tuple[str, str], Effect] = {
    "skip_special_tokens": _special_tokens, "spaces_between_special_tokens": _special_tokens,
    "allowed_token_ids": _allowed_token_ids, "bad_words": _bad_words,
    "parallel_tool_calls": _parallel_tool_calls,
    "tools": _tools, "tool_choice": _tool_choice,
    "response_format": _constrained("response_format", _json_with_int_n),
    "guided_json": _constrained("guided_json", _json_with_int_n),
    "guided_regex": _constrained("guided_regex",
                                 lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{2}", t) is not None),
    "guided_choice": _constrained("guided_choice", lambda t: t in ("yes", "no")),
    "structured_outputs": _constrained("structured_outputs", lambda t: t in ("yes", "no")),
    "guided_grammar": _constrained("guided_grammar",
                                   lambda t: re.fullmatch(r"A[0-9][0-9]", t) is not None),
    "temperature": _temperature, "seed": _seed, "top_p": _greedy_equivalent("top_p"),
    "top_k": _greedy_equivalent("top_k"), "min_p": _greedy_equivalent("min_p"),
    "presence_penalty": _penalty("presence_penalty"),
    "frequency_penalty": _penalty("frequency_penalty"),
    "repetition_penalty": _penalty("repetition_penalty"), "min_tokens": _min_tokens,
    "logit_bias": _logit_bias, "ignore_eos": _ignore_eos,
}


def test_every_honoured_row_has_an_effect_check() -> None:
    """A new honoured row (or a row for another endpoint) fails until its check is written;
    a check whose row went away fails too."""
    honoured = {effect_key(r.field, ep) for r in ROWS if r.status == "honoured"
                for ep in r.endpoints}
    assert honoured == set(TOY_EFFECTS) | set(SAMPLING_EFFECTS)
    assert not set(TOY_EFFECTS) & set(SAMPLING_EFFECTS)
