"""What a serving process imports: the server's own modules import neither torch nor
transformers, and a server built on the default GGUF loads no package it does not serve with
(no Ray, no dataframes or plotting, no compiler stack, no transformers model code: the
tokenizer comes from its converted copy without AutoTokenizer's index of every model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
ENV = {**os.environ, "PYTHONPATH": str(SRC)}

# Packages (and subpackages) a single-process CPU server on a GGUF has no use for.
NOT_SERVED_WITH = ("ray", "pandas", "matplotlib", "scipy", "sklearn", "sympy", "accelerate",
                   "torch._dynamo", "torch._inductor", "transformers.models",
                   "transformers.generation", "everystop.cluster", "everystop.sim",
                   "everystop.bench")

# Builds the engine and the app as `everystop serve` does, then prints sys.modules instead of
# serving.
_SERVE_AND_LIST = """
import json, sys
import everystop.server.cli as cli

def list_modules(app, front, *args, **kwargs):
    front.shutdown()
    print("MODULES " + json.dumps(sorted(sys.modules)))
    return 0

cli.run_server = list_modules
from everystop.cli import main
sys.exit(main(["serve", "--port", "0", "--log-level", "warning"]))
"""


def _loaded(modules: list[str], package: str) -> bool:
    return any(m == package or m.startswith(package + ".") for m in modules)


def test_the_server_modules_import_neither_torch_nor_transformers() -> None:
    code = ("import sys, everystop.server.app, everystop.server.cli; "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], env=ENV, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    modules = json.loads(out)
    assert not _loaded(modules, "torch") and not _loaded(modules, "transformers")


@pytest.mark.model
def test_a_server_on_the_default_gguf_loads_nothing_it_does_not_serve_with() -> None:
    out = subprocess.run([sys.executable, "-c", _SERVE_AND_LIST], env=ENV, check=True,
                         capture_output=True, text=True, timeout=300).stdout
    line = next(x for x in out.splitlines() if x.startswith("MODULES "))
    modules = json.loads(line.removeprefix("MODULES "))
    assert _loaded(modules, "torch") and _loaded(modules, "tokenizers")  # it did build
    assert [p for p in NOT_SERVED_WITH if _loaded(modules, p)] == []
