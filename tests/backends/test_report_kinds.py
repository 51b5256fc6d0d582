"""step.report() words every kernel kind the C back end has (issue 32, defect 5).

The report used to pick each kernel's line from an isinstance chain whose last branch took any
kernel for a matmul, so a step holding a kind the chain did not list (a SyncBatchNorm's
all_reduce: CollectiveKernel) raised AttributeError. Each kernel type now words its own line
(`report_line`) and names the kind the count line counts it as (`report_kind`).

One step here holds every kernel type and every variant the report distinguishes (copies,
loops, fused prologues and epilogues, row kernels, batched, gathered, direct and Winograd
products, gathers, fused attention, collectives, embeds and sums stored in place); the check
that enumerates the kernel types defined in symgrad.backends fails when a type is added without
a report line, or without a place in that step.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

import numpy as np
import pytest

import symgrad as sg
import symgrad.backends
import symgrad.backends.kinds
from symgrad.backends import report as R
from symgrad.backends.kinds import KINDS
from symgrad.backends.plan import Swap

pytest.importorskip("symgrad.backends.c")


def kernel_types() -> set[type]:
    """Every kernel type defined in symgrad.backends and its kinds: a dataclass with a name, the IR
    lines it computes and a kind (what the plans hold and the renderer dispatches on)."""
    found = set()
    packages = [("symgrad.backends", symgrad.backends), ("symgrad.backends.kinds", symgrad.backends.kinds)]
    for package, info in [(name, info) for name, p in packages for info in pkgutil.iter_modules(p.__path__)]:
        module = importlib.import_module(f"{package}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or not dataclasses.is_dataclass(cls):
                continue
            if {"name", "lines", "kind"} <= {f.name for f in dataclasses.fields(cls)}:
                found.add(cls)
    return found


def _every_kind_step():
    """A C train step whose plan holds every kernel type (and variant) the report tells apart."""
    rng = np.random.default_rng(0)
    image = sg.input("image", (2, 16, 8, 8))
    ids = sg.input("ids", (2, 4), dtype="int64")
    labels = sg.input("labels", (2,), dtype="int64")
    layers = sg.nn.ModuleDict({                     # one module: its parameters get distinct names
        "wide": sg.nn.Conv2d(16, 32, 5, padding=2),       # 32 outputs: the GEMM gathers its patches
        "winograd": sg.nn.Conv2d(16, 16, 3, padding=1),   # 3x3, stride 1, 16 in and out: Winograd's
        "narrow": sg.nn.Conv2d(1, 6, 5, padding=2),       # 6 outputs per image: the direct convolution
        "norm": sg.nn.SyncBatchNorm(16),                  # statistics summed over processes: all_reduce
        "table": sg.nn.Embedding(10, 8),                  # take, and scatter_add in its gradient
        "head": sg.nn.Linear(10, 5),                      # a product with its bias and relu as epilogue
    })
    wide, winograd, narrow, norm, table, head = (layers[name] for name in layers.keys())
    h = norm(winograd(image))
    features = sg.mean(sg.relu(wide(h)), axis=(1, 2, 3)) + sg.mean(narrow(h[:, :1]), axis=(1, 2, 3))
    tokens = table(ids)                                            # (2, 4, 8)
    q = sg.transpose(sg.reshape(tokens, (2, 4, 2, 4)), (0, 2, 1, 3))  # (2, 2, 4, 4): heads of 4
    attended = sg.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    scores = q @ sg.transpose(q, (0, 1, 3, 2))                     # a batched product
    merged = sg.reshape(sg.transpose(attended, (0, 2, 1, 3)), (2, 4, 8))
    joined = sg.concat([merged[:, :2], tokens[:, 2:]], axis=1)
    padded = sg.pad(joined, (1, 1))                                # an embed: zeroes its border only
    pooled = sg.sum(sg.relu(head(padded)), axis=1)                 # (2, 5)
    logits = pooled + sg.reshape(features, (2, 1)) + sg.sum(scores * scores, axis=(1, 2, 3))[:, None]
    loss = sg.cross_entropy(logits, labels) + sg.sum(tokens * tokens) * 1e-3
    step = sg.train_step(loss, params=list(layers.parameters()), optimizer=sg.optim.SGD(lr=0.01), backend="c")
    step(image=rng.standard_normal((2, 16, 8, 8)).astype(np.float32), ids=rng.integers(0, 10, (2, 4)),
         labels=rng.integers(0, 5, 2))
    return step


@pytest.fixture(scope="module")
def step():
    return _every_kind_step()


def test_the_report_words_every_kernel_of_a_step_holding_every_kind(step):
    text = step.report()
    # Printed for the reader of a failure (pytest shows captured output then).
    print(text, step.optimized_graph, step.source, sep="\n\n")
    plan = step.program.plan
    for k in plan.kernels:
        assert f"{k.name:<32} {k.report_line()}" in text, k.name
    assert {type(k) for k in plan.kernels} == kernel_types()
    counts = R.kernel_counts(plan)
    for kind in [kind for kind, _ in R.COUNTED] + list(R.WORDS):
        assert counts.get(kind), (kind, counts)
    assert R.count_line(counts) in text
    # The products' variants, each named in the report's gathers by purpose and its kernel line.
    for words in ("implicit GEMM", "direct convolution", "Winograd's", "batched over", "fused op(s)",
                  "all_reduce", "fused attention (causal)"):
        assert words in text, words


PROTOCOL = ("reads", "writes", "swap", "flops", "report_line")


def test_every_kernel_type_is_a_kind_of_the_table_and_answers_the_protocol():
    """Each kernel type defined in symgrad.backends is one row of the kinds table (its render,
    the op kinds it lowers, its words in the report) and answers the kernel protocol: reads,
    writes, swap, flops, report_line and report_kind (a type added without them fails here
    before any step reaches the report)."""
    assert {kind.kernel for kind in KINDS.values()} == kernel_types()
    for name, kind in KINDS.items():
        cls = kind.kernel
        assert next(f.default for f in dataclasses.fields(cls) if f.name == "kind") == name, cls.__name__
        for method in PROTOCOL:
            assert callable(getattr(cls, method, None)), (cls.__name__, method)
        assert hasattr(cls, "report_kind") and kind.words and callable(kind.render), cls.__name__


def test_every_kernel_of_the_step_answers_the_protocol(step):
    """reads/writes give buffers, swap with nothing mapped gives the kernel itself, flops counts."""
    for k in step.program.plan.kernels:
        assert all(b is not None for b in [*k.reads(), *k.writes()]), k.name
        same = k.swap(Swap({}))
        assert type(same) is type(k) and [*map(id, same.reads())] == [*map(id, k.reads())], k.name
        assert k.flops(lambda size: int(sg.ir.shapes.evaluate(size, {})) if not isinstance(size, int) else size) >= 0
        assert k.report_kind in dict(R.COUNTED) or k.report_kind in R.WORDS, k.name


def test_a_kind_the_count_line_does_not_list_is_still_counted():
    """A kernel kind the report has no words for (one added later) is counted under its own name."""
    counts = {"total": 3, **{kind: 0 for kind, _ in R.COUNTED}, "copy": 1, "collective": 1, "novel": 1}
    assert R.count_line(counts).endswith("0 fused matmuls, 1 collectives, 1 novel)")


def test_the_step_prints_its_decisions_with_each_matmul_implementation(step):
    """Which implementation computes each product is decide's, shown by `print(step.decisions)`;
    the kernels carry the same (render and the report only read it)."""
    text = step.decisions
    impls = {k.impl for k in step.program.plan.kernels if k.kind == "matmul"}
    assert {"patch gemm", "winograd", "direct rows", "gemm"} <= impls
    assert "matmuls: " in text and all(impl in text for impl in impls)
    assert "attention statistics stored for their gradient: " in text and "none" not in text.split(
        "attention statistics stored for their gradient: ")[1].splitlines()[0]
