"""Issue 4, phase 2: passes in compile(), fusion, save/recompute, the memory plan, report().

Every compiled result here is compared with the NumPy reference running the
unoptimized graph. C builds are shared through module-scoped fixtures.
"""

import dataclasses
import io

import numpy as np
import pytest

import symgrad as sg
from symgrad.backends import c as cbackend
from symgrad.backends.lower.lowering import LoopKernel, MatmulKernel, ReduceKernel, RowKernel, lower
from symgrad.backends.lower.memory import ArenaSpec, liveness, memory_plan
from symgrad.tools.inspect import run_inspect

RNG = np.random.default_rng(7)


def chain_graph():
    """Ten elementwise ops on two inputs: one fused loop."""
    B = sg.Dim("B")
    x, y = sg.input("x", (B, 33)), sg.input("y", (B, 33))
    v = x * y                 # 1
    v = v + 1.5               # 2
    v = sg.tanh(v)            # 3
    v = v - y                 # 4
    v = sg.exp(v)             # 5
    v = v * x                 # 6
    v = sg.sigmoid(v)         # 7
    v = sg.maximum(v, y)      # 8
    v = sg.sqrt(v + 2.0)      # 9, 10
    return [x, y], v


def test_elementwise_chain_of_ten_ops_is_one_kernel():
    inputs, out = chain_graph()
    raw = sg.Graph(inputs, [out])
    assert sum(n.op.kind == "elementwise" for n in raw.nodes) >= 10
    a, b = RNG.standard_normal((5, 33)).astype("f4"), RNG.standard_normal((5, 33)).astype("f4")
    ref = sg.function(inputs, out, backend="numpy")(a, b)
    for optimize in (True, False):  # fused by the lowering, whatever the passes made of the chain
        f = sg.function(inputs, out, backend="c", optimize=optimize)
        kernels = f.program.plan.kernels
        assert len(kernels) == 1 and isinstance(kernels[0], LoopKernel), [k.name for k in kernels]
        np.testing.assert_allclose(f(a, b), ref, rtol=2e-6, atol=1e-6)
    assert "kernels: 1 (1 loops" in f.report()


def test_row_reduction_prologue_is_fused():
    """log-sum-exp: one row kernel; exp runs inside the sum's pass, log(s) + m once per row."""
    B = sg.Dim("B")
    x = sg.input("x", (B, 17), dtype="float64")
    m = sg.max(x, axis=1, keepdims=True)
    lse = sg.log(sg.sum(sg.exp(x - m), axis=1)) + sg.reshape(m, (B,))
    f = sg.function([x], lse, backend="c")
    (kernel,) = f.program.plan.kernels
    assert isinstance(kernel, RowKernel)
    assert [[r.op for r in p.reductions] for p in kernel.passes] == [["max"], ["sum"]]
    assert [st.node.op.name for st in kernel.passes[1].after] == ["log", "add"]
    assert "exp(" in f.source.split("pass 2 of 2")[1].split("}")[0]  # exp computed inside the sum's loop
    a = RNG.standard_normal((6, 17)) * 30
    np.testing.assert_allclose(f(a), sg.function([x], lse, backend="numpy")(a), rtol=1e-13)


def test_reduction_epilogue_is_fused():
    """log(sum(exp(x))): exp runs inside the sum's loop, log as each row's sum is stored: one kernel."""
    B = sg.Dim("B")
    x = sg.input("x", (B, 9, 4), dtype="float64")
    out = sg.log(sg.sum(sg.exp(x), axis=(1, 2))) * 0.5
    f = sg.function([x], out, backend="c")
    (kernel,) = f.program.plan.kernels
    assert isinstance(kernel, ReduceKernel) and kernel.operands and kernel.epilogue_statements
    assert kernel.out is f.program.plan.outputs[0]  # stored straight into the output
    a = RNG.standard_normal((5, 9, 4))
    np.testing.assert_allclose(f(a), sg.function([x], out, backend="numpy")(a), rtol=1e-13)


def test_column_sums_keep_their_own_kernel():
    """A bias gradient (a sum over the batch axis) is not fused: its column kernel is faster."""
    B = sg.Dim("B")
    x = sg.input("x", (B, 8))
    plan = lower(sg.Graph([x], [sg.sum(sg.exp(x), axis=0)]))
    assert [type(k).__name__ for k in plan.kernels] == ["LoopKernel", "ReduceKernel"]


