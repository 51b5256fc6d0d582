"""The package's layers import one way (issue 14, item 4): ir below passes below backends.

Every import statement of every module, at the top or inside a function, is read
with `ast` and resolved to the symgrad module it names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "symgrad"
# A layer may import itself, the layers below it, and the leaf modules that import nothing of symgrad.
LEAVES = ("symgrad.settings",)
ALLOWED = {
    "symgrad.ir": ("symgrad.ir",),
    "symgrad.passes": ("symgrad.ir", "symgrad.passes"),
}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, absolute module name) of every symgrad module `path` (in the package at `root`) imports."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("symgrad")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("symgrad"):
                # `from .. import functional` names a module inside the package it reads from.
                names = [f"{target}.{alias.name}" for alias in node.names] if not node.module else [target]
                found += [(node.lineno, n) for n in names]
    return found


def _violations(layer: str) -> list[str]:
    allowed = ALLOWED[layer] + LEAVES
    out = []
    for path in sorted((PACKAGE / layer.split(".")[1]).rglob("*.py")):
        for line, target in _imports(path):
            if not any(target == a or target.startswith(a + ".") for a in allowed):
                out.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    return out


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_itself_and_below(layer):
    assert _violations(layer) == []


def test_the_check_sees_function_level_and_relative_imports(tmp_path):
    """The reader resolves `from .. import x` inside a function: a violation of that form is found."""
    sample = PACKAGE / "ir" / "value.py"
    lines = [target for _, target in _imports(sample)]
    assert "symgrad.ir.registry" in lines and "symgrad.ir.shapes" in lines
    fake = tmp_path / "symgrad" / "ir" / "bad.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from .. import functional\n    from ..backends.cache import cache_dir\n")
    assert [t for _, t in _imports(fake, tmp_path / "symgrad")] == ["symgrad.functional", "symgrad.backends.cache"]


def test_autodiff_and_the_passes_leave_the_op_registry_as_it_was():
    """Derivatives and simplified chains are ops that travel on their nodes, not global entries."""
    import symgrad as sg
    from symgrad.ir.registry import REGISTRY

    before = dict(REGISTRY)
    x, y = sg.input("x", (sg.Dim("B"), 5), dtype="float64"), sg.input("y", (sg.Dim("B"),), dtype="int64")
    model = sg.nn.Sequential(sg.nn.Linear(5, 4), sg.nn.GELU(), sg.nn.LayerNorm(4), sg.nn.Linear(4, 3)).double()
    step = sg.train_step(sg.cross_entropy(model(x), y), model.parameters(), sg.optim.AdamW(), backend="c")
    hessian = sg.grad(sg.sum(sg.grad(sg.sum(sg.sigmoid(x) * sg.tanh(x)), [x])[0]), [x])
    assert step.optimized_graph.nodes and hessian
    assert REGISTRY == before
