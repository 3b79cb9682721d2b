"""The import direction of docs/architecture.md, checked from the source (lazy imports inside
functions count too): a new arrow between floors is a design change, made here and in the doc.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "everystop"

# Plain data and helpers any floor may read.
BASE = {"config", "sampling_params", "stats", "workload", "plots", "results", "subcommands",
        "startup_memory"}
# floor -> the other floors of ours it may import (besides BASE).
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "stats": set(),
    "workload": set(),
    "plots": set(),
    "results": set(),
    "subcommands": set(),
    "executor.layers": {"core"},
    "executor.models": {"core", "executor.layers"},
    "executor": {"core", "executor.layers", "executor.models"},
    "tokenizer": {"executor.models"},  # the GGUF reader, to build a tokenizer from its metadata
    "engine": {"core", "executor", "tokenizer"},
    "routing": {"core"},
    "sim": {"core", "routing"},
    "telemetry": {"core"},
    "server": {"core", "engine", "telemetry"},
    "cluster": {"core", "engine", "routing", "server", "tokenizer"},
    # the measurements time the executor's own parts (the step profile),
    # calibrate the simulator and run the routing policies in the fleet simulator
    # (bench routing --simulate); quant-accuracy rounds weights as a format holds them
    # (executor.models' round_as_held), on our model and on transformers'; the serving-path
    # profile frames each chunk as the server does (server.formatting, server.streaming)
    "bench": {"core", "engine", "tokenizer", "executor", "executor.layers", "executor.models",
              "sim", "routing", "server"},
    "entrypoints": {"core", "engine", "tokenizer", "executor.models"},
}
# Floors that must not import torch, even lazily.
NO_TORCH = {"core", "routing", "cluster", "sim", "telemetry", "server", "config",
            "sampling_params", "stats", "plots", "workload", "results", "subcommands"}


def _floor(module: str) -> str:
    parts = module.split(".")[1:]  # drop "everystop"
    if not parts:
        return "everystop"
    if parts[0] == "executor" and len(parts) > 1 and parts[1] in ("layers", "models"):
        return f"executor.{parts[1]}"
    return parts[0]


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
    return names


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        out.append((".".join(rel.parts).removesuffix(".__init__"), path))
    return out


def _violations(module: str, path: Path) -> list[str]:
    floor = _floor(module)
    found = []
    for name in _imports(path):
        if floor in NO_TORCH and name.split(".")[0] == "torch":
            found.append(f"{module} imports torch")
        if not name.startswith("everystop.") or floor not in ALLOWED:
            continue  # the top (cli, __main__, the package itself) may import anything
        target = _floor(name)
        if target != floor and target not in BASE | ALLOWED[floor]:
            found.append(f"{module} imports {name}: {floor} may import only "
                         f"{sorted(BASE | ALLOWED[floor])} (see docs/architecture.md)")
    return found


@pytest.mark.parametrize("module, path", _modules(), ids=lambda v: str(v).split("/")[-1])
def test_imports_point_down(module: str, path: Path) -> None:
    assert _violations(module, path) == []


def test_the_checker_sees_a_wrong_arrow(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import torch\n    from everystop.executor import tp_group\n")
    assert len(_violations("everystop.server.bad", bad)) == 2
    assert len(_violations("everystop.core.bad", bad)) == 2
    assert _violations("everystop.engine.bad", bad) == []
