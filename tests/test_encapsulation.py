"""Each module keeps to the public surface of the others: no `x._name` on another object, and no
import circle among the modules of one package (TYPE_CHECKING and lazy imports count too: a
circle of types is a design knot as much as one of imports).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "everystop"

# (module path, the expression as ast.unparse writes it): underscore names a library makes us use.
ALLOWED_PRIVATE = {
    # argparse names its group and sub-parser types only privately; we annotate with them
    ("engine/args.py", "argparse._ArgumentGroup"),
    ("entrypoints/generate.py", "argparse._SubParsersAction"),
    ("sim/cli.py", "argparse._SubParsersAction"),
    ("executor/models/cli.py", "argparse._SubParsersAction"),
    # oneDNN's fused linear and its bf16 probe are exposed only as private torch ops
    ("executor/layers/linear.py", "torch.ops.mkldnn._linear_pointwise"),
    ("executor/layers/linear.py", "torch.ops.mkldnn._is_mkldnn_bf16_supported"),
    # ProcessGroupNCCL.Options takes its timeout only through this attribute
    ("executor/tp_group.py", "opts._timeout"),
    # the namedtuple API: prometheus_client's Sample is one
    ("server/metrics.py", "s._replace"),
    ("server/metrics_names.py", "s._replace"),
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        out[".".join(rel.parts).removesuffix(".__init__")] = path
    return out


def _own(node: ast.expr, classes: set[str]) -> bool:
    """self, cls, type(self), super(), or a class this code sits in."""
    if isinstance(node, ast.Name):
        return node.id in {"self", "cls"} | classes
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return node.func.id == "super" or (node.func.id == "type" and len(node.args) == 1
                                           and _own(node.args[0], classes))
    return False


def _private_accesses(path: Path) -> list[str]:
    found = []

    def visit(node: ast.AST, classes: set[str]) -> None:
        if isinstance(node, ast.ClassDef):
            classes = classes | {node.name}
        if isinstance(node, ast.Attribute):
            name = node.attr
            dunder = name.startswith("__") and name.endswith("__")
            if name.startswith("_") and not dunder and not _own(node.value, classes):
                found.append(ast.unparse(node))
        for child in ast.iter_child_nodes(node):
            visit(child, classes)

    visit(ast.parse(path.read_text()), set())
    return found


def test_no_module_reaches_into_another_objects_private_names() -> None:
    bad = []
    for path in _modules().values():
        rel = path.relative_to(PACKAGE).as_posix()
        bad += [f"{rel}: {expr}" for expr in _private_accesses(path)
                if (rel, expr) not in ALLOWED_PRIVATE]
    assert not bad, "underscore names used from outside their object:\n" + "\n".join(bad)


def test_the_private_access_check_sees_a_reach_in() -> None:
    tree_src = "class A:\n    def f(self, other):\n        return self._a, other._b, A._c\n"
    found = []
    for node in ast.walk(ast.parse(tree_src)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            found.append(ast.unparse(node))
    assert found  # the parse sees them; _own decides which are ours:
    assert [e for e in found if not _own(ast.parse(e, mode="eval").body.value, {"A"})] \
        == ["other._b"]


def _package_edges() -> dict[str, set[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                targets += [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            for t in targets:
                same_package = t.rsplit(".", 1)[0] == module.rsplit(".", 1)[0]
                if t in modules and t != module and same_package \
                        and modules[t].name != "__init__.py":
                    edges[module].add(t)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in edges:
        if v not in index:
            connect(v)
    return out


def test_no_import_circles_inside_a_package() -> None:
    assert _cycles(_package_edges()) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    edges = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert _cycles(edges) == [["p.a", "p.b", "p.c"]]
