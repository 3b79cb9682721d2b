"""The README's own examples, run verbatim: its curl against `everystop serve` with the default
flags (only the port, the host's KV budget and the log level differ), and its Python block.
Both are read out of README.md, so the test breaks when the README drifts from what works."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from .conftest import ROOT, ServerProcess, free_port

pytestmark = [pytest.mark.model, pytest.mark.server]

README = (ROOT / "README.md").read_text()


def readme_curl() -> str:
    """The first curl command, with its backslash-continued lines."""
    m = re.search(r"^curl (?:[^\n]*\\\n)*[^\n]*$", README, re.MULTILINE)
    assert m, "README.md has no curl example"
    return m.group(0)


def readme_python() -> str:
    m = re.search(r"```python\n(.*?)```", README, re.DOTALL)
    assert m, "README.md has no python example"
    return m.group(1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    cmd = [sys.executable, "-m", "everystop", "serve", "--log-level", "warning",
           "--kv-cache-memory", "128MiB"]
    proc = ServerProcess(cmd, free_port(), tmp_path_factory.mktemp("readme") / "server.log")
    proc.wait_ready(120)
    yield proc
    proc.stop()


def test_readme_curl_runs_verbatim(server: ServerProcess) -> None:
    command = readme_curl()
    assert "127.0.0.1:8000" in command
    out = subprocess.run(["bash", "-c", command.replace(":8000", f":{server.port}")],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    body = json.loads(out)
    assert "error" not in body, body
    assert body["model"] == "SmolLM2-135M-Instruct"
    assert body["choices"][0]["message"]["content"].strip()


def test_models_by_id(server: ServerProcess) -> None:
    card = httpx.get(server.url + "/v1/models/SmolLM2-135M-Instruct", timeout=10).json()
    assert card["id"] == "SmolLM2-135M-Instruct" and card["object"] == "model"
    assert card["max_model_len"] > 2048  # the model's own context, not the old fixed default
    # The file's full stem is still accepted (clients configured before the rename).
    old = httpx.get(server.url + "/v1/models/SmolLM2-135M-Instruct.Q4_1", timeout=10)
    assert old.status_code == 200
    missing = httpx.get(server.url + "/v1/models/gpt-4", timeout=10)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def test_readme_python_runs_verbatim() -> None:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(readme_python(), "README.md", "exec"), {})
    lines = printed.getvalue().splitlines()
    assert len(lines) >= 2 and "Paris" in lines[0]
