"""One live `everystop serve` (the default model, small limits) for every client test here.

The clients are the real packages users install (openai, LiteLLM, LangChain, lm-eval) talking
HTTP on loopback, unchanged. One server for the whole package rather than one per module: each
start costs ~10 s of the suite's time budget and nothing here changes server state.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import ServerProcess, start_model_server

# Offline and quiet: LiteLLM would fetch its model price list at import, HF libraries the hub.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _release_engines() -> Iterator[None]:
    """Overrides the suite's per-test gc.collect(): no engine lives in these test processes
    (the server is a subprocess), and collecting the clients' large object graphs after
    every test costs seconds each."""
    yield


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # float32 KV cache and activations (no int8 rounding): lm-eval's loglikelihoods are
    # compared with transformers' float32 ones.
    proc = start_model_server(tmp_path_factory.mktemp("clients"), "--max-model-len", "1024",
                              "--kv-cache-dtype", "float32", "--int8-decode-dot", "off")
    yield proc
    proc.stop()


@pytest.fixture(scope="package")
def model_name(server: ServerProcess) -> str:
    return str(httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"])


@pytest.fixture(scope="package")
def base_url(server: ServerProcess) -> str:
    return server.url + "/v1"
