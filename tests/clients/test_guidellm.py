"""guidellm, unchanged, benchmarking the server with its default backend and request: streamed
chat completions whose token counts come from vLLM's `stream_options.continuous_usage_stats`.
Sixteen requests of synthetic text all complete, and the report has real (non-zero) time to
first token and inter-token latency, and the output lengths the server reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import ServerProcess

pytestmark = [pytest.mark.model, pytest.mark.server]

OUTPUT_TOKENS = 8


def test_streaming_benchmark_of_16_requests(server: ServerProcess, tmp_path: Path) -> None:
    from everystop.tokenizer import load_tokenizer

    # guidellm counts synthetic prompt tokens with a Hugging Face tokenizer: the model's own,
    # saved where it can load it offline.
    tokenizer_dir = tmp_path / "tokenizer"
    load_tokenizer().hf_tokenizer.save_pretrained(tokenizer_dir)
    report = tmp_path / "benchmark.json"
    guidellm = Path(sys.executable).with_name("guidellm")
    cmd = [str(guidellm), "run",
           "--backend", f"kind=openai_http,target={server.url}",
           "--profile", "kind=concurrent,streams=8",
           "--constraint", "kind=max_requests,count=16",
           "--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens={OUTPUT_TOKENS}",
           "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}",
           "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    metrics = benchmark["metrics"]
    assert metrics["request_totals"] == {"successful": 16, "errored": 0, "incomplete": 0,
                                         "total": 16}
    ttft = metrics["time_to_first_token_ms"]["successful"]
    itl = metrics["inter_token_latency_ms"]["successful"]
    assert ttft["count"] == 16 and ttft["min"] > 0
    assert itl["count"] == 16 * (OUTPUT_TOKENS - 1) and itl["min"] > 0
    assert metrics["output_token_count"]["successful"]["mean"] == OUTPUT_TOKENS
