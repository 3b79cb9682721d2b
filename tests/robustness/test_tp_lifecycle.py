"""Tensor parallelism the way people call it: a script with no main guard, read from stdin,
that never calls shutdown. It must start (its workers do not re-run the script), print its
results, and end silently with exit code 0, every time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from everystop.executor.models.loader import default_model_path
from tests.tiny_llama import tiny_llama_dir

ROOT = Path(__file__).resolve().parents[2]
RUNS = 5
SCRIPT = """
from everystop import LLM, SamplingParams
llm = LLM({model!r}, tokenizer={tokenizer!r}, tensor_parallel_size=2, max_num_seqs=4,
          max_model_len=128, kv_cache_memory=8 << 20, swap_space_gib=0.01,
          kv_cache_dtype="float32")
prompts = [[(7 * i + 13 * j) % 250 for j in range(2 + 5 * i)] for i in range(6)]
outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                    use_tqdm=False)
print("RESULT", [o.outputs[0].token_ids for o in outs])
"""


pytestmark = pytest.mark.slow  # five runs of a two-process engine: ~30 s


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_llama_dir(tmp_path_factory, "tiny_tp_script", kv_heads=2)


def test_tp_script_from_stdin_without_main_guard_ends_silently_with_0(tiny: str) -> None:
    script = SCRIPT.format(model=tiny, tokenizer=default_model_path())
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    results = []
    for _ in range(RUNS):
        run = subprocess.run([sys.executable, "-"], input=script, capture_output=True,
                             text=True, env=env, cwd=ROOT, timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "exited with code" not in run.stderr and "terminate called" not in run.stderr
        assert "Traceback" not in run.stderr, run.stderr[-3000:]
        [line] = [x for x in run.stdout.splitlines() if x.startswith("RESULT")]
        results.append(line)
    assert len(set(results)) == 1  # greedy: the same tokens every run
