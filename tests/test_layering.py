"""Imports follow the data flow (DESIGN.md, issues 14 and 33): every module of symgrad/ sits in one
layer, imports only its own layer and the layers its row in ALLOWED names, and no import circle
exists. There is no exception: the export, which renders a step's programs for C and CUDA, is a
back end (symgrad/backends/export/) that step.export runs, not an application.

The module graph is computed, not listed: every import statement of every module, at the top or
inside a function, is read with `ast` and resolved to the symgrad module it names (`from .x import
y` names module x.y where that is a module, else x). Importing a module runs its packages'
`__init__` first; those edges count too, but for a module's own packages and the root `symgrad`
(the public API, imported before anything else). An import that breaks a rule is a failure
naming its file and line. The applications (tools/) import the public API only: the graph API, the
compiled step with its call checks, the root, the leaves, and the modules of the back end
PUBLIC_SURFACE names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "symgrad"

# Layers, in the order of the flow; each module is in the layer of its longest matching prefix.
# The folders are the layers (DESIGN.md's layout); the few modules listed by name sit in a folder
# for what they are about and in a layer for what they import.
LAYERS = {
    # leaves: settings, the version, torch's spelling of dims, the status codes, the narrow limit, the
    # numbers an exported library shares with Python; they import nothing of symgrad
    "leaf": ("symgrad.settings", "symgrad.version", "symgrad.api.spellings", "symgrad.backends.status",
             "symgrad.narrow_limit", "symgrad.backends.export.formats"),
    "ir": ("symgrad.ir",),
    "passes": ("symgrad.passes",),
    # the graph API: the functions on graph values, gradients, modules, optimizers
    "api": ("symgrad.api", "symgrad.autodiff", "symgrad.nn", "symgrad.optim"),
    # backends, by stage: the plan's types; decide; lower (one module per kernel kind); render; build
    "plan": ("symgrad.backends.plan", "symgrad.backends.views"),
    # decide's choices, one function each (the stage that runs them all is below, in "stages")
    "decide": ("symgrad.backends.decide",),
    # what renders C and CUDA: the shared renderer, the languages' rows, expressions and printers
    "render": ("symgrad.backends.render",),
    # one module per kernel kind: its kernel type, choice, lowering, render and report line
    "kinds": ("symgrad.backends.kinds",),
    # the stages, each dispatching to the kinds: decide, lower (and plan memory), render the program
    "stages": ("symgrad.backends.decide.decisions", "symgrad.backends.lower", "symgrad.backends.render.program"),
    "build": ("symgrad.backends.build",),
    # the runtime (GEMM, exp, Philox): rendered from its templates and built once per compiler and flags,
    # and the vector width its tiles take on this machine (measured by a probe rendered from a template)
    "runtime": ("symgrad.backends.build.runtime", "symgrad.backends.build.vector_width"),
    # the checks of a call's arrays, before any native code runs (the programs' and the steps')
    "checks": ("symgrad.step.call_checks",),
    # the backends' programs: the driver through the stages, the native programs, the report, and
    # the program cache (which keeps a compiled program's plan and report)
    "programs": ("symgrad.backends", "symgrad.backends.build.program_cache"),
    # compiled functions and train steps
    "step": ("symgrad.step",),
    # the applications: users of everything below; the root package re-exports the public API
    "tools": ("symgrad.tools",),
    "public": ("symgrad",),
}
_BELOW_STEP = {"leaf", "ir", "passes", "api", "plan", "decide", "render", "kinds", "stages", "build", "runtime",
               "checks", "programs"}
ALLOWED = {
    "leaf": set(),
    "ir": {"leaf"},
    "passes": {"leaf", "ir"},
    "api": {"leaf", "ir"},
    "plan": {"leaf", "ir"},
    "decide": {"leaf", "ir", "passes", "plan"},
    "render": {"leaf", "ir", "plan"},
    "kinds": {"leaf", "ir", "plan", "decide", "render", "runtime"},
    "stages": {"leaf", "ir", "passes", "plan", "decide", "render", "kinds", "runtime"},
    "build": {"leaf"},
    "runtime": {"leaf", "ir", "decide", "render", "build"},
    "checks": {"leaf", "ir"},
    "programs": {"leaf", "ir", "passes", "plan", "decide", "render", "kinds", "stages", "build", "runtime", "checks"},
    "step": _BELOW_STEP,
    # the applications use the public API: the graph API, the compiled step (with its call checks)
    # and the root; PUBLIC_SURFACE lists what else they read
    "tools": {"leaf", "ir", "api", "checks", "step", "public"},
    "public": _BELOW_STEP | {"step", "tools"},
}
# Modules of the back end that are part of the public API's surface, which the applications read.
PUBLIC_SURFACE = {
    "symgrad.backends": "the backend names a user passes (sg.function(..., backend=...))",
    "symgrad.backends.report": "the Report that step.report() returns, and its byte formatting",
}
# Imports between two tools: the command line runs the others; the rest use what they name.
TOOL_IMPORTS = {
    "symgrad.tools.cli": {"symgrad.tools.demo", "symgrad.tools.demo_gpt", "symgrad.tools.export", "symgrad.tools.inspect"},
    "symgrad.tools.demo": {"symgrad.tools.data"},
    "symgrad.tools.demo_gpt": {"symgrad.tools.demo"},
    "symgrad.tools.inspect": {"symgrad.tools.inspect_html"},
    "symgrad.tools.distributed": {"symgrad.tools.buckets"},
    "symgrad.tools.export": {"symgrad.tools.export_training"},
}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of everything of symgrad that `path` (in the package at `root`) imports:
    a module, or a name inside one."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for block in ast.walk(tree):   # `if TYPE_CHECKING:` imports are for annotations only: never run
        if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING":
            block.body = []
    for node in ast.walk(tree):
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
                # `from .. import functional` and `from .ir import value` name modules inside the package
                # they read from; `from .ir.value import Value`, a name inside a module (module_graph
                # resolves each to the module it is).
                found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return found


def module_graph(root: Path = PACKAGE) -> dict[str, dict[str, str]]:
    """importer -> {imported module: where ("file:line")}, for every module of the package at `root`."""
    paths = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    top = root.name
    # A package whose __init__ holds nothing but its docstring runs nothing when a module inside it
    # is imported: importing it is no edge (the folders of the layout are such packages).
    empty = {name for name, path in paths.items() if path.name == "__init__.py" and _only_a_docstring(path)}
    graph: dict[str, dict[str, str]] = {}
    for name, path in paths.items():
        edges = graph.setdefault(name, {})
        for line, target in _imports(path, root):
            where = f"{path.relative_to(root.parent)}:{line}"
            for imported in _targets(target, paths, top):
                if imported != name and not name.startswith(imported + ".") and imported not in edges \
                        and imported not in empty:
                    edges[imported] = where
    return graph


def _only_a_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) for s in body)


def _targets(target: str, modules: dict, top: str) -> list[str]:
    """The modules importing `target` runs: itself (or the module holding the name it names), and
    the packages above it but the root."""
    while target not in modules and "." in target:
        target = target.rpartition(".")[0]
    parts = target.split(".")
    return [".".join(parts[:k]) for k in range(2, len(parts))] + ([target] if target != top else [])


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def layer_of(module: str) -> str:
    """The layer of the longest prefix of `module` that LAYERS lists; KeyError for none."""
    best = max(((prefix, layer) for layer, prefixes in LAYERS.items() for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), key=lambda p: len(p[0]), default=None)
    if best is None:
        raise KeyError(f"{module} is in no layer: add it to LAYERS in tests/test_layering.py")
    return best[1]


def violations(graph: dict[str, dict[str, str]]) -> dict[tuple[str, str], str]:
    """(importer, imported) -> "file:line importer (layer) imports imported (layer)" for every import
    against the layers."""
    out = {}
    for importer, edges in graph.items():
        mine = layer_of(importer)
        for imported, where in edges.items():
            theirs = layer_of(imported)
            if theirs == mine:
                if mine != "tools" or imported in TOOL_IMPORTS.get(importer, ()) \
                        or imported.split(".")[:3] == importer.split(".")[:3]:
                    continue
            elif theirs in ALLOWED[mine] or (mine == "tools" and imported in PUBLIC_SURFACE):
                continue
            out[(importer, imported)] = f"{where} {importer} ({mine}) imports {imported} ({theirs})"
    return out


# ---------------------------------------------------------------------------------------------


def test_every_module_has_a_layer():
    assert [m for m in module_graph() if _unlayered(m)] == []


def _unlayered(module: str) -> bool:
    try:
        layer_of(module)
    except KeyError:
        return True
    return False


def test_no_import_circle():
    assert cycles(module_graph()) == []


def test_every_layer_imports_only_itself_and_what_it_builds_on():
    assert sorted(violations(module_graph()).values()) == []


def test_the_check_sees_function_level_and_relative_imports(tmp_path):
    """The reader resolves `from .. import x` inside a function: a violation of that form is found."""
    sample = PACKAGE / "ir" / "value.py"
    lines = [target for _, target in _imports(sample)]
    assert "symgrad.ir.registry.OpDef" in lines and "symgrad.ir.shapes" in lines
    fake = tmp_path / "symgrad" / "ir" / "bad.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from ..api import functional\n    from ..backends.build.cache import cache_dir\n")
    assert [t for _, t in _imports(fake, tmp_path / "symgrad")] == ["symgrad.api.functional",
                                                                    "symgrad.backends.build.cache.cache_dir"]


def _package(tmp_path, files: dict) -> Path:
    root = tmp_path / "symgrad"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_forbidden_import_or_a_circle_fails(tmp_path):
    """What the tests above would report: an upward import with its line, a circle with its members,
    and a package's __init__ run by importing a module inside it."""
    root = _package(tmp_path, {
        "ir/__init__.py": "", "ir/value.py": "from ..api.functional import add\n",
        "api/__init__.py": "", "api/functional.py": "def add():\n    from ..ir import value\n",
        "passes/__init__.py": "", "passes/cse.py": "from ..backends.c import x\n",
        "backends/__init__.py": "from . import c\n", "backends/c.py": "import symgrad.step.compiled\n",
        "step/__init__.py": "import symgrad.passes\n", "step/compiled.py": "from ..ir.value import Value\n",
    })
    graph = module_graph(root)
    assert graph["symgrad.passes.cse"] == {"symgrad.backends": "symgrad/passes/cse.py:1",
                                           "symgrad.backends.c": "symgrad/passes/cse.py:1"}
    assert cycles(graph) == [["symgrad.api.functional", "symgrad.ir.value"]]
    found = violations(graph)
    assert found[("symgrad.ir.value", "symgrad.api.functional")] == \
        "symgrad/ir/value.py:1 symgrad.ir.value (ir) imports symgrad.api.functional (api)"
    assert ("symgrad.passes.cse", "symgrad.backends.c") in found and ("symgrad.backends.c", "symgrad.step.compiled") in found
    assert ("symgrad.step.compiled", "symgrad.ir.value") not in found and ("symgrad.api.functional", "symgrad.ir.value") not in found
    # step/__init__ runs an import: importing step.compiled runs it (an edge); api/__init__ is empty (none)
    assert ("symgrad.backends.c", "symgrad.step") in found and "symgrad.api" not in graph["symgrad.ir.value"]


@pytest.mark.parametrize("module, layer", [("symgrad.ir.value", "ir"), ("symgrad.backends.plan", "plan"),
                                           ("symgrad.backends.c", "programs"), ("symgrad.nn.layers", "api"),
                                           ("symgrad", "public"), ("symgrad.backends", "programs"),
                                           ("symgrad.backends.export.library", "programs"),
                                           ("symgrad.backends.export.formats", "leaf")])
def test_layer_of_takes_the_longest_prefix(module, layer):
    assert layer_of(module) == layer


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
