"""Property-based HTTP fuzzing from our own /openapi.json: whatever schemathesis sends (valid
bodies and near-misses), the server never answers 5xx."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from everystop.engine.async_engine import AsyncEngine
from everystop.server.app import build_app
from tests.engine.toy_engine import make_toy_engine
from tests.server.fakes import ChatCharTokenizer

_engine = make_toy_engine(max_model_len=256, max_num_batched_tokens=256)
_engine.tokenizer = ChatCharTokenizer()
# NOTE: built at import, as schemathesis needs the schema to generate the tests; its thread
# idles between examples and is stopped when the module is done.
_front = AsyncEngine(_engine)
schema = schemathesis.openapi.from_asgi("/openapi.json", build_app(_front, "toy"))
# Valid bodies and schema violations both, NULs in text included.
schema.config.generation.update(modes=list(schemathesis.GenerationMode), allow_x00=True)


@pytest.fixture(scope="module", autouse=True)
def _stop_engine() -> Iterator[None]:
    yield
    _front.shutdown()


@schema.parametrize()
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_5xx_from_any_generated_request(case: schemathesis.Case) -> None:
    case.call_and_validate(checks=[not_a_server_error])


def test_schema_and_docs_describe_the_real_request_bodies() -> None:
    from starlette.testclient import TestClient

    client = TestClient(build_app(_front, "toy"))
    assert client.get("/docs").status_code == 200
    spec = client.get("/openapi.json").json()
    components = spec["components"]["schemas"]
    for path, model, fields in [
            ("/v1/completions", "CompletionRequest", {"prompt", "max_tokens", "n", "stream"}),
            ("/v1/chat/completions", "ChatCompletionRequest", {"messages", "tools", "n"}),
            ("/tokenize", "TokenizeRequest", {"prompt"})]:
        post = spec["paths"][path]["post"]
        ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/" + model)
        assert fields <= set(components[model]["properties"]), path
        assert {"400", "413", "415", "429"} <= set(post["responses"])
