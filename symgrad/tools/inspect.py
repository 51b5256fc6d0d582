"""`symgrad inspect FILE`: show what symgrad makes of a model file.

The file is a Python script defining `build()`, which returns the loss and
the parameters to train, and optionally the optimizer:

    def build():
        x = sg.input("x", (sg.Dim("B"), 4)); y = sg.input("y", (sg.Dim("B"),), dtype="int64")
        model = sg.nn.Linear(4, 3)
        return sg.cross_entropy(model(x), y), model.parameters()   # or (loss, params, optimizer)

(a dict with keys "loss", "params" and optionally "optimizer" works too;
the default optimizer is SGD(lr=0.1)). `run_inspect` prints the forward
graph, the forward + backward graph and the autograd-style backward chain,
and writes into `out_dir`: graph.dot (the whole training step), graph.svg
when Graphviz's `dot` is installed, and step.c, the generated C. With `html=`, it
also writes one self-contained page (symgrad.tools.inspect_html): the graph, the memory plan
as a timeline, the kernel table and, with `profile_steps=`, the profile of that many
calls on generated inputs (`step.profile()`).
"""

from __future__ import annotations

import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from .. import optim
from ..autodiff import grad
from ..step.call_checks import collect_inputs
from ..step.training import param_groups, train_step
from ..api.effects import collect, merge
from ..ir.graph import Graph
from ..ir.printing import backward_chain
from ..ir.value import Value


def load_build(path: str | Path, with_predict: bool = False) -> tuple:
    """Run the file and call its build(); returns (loss, params, optimizer), and the dict's
    "predict" entry (None if none) after them with `with_predict`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"inspect: no such file {str(path)!r}")
    namespace = runpy.run_path(str(path), run_name="__symgrad_inspect__")
    build = namespace.get("build")
    if not callable(build):
        raise ValueError(f"inspect: {path} must define build() returning (loss, params[, optimizer])")
    result = build()
    predict = None
    if isinstance(result, dict):
        loss, params, optimizer = result.get("loss"), result.get("params"), result.get("optimizer")
        predict = result.get("predict")
    elif isinstance(result, (tuple, list)) and len(result) in (2, 3):
        loss, params, optimizer = (*result, None) if len(result) == 2 else result
    else:
        raise ValueError(f"inspect: build() in {path} must return (loss, params[, optimizer]) or a dict, "
                         f"got {type(result).__name__}")
    if not isinstance(loss, Value):
        raise TypeError(f"inspect: build() returned a {type(loss).__name__} as the loss, not a graph value")
    param_groups(params)  # checked here, so that a bad entry is reported before anything is built
    if with_predict:
        return loss, params, optimizer or optim.SGD(lr=0.1), predict
    return loss, params, optimizer or optim.SGD(lr=0.1)


DEFAULT_DIM = 16  # the size a Dim takes in the profile's generated inputs unless `dims` gives one


def example_inputs(graph, dims: dict | None = None, seed: int = 0) -> dict:
    """Arrays for the graph's inputs by name, for a profile: floats drawn from N(0, 1), integers
    zero (a valid class label and a valid index, whatever the model); each Dim `dims[name]`,
    else DEFAULT_DIM."""
    from ..ir import dtypes as D
    from ..ir import shapes as S

    rng = np.random.default_rng(seed)
    values: dict = {}
    for v in graph.inputs:
        for size in v.shape:
            for symbol in getattr(size, "free_symbols", ()):
                values.setdefault(symbol, int((dims or {}).get(str(symbol), DEFAULT_DIM)))
    arrays = {}
    for v in graph.inputs:
        shape, dtype = S.evaluate_shape(v.shape, values), D.to_numpy(v.dtype)
        arrays[v.name] = (rng.standard_normal(shape).astype(dtype) if np.issubdtype(dtype, np.floating)
                          else np.zeros(shape, dtype))
    return arrays


def run_inspect(path: str | Path, out_dir: str | Path, backend: str = "c", file=None,
                report: bool = False, html: str | Path | None = None, profile_steps: int = 0,
                dims: dict | None = None) -> dict:
    """Print the graphs of the model in `path`, write graph.dot / graph.svg / step.c to `out_dir`.

    report: also print the compiled step's report (`step.report()`: a summary, then passes,
    kernels, save/recompute choices, memory plan, compile time by stage).
    html: also write that page (symgrad.tools.inspect_html): the graph, the memory plan as a
    timeline, the kernel table; with `profile_steps` > 0, the profile of that many calls
    (`step.profile()`) on generated inputs (`example_inputs`, each Dim `dims[name]`).

    Returns {"dot": path, "svg": path or None, "source": path or None, "html": path or None}.
    The generated source is skipped, with a note, when `backend` cannot build.
    """
    out = file or sys.stdout
    loss, params, optimizer = load_build(path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    inputs = collect_inputs([loss])
    groups = params
    params, options = param_groups(groups)
    grads = grad(loss, params)

    def section(title: str, body: str) -> None:
        print(f"== {title} ==", file=out)
        print(body, file=out)
        print(file=out)

    section("forward graph", str(Graph(inputs, [loss])))
    section("forward + backward graph (outputs: loss, then d loss / d " + ", ".join(p.name for p in params) + ")",
            str(Graph(inputs, [loss, *grads])))
    section("backward chain (as print_graph)", backward_chain(loss))

    step_graph = Graph(inputs, [loss], merge(optimizer.updates(params, grads, options), collect([loss])))
    written: dict = {"dot": out_dir / "graph.dot", "svg": None, "source": None, "html": None}
    written["dot"].write_text(step_graph.to_dot() + "\n")
    dot = shutil.which("dot")
    if dot:
        svg = out_dir / "graph.svg"
        subprocess.run([dot, "-Tsvg", str(written["dot"]), "-o", str(svg)], check=True)
        written["svg"] = svg
    try:
        step = train_step(loss, groups, optimizer, backend=backend)
    except NotImplementedError as exc:
        if html is not None:
            raise
        print(f"(no generated source: {exc})", file=out)
    else:
        source = out_dir / ("step.c" if backend == "c" else f"step.{backend}.txt")
        source.write_text(step.source)
        written["source"] = source
        if report:
            section("compilation report", str(step.report()))
        if html is not None:
            written["html"] = _write_page(html, Path(path).name, step, written, profile_steps, dims)
    for kind, where in written.items():
        if where is not None:
            print(f"wrote {kind}: {where}", file=out)
    return written


def _write_page(html, title: str, step, written: dict, profile_steps: int, dims: dict | None) -> Path:
    """The page of `symgrad inspect --html`: the step's report, its graph (the SVG written
    beside it, else the DOT text) and, with `profile_steps`, its profile."""
    from .inspect_html import write_html

    profile = None
    if profile_steps:
        profile = step.profile(steps=profile_steps, **example_inputs(step.graph, dims))
    svg = written["svg"].read_text() if written["svg"] else None
    return write_html(html, f"symgrad inspect {title}", step.report(), written["dot"].read_text(), svg, profile)