# ---- the two reference models ------------------------------------------------------------

def softmax_regression(backend, **options):
    B = sg.Dim("B")
    x, y = sg.input("x", (B, 784)), sg.input("y", (B,), dtype="int64")
    W = sg.param("W", (784, 10), init="zeros")
    b = sg.param("b", (10,), init="zeros")
    loss = sg.cross_entropy(x @ W + b, y)
    return sg.train_step(loss, params=[W, b], optimizer=sg.optim.SGD(lr=0.1), backend=backend, **options)


def mlp(backend, batch=128, **options):
    sg.manual_seed(0)
    x, y = sg.input("x", (batch, 784)), sg.input("y", (batch,), dtype="int64")
    model = sg.nn.Sequential(sg.nn.Linear(784, 256), sg.nn.ReLU(), sg.nn.Linear(256, 256), sg.nn.ReLU(),
                             sg.nn.Linear(256, 10))
    loss = sg.cross_entropy(model(x), y)
    return sg.train_step(loss, params=model.parameters(), optimizer=sg.optim.SGD(lr=0.1), backend=backend,
                         **options)


@pytest.fixture(scope="module")
def mlp_steps():
    return mlp("c"), mlp("numpy")


@pytest.fixture(scope="module")
def softmax_step():
    return softmax_regression("c")


def _no_overlap(plan, mp):
    for i, (lo_i, hi_i) in enumerate(mp.live):
        for j in range(i):
            lo_j, hi_j = mp.live[j]
            if lo_i <= hi_j and lo_j <= hi_i:  # live at the same time: disjoint bytes
                a, b = mp.offsets[i], mp.offsets[j]
                assert a + mp.sizes[i] <= b or b + mp.sizes[j] <= a, (plan.workspace[i], plan.workspace[j])
    assert all(o % 64 == 0 for o in mp.offsets)
    assert all(o + s <= mp.arena_bytes for o, s in zip(mp.offsets, mp.sizes))


def test_mlp_arena_is_close_to_the_liveness_bound(mlp_steps):
    step, _ = mlp_steps
    mp = step.program.memory_plan
    assert mp.arena_bytes <= 1.25 * mp.lower_bound_bytes
    _no_overlap(step.program.plan, mp)
    # Less than half the naive total: every value the step computes in its own buffer.
    graph = step.program.optimized
    values = sum(int(np.prod(n.shape)) * np.dtype(n.dtype).itemsize for n in graph.nodes
                 if n.op.kind not in ("source", "movement"))
    assert mp.naive_bytes == values and mp.arena_bytes < 0.5 * mp.naive_bytes
    # Reuse, apart from fusion: under half the temporaries' own total on the plan before matmul
    # epilogues. Fusing those removes four 128 KiB temporaries, not the peak (the first layer's
    # weight gradient and its input), so the fused plan, at the bound already, is at 0.58 of its own.
    unfused = lower(graph, variables=step.graph.variables)
    before = memory_plan(unfused, {})
    assert before.arena_bytes < 0.5 * before.unshared_bytes
    assert mp.arena_bytes <= before.arena_bytes and mp.unshared_bytes < before.unshared_bytes
    # in place: every parameter's new value is written straight into the parameter
    assert sorted(step.program.plan.in_place) == sorted(step.params)


