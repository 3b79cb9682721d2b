"""Hostile input against a live toy server: every malformed or oversized body is a 4xx that
names what is wrong, carries an X-Request-Id, and leaves the server healthy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ServerProcess, start_toy_server

pytestmark = pytest.mark.server

DEEP = 100_000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = start_toy_server(tmp_path_factory.mktemp("limits"), "--max-body-bytes", "512KiB",
                         "--max-prompts", "16", "--max-request-sequences", "24",
                         "--api-key", "k", "--admin-key", "a")
    yield s
    s.stop()


AUTH = {"Authorization": "Bearer k", "content-type": "application/json"}


def post(server: ServerProcess, path: str, content: bytes | str,
         headers: dict[str, str] | None = None, method: str = "POST") -> httpx.Response:
    data = content.encode() if isinstance(content, str) else content
    return httpx.request(method, server.url + path, content=data, timeout=30,
                         headers=headers or AUTH)


def deep(prefix: str, depth: int) -> str:
    return prefix + "[" * depth + "1" + "]" * depth + "}"


CASES = [
    # (path, body, status, code, param)
    ("/v1/completions", deep('{"prompt": ', DEEP), 400, "max_json_depth", None),
    ("/v1/completions", deep('{"prompt": ', 40), 400, "max_json_depth", None),
    ("/v1/chat/completions", deep('{"messages": ', DEEP), 400, "max_json_depth", None),
    ("/tokenize", deep('{"prompt": ', DEEP), 400, "max_json_depth", None),
    ("/v1/completions", '{"prompt": "\\ud800abc"}', 400, "invalid_unicode", None),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "\\udfffx"}]}', 400, "invalid_unicode", None),
    ("/tokenize", '{"prompt": "a\\ud800"}', 400, "invalid_unicode", None),
    ("/v1/completions", '{"prompt": "a", "temperature": NaN}', 400, "invalid_number", None),
    ("/v1/completions", '{"prompt": "a", "temperature": Infinity}', 400, "invalid_number",
     None),
    ("/v1/completions", '{"prompt": "a", "temperature": -Infinity}', 400, "invalid_number",
     None),
    ("/v1/completions", '{"prompt": "a", "temperature": 1e400}', 400, "invalid_number", None),
    ("/v1/completions", '{"prompt": "a", "temperature": 1e308}', 400, "invalid_value",
     "temperature"),
    ("/v1/completions", '{"prompt": "a", "seed": ' + "9" * 5000 + "}", 400, "invalid_number",
     None),
    ("/v1/completions", '{"prompt": "a", "max_tokens": 99999999999999999999}', 400,
     "invalid_number", None),
    ("/v1/completions", '{"prompt": "a", "logit_bias": {"5": 1e308}}', 400, "invalid_value",
     "logit_bias"),
    ("/v1/completions", json.dumps({"prompt": ["a"] * 17}), 400, "max_prompts", "prompt"),
    ("/v1/completions", json.dumps({"prompt": ["a"] * 200}), 400, "max_prompts", "prompt"),
    ("/v1/completions", json.dumps({"prompt": ["a"] * 4, "n": 8}), 400, "max_sequences", "n"),
    ("/v1/completions", json.dumps({"prompt": ""}), 400, "invalid_value", "prompt"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                         "n": 9}), 400, "invalid_value", "n"),
    ("/v1/completions", json.dumps({"prompt": "x" * 600_000}), 413, "max_body_bytes", None),
]


@pytest.mark.parametrize("path,body,status,code,param", CASES,
                         ids=[f"{i}-{c[3]}" for i, c in enumerate(CASES)])
def test_bad_input_is_a_4xx_naming_the_limit(server: ServerProcess, path: str, body: str,
                                             status: int, code: str, param: str | None) -> None:
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param), err
    assert r.headers.get("x-request-id")
    assert "Traceback" not in r.text


def test_admin_patch_is_bounded_and_depth_checked(server: ServerProcess) -> None:
    admin = {"Authorization": "Bearer a", "content-type": "application/json"}
    r = post(server, "/admin/scheduler_config", deep('{"max_num_seqs": ', DEEP), admin, "PATCH")
    assert r.status_code == 400 and r.json()["error"]["code"] == "max_json_depth", r.text
    r = post(server, "/admin/scheduler_config", '{"max_num_seqs": 1000000000}', admin, "PATCH")
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_num_seqs", r.text
    r = post(server, "/admin/scheduler_config", '{"tpot_target_ms": NaN}', admin, "PATCH")
    assert r.status_code == 400, r.text


def test_body_limit_holds_for_chunked_uploads_without_a_length(server: ServerProcess) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(600):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers=AUTH, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "max_body_bytes"


def test_wrong_content_type_is_415_and_absent_is_json(server: ServerProcess) -> None:
    body = json.dumps({"prompt": "ab", "max_tokens": 2})
    r = post(server, "/v1/completions", body, {"Authorization": "Bearer k",
                                               "content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = post(server, "/v1/completions", body, {"Authorization": "Bearer k"})
    assert r.status_code == 200, r.text


def test_request_id_is_echoed_when_tame_and_made_up_otherwise(server: ServerProcess) -> None:
    r = httpx.get(server.url + "/health", headers={"X-Request-Id": "abc-123"}, timeout=10)
    assert r.headers["x-request-id"] == "abc-123"
    r = httpx.get(server.url + "/health", headers={"X-Request-Id": "a b\t<script>"}, timeout=10)
    assert len(r.headers["x-request-id"]) == 32


def test_metrics_need_the_api_key_unless_opened(server: ServerProcess, tmp_path: Path) -> None:
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 401
    assert httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).status_code == 200
    open_server = start_toy_server(tmp_path, "--api-key", "k", "--open-metrics")
    try:
        assert httpx.get(open_server.url + "/metrics", timeout=10).status_code == 200
    finally:
        open_server.stop()


def test_server_still_serves_after_all_that(server: ServerProcess) -> None:
    r = post(server, "/v1/completions", json.dumps({"prompt": "fine", "max_tokens": 3}))
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}


def test_tokenize_renders_a_long_answer_in_slices_to_the_same_json(server: ServerProcess
                                                                     ) -> None:
    piece = "héllo wörld, "
    short = post(server, "/tokenize", json.dumps({"prompt": piece})).json()
    long = post(server, "/tokenize", json.dumps({"prompt": piece * 8000}))
    assert long.headers["content-type"] == "application/json"
    body = long.json()
    assert body["tokens"] == short["tokens"] * 8000 and body["count"] == len(body["tokens"])
    assert body["count"] > 2 * 32768 and body["max_model_len"] == short["max_model_len"]