def test_a_placement_the_arena_spec_carries_is_taken_and_a_bad_one_is_placed_again(mlp_steps, softmax_step):
    """The program cache keeps a program's placement with its arena spec (ArenaSpec.placed), so a
    warm load does not place 1,200 temporaries again; what a spec carries is what memory_plan gives
    (here one buffer each, nothing shared: not the greedy plan, so it was not placed anew), through
    JSON as the cache writes it. A placement at another alignment, of another length or with an
    offset off the alignment, and a spec with Dims, are placed as if it carried none."""
    spec = ArenaSpec.of(mlp_steps[0].program.plan)
    fresh = memory_plan(spec, {}, 64)
    needs = [-(-n // 64) * 64 for n in fresh.sizes]
    apart = [sum(needs[:k]) for k in range(len(needs))]
    assert apart != fresh.offsets
    own = ArenaSpec.from_json(dataclasses.replace(spec, placed=(64, tuple(apart))).to_json(), {})
    taken = memory_plan(own, {}, 64)
    assert taken.offsets == apart and taken.arena_bytes == sum(needs) == taken.unshared_bytes
    assert (taken.lower_bound_bytes, taken.naive_bytes, taken.sizes) == (fresh.lower_bound_bytes, fresh.naive_bytes, fresh.sizes)
    kept = spec.with_placement(fresh, 64)
    assert vars(memory_plan(ArenaSpec.from_json(kept.to_json(), {}), {}, 64)) == vars(fresh)
    for bad in ((128, tuple(apart)), (64, tuple(apart[:-1])), (64, (32, *apart[1:]))):
        assert vars(memory_plan(dataclasses.replace(spec, placed=bad), {}, 64)) == vars(fresh)
    with_dims = ArenaSpec.of(softmax_step.program.plan)
    bindings = {d: 64 for d in softmax_step.program.plan.dims}
    planned = memory_plan(with_dims, bindings, 64)
    carried = dataclasses.replace(with_dims, placed=(64, tuple(0 for _ in planned.offsets)))
    assert vars(memory_plan(carried, bindings, 64)) == vars(planned)


def test_mlp_bias_relu_and_masks_run_inside_the_gemms(mlp_steps):
    """Forward: each hidden layer's bias add and relu are the epilogue of its GEMM (no loop kernel,
    no buffer for x @ W). Backward: relu's mask is the epilogue of the hidden-layer gradient GEMM."""
    step, _ = mlp_steps
    plan = step.program.plan
    fused = [k for k in plan.kernels if isinstance(k, MatmulKernel) and k.epilogue_statements]
    ops = sorted(tuple(st.node.op.name for st in k.epilogue_statements) for k in fused)
    assert ops == [("add", "relu"), ("add", "relu"), ("relu_vjp0",), ("relu_vjp0",)]
    loops = [st.node.op.name for k in plan.kernels if isinstance(k, LoopKernel) for st in k.statements]
    assert "relu" not in loops and "relu_vjp0" not in loops
    # a relu_vjp0 epilogue reads the kept activation at (row, col) besides the product, and the
    # memory plan keeps that activation live (its bytes untouched) until the GEMM has run
    masks = [k for k in fused if k.epilogue_statements[0].node.op.name == "relu_vjp0"]
    assert all(len(k.epilogue) == 1 and k.epilogue[0].view.shape == (128, 256) for k in masks)
    live = liveness(plan)
    for k in masks:
        at = next(i for i, kernel in enumerate(plan.kernels) if kernel is k)
        assert live[k.epilogue[0].view.buffer.index][1] >= at
    text = str(step.report().kernels)
    assert "4 fused matmuls" in text and text.count("matmul + 2 fused op(s)") == 2 \
        and text.count("matmul + 1 fused op(s)") == 2


def test_mlp_optimized_step_matches_the_reference(mlp_steps):
    step, ref = mlp_steps
    for name in step.params:
        ref.params[name] = step.params[name]
    for _ in range(3):
        x = RNG.standard_normal((128, 784)).astype("f4")
        y = RNG.integers(0, 10, 128)
        np.testing.assert_allclose(step(x=x, y=y), ref(x=x, y=y), rtol=1e-5)
    for name in step.params:
        np.testing.assert_allclose(step.params[name], ref.params[name], rtol=1e-4, atol=1e-6)


def test_memory_plan_per_binding_and_kernel_counts(softmax_step):
    step = softmax_step
    x = RNG.standard_normal((64, 784)).astype("f4")
    y = RNG.integers(0, 10, 64)
    ref = softmax_regression("numpy")
    np.testing.assert_allclose(step(x=x, y=y), ref(x=x, y=y), rtol=1e-6)
    np.testing.assert_allclose(step.params["W"], ref.params["W"], rtol=1e-5, atol=1e-7)
    mp = step.program.memory_plan
    assert list(mp.bindings.values()) == [64]
    _no_overlap(step.program.plan, mp)
    small = memory_plan(step.program.plan, {d: 3 for d in step.program.plan.dims})
    assert small.arena_bytes < mp.arena_bytes
    raw = lower(step.graph, fuse_reduce=False, recompute=False, schedule=False)
    assert len(step.program.plan.kernels) <= len(raw.kernels) // 2
    # the loss, sum(...) * -1/B, is finished by the cross-row sum and stored into the output
    (last,) = [k for k in step.program.plan.kernels
               if isinstance(k, ReduceKernel) and k.out is step.program.plan.outputs[0]]
    assert last.epilogue_statements


def test_save_or_recompute_choices_are_recorded(softmax_step):
    choices = softmax_step.program.plan.choices
    by_op = {(c["op"], c["decision"]) for c in choices}
    assert ("sub", "recompute") in by_op          # x - max: recomputed where it is read
    assert ("exp", "keep") in by_op               # exp(x - max): too costly to recompute
    assert all(c["reason"] for c in choices)


def test_report_has_every_section(softmax_step):
    text = softmax_step.report()
    for needle in ("== passes ==", "nodes:", "simplify", "== kernels ==", "kernels:", "== save / recompute ==",
                   "recompute", "== memory plan ==", "naive", "lower bound", "in-place updates: W, b",
                   "== compile time ==",
                   # the step graph by autodiff, or from the step cache (a test before built this model)
                   "graph build" if not softmax_step.from_step_cache else "step graph from the step cache",
                   "program cache lookup" if not softmax_step.program.from_program_cache else "program cache hit"):
        assert needle in text, needle
    if not softmax_step.program.from_program_cache:
        assert "graph passes" in text and "render source" in text
    assert ("C compiler" in text) != ("cache load" in text)
    again = softmax_regression("c")  # the same graph: the source and the module come from the caches
    assert again.program.from_program_cache and again.program.from_cache
    again_text = again.report()
    assert "cache load (no compiler ran)" in again_text and "program cache hit" in again_text
    assert "graph passes" not in again_text and "simplify" in again_text  # the passes' report, remade
    assert "no passes" in softmax_regression("numpy").report()


def test_optimize_false_compiles_the_graph_as_given():
    inputs, out = chain_graph()
    f = sg.function(inputs, out * 1.0, backend="c", optimize=False)
    assert f.program.optimized is f.program.graph
    assert "(passes off" in f.report()
    with pytest.raises(TypeError, match="optimize"):
        cbackend.compile(sg.Graph(inputs, [out]), bogus=1)


def test_variables_survive_passes_that_drop_them():
    """dce drops the identity update v <- v and the unused variable: its slot and value stay."""
    x = sg.input("x", (3,))
    w = sg.param("w", (3,), init="ones")
    kept = sg.api.sources.variable("kept", np.arange(3, dtype="f4"), role="state")
    graph = sg.Graph([x], [sg.sum(x * w)], [(kept, kept), (w, w + x)])
    compiled = sg.step.compiled.Compiled(graph, "c")
    assert [v.name for v in compiled.program.optimized.variables] == ["w"]
    compiled._run([np.ones(3, "f4")])
    np.testing.assert_array_equal(compiled._read_variable("kept"), np.arange(3))
    np.testing.assert_array_equal(compiled._read_variable("w"), np.full(3, 2.0))


def test_inspect_report(tmp_path):
    path = tmp_path / "model.py"
    path.write_text("import symgrad as sg\n"
                    "def build():\n"
                    "    x, y = sg.input('x', (sg.Dim('B'), 4)), sg.input('y', (sg.Dim('B'),), dtype='int64')\n"
                    "    model = sg.nn.Linear(4, 3)\n"
                    "    return sg.cross_entropy(model(x), y), model.parameters()\n")
    out = io.StringIO()
    run_inspect(path, tmp_path / "out", backend="c", file=out, report=True)
    text = out.getvalue()
    assert "== compilation report ==" in text and "== memory plan ==" in text and "arena" in text
    from symgrad.tools.cli import main
    assert main(["inspect", str(path), "--out", str(tmp_path / "cli"), "--report"]) == 0


def test_numpy_backend_can_run_the_optimized_graph():
    inputs, out = chain_graph()
    raw = sg.function(inputs, out * 1.0 + 0.0, backend="numpy")
    opt = sg.function(inputs, out * 1.0 + 0.0, backend="numpy", optimize=True)
    assert raw.program.optimized is raw.program.graph
    assert len(opt.program.optimized.nodes) < len(raw.graph.nodes)
    a, b = RNG.standard_normal((4, 33)).astype("f4"), RNG.standard_normal((4, 33)).astype("f4")
    np.testing.assert_allclose(opt(a, b), raw(a, b), rtol=1e-6)


def test_relu_backward_reads_the_kept_activation(mlp_steps):
    """masks: relu's derivative tests relu(x) > 0 instead of x > 0, so x dies with the forward."""
    step, _ = mlp_steps
    vjps = [n for n in step.program.optimized.nodes if n.op.name == "relu_vjp0"]
    assert len(vjps) == 2 and all(any(i.op.name == "relu" for i in n.inputs) for n in vjps)
    x = sg.input("x", (6,), dtype="float64")
    loss = sg.sum(sg.relu(x * 2.0) * sg.constant(np.arange(6.0)))
    graph = sg.Graph([x], [loss, sg.grad(loss, [x])[0]])
    optimized = sg.passes.optimize(graph)
    assert any(n.op.name == "relu_vjp0" and n.inputs[1].op.name == "relu" for n in optimized.nodes)
    a = np.array([-1.0, -0.0, 0.0, 1e-300, np.nan, 3.0])
    from symgrad.backends.numpy_backend import evaluate
    ref, _ = evaluate(graph, [a], {}, {})
    got, _ = evaluate(optimized, [a], {}, {})
    np.testing.assert_array_equal(got[1], ref[1])


def test_memory_plan_before_the_first_call_says_it_assumed_the_dims():
    inputs, out = chain_graph()
    f = sg.function(inputs, sg.sum(out, axis=1), backend="c")
    assert f.program.memory_plan.assumed and "assumed: not called yet" in f.report()
    a = RNG.standard_normal((3, 33)).astype("f4")
    f(a, a)
    mp = f.program.memory_plan
    assert not mp.assumed and list(mp.bindings.values()) == [3]


# ---- random graphs: every fusion, recompute, epilogue and schedule decision vs NumPy ------------

def random_program(seed: int, steps: int = 28):
    """A random DAG of elementwise ops, row/column/full reductions (keepdims or not, reshaped
    back), broadcasts and reused values, with its gradients: (inputs, outputs)."""
    rng = np.random.default_rng(seed)
    B = sg.Dim("B")
    a, b = sg.input("a", (B, 6, 5), dtype="float64"), sg.input("b", (B, 6, 5), dtype="float64")
    c, d = sg.input("c", (5,), dtype="float64"), sg.input("d", (B, 6, 1), dtype="float64")
    pool = [a, b, c, d]
    unary = [sg.tanh, sg.sigmoid, sg.relu, lambda v: -v, lambda v: sg.exp(sg.tanh(v)), lambda v: v * 0.5 + 1.0]
    binary = [lambda u, v: u + v, lambda u, v: u - v, lambda u, v: u * v, sg.maximum]
    for _ in range(steps):
        kind = rng.integers(0, 10)
        v = pool[int(rng.integers(0, len(pool)))]
        if kind < 3:
            pool.append(unary[int(rng.integers(0, len(unary)))](v))
        elif kind < 7:
            w = pool[int(rng.integers(0, len(pool)))]
            pool.append(binary[int(rng.integers(0, len(binary)))](v, w))
        elif v.shape == a.shape:
            red = sg.sum if rng.integers(0, 2) else sg.max
            choice = int(rng.integers(0, 4))
            if choice == 0:    # row-wise, kept axis
                pool.append(red(v, axis=2, keepdims=True))
            elif choice == 1:  # row-wise, dropped then reshaped back: a view
                pool.append(sg.reshape(red(v, axis=2), (B, 6, 1)))
            elif choice == 2:  # over the batch: a column reduction
                pool.append(red(v, axis=0))
            else:              # per example
                pool.append(red(v, axis=(1, 2), keepdims=True))
    outs = [v for v in pool[4:] if rng.integers(0, 3) == 0] + [pool[-1]]
    loss = sum(sg.sum(v) for v in outs)
    grads = sg.grad(loss, [a, b, c, d])
    return [a, b, c, d], [*outs, loss, *grads]


@pytest.mark.parametrize("seed", range(4))
def test_random_graphs_match_the_reference(seed):
    inputs, outputs = random_program(seed)
    compiled = sg.function(inputs, outputs, backend="c")
    reference = sg.function(inputs, outputs, backend="numpy")
    rng = np.random.default_rng(100 + seed)
    for batch in (1, 3):
        arrays = [rng.standard_normal((batch, 6, 5)), rng.standard_normal((batch, 6, 5)),
                  rng.standard_normal(5), rng.standard_normal((batch, 6, 1))]
        for got, want in zip(compiled(*arrays), reference(*arrays)):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    _no_overlap(compiled.program.plan, compiled.program.memory_plan)
