"""A loop stores the variables' new values it computes anyway (fusion.choose_stores_in_reader):
AdamW's moments are computed and stored by the parameter's update loop, one loop per parameter
reading the gradient and the old state once, each new value written into its variable in place."""

import numpy as np
import torch

import symgrad as sg
from symgrad import backends
from symgrad.api.cells import current_value
from symgrad.step.compiled import CompiledFunction
from symgrad.backends.lower.lowering import LoopKernel, lower
from symgrad.ir.graph import Graph


def _loops(plan) -> list:
    return [k for k in plan.kernels if isinstance(k, LoopKernel)]


def test_adamw_updates_each_parameter_in_one_loop_and_matches_torch():
    """Each parameter's update is one loop that writes the parameter, exp_avg and exp_avg_sq in
    place (no copies); three AdamW steps of a Linear then match torch.optim.AdamW."""
    sg.manual_seed(0)
    lin = sg.nn.Linear(6, 4)
    x, y = sg.input("x", (5, 6)), sg.input("y", (5, 4))
    loss = sg.sum((lin(x) - y) ** 2)
    opt = sg.optim.AdamW(lin.parameters(), lr=0.05, weight_decay=0.1)
    step = sg.train_step(loss, optimizer=opt, backend="c")
    updates = [k for k in _loops(step.program.plan) if k.also]
    assert len(updates) == 2 and all(len(k.also) == 2 for k in updates)
    stored = sorted(b.name for k in updates for b, _, _ in k.stores())
    assert all(b.startswith("var") for b in stored)  # each new value written into its variable
    assert not [k for k in step.program.plan.kernels if k.name.endswith("_copy")]
    assert "(also stores" in str(step.decisions)

    w = torch.tensor(lin.state_dict()["weight"], requires_grad=True)
    b = torch.tensor(lin.state_dict()["bias"], requires_grad=True)
    topt = torch.optim.AdamW([w, b], lr=0.05, weight_decay=0.1)
    rng = np.random.default_rng(1)
    for _ in range(3):
        xs, ys = rng.standard_normal((5, 6)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)
        step(x=xs, y=ys)
        topt.zero_grad()
        (((torch.from_numpy(xs) @ w.T + b) - torch.from_numpy(ys)) ** 2).sum().backward()
        topt.step()
    np.testing.assert_allclose(lin.state_dict()["weight"], w.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lin.state_dict()["bias"], b.detach().numpy(), rtol=1e-5, atol=1e-6)


def _c_and_numpy(make_graph, values):
    """The graph `make_graph()` returns (its inputs, outputs, updates over fresh variables), run
    twice on C and on NumPy: (outputs of the last call, the variables after) per backend."""
    results = {}
    for backend in ("c", "numpy"):
        graph, variables = make_graph()
        run = CompiledFunction(graph, backends.resolve(backend), False)
        for _ in range(2):
            outputs = run(*values)
        results[backend] = ([np.asarray(o) for o in outputs], [current_value(v) for v in variables])
    return results


def test_values_stored_in_turn_are_stored_by_the_last_loop():
    """a' read by b' read by c' (each a variable's new value, each read once): the loop of c'
    computes and stores all three, each into its variable, and they are what the NumPy reference
    computes."""
    def make():
        a, b, c = (sg.param(n, (7,), init="ones") for n in "abc")
        g = sg.input("g", (7,))
        a1 = a * 0.5 + g
        b1 = b + a1 * 2.0
        c1 = c - b1 * a1
        return Graph([g], [g + 1.0], [(a, a1), (b, b1), (c, c1)]), (a, b, c)
    plan = lower(make()[0])
    loops = [k for k in _loops(plan) if k.also]
    assert len(loops) == 1 and len(loops[0].stores()) == 3 and sorted(plan.in_place) == ["a", "b", "c"]
    results = _c_and_numpy(make, [np.arange(7.0, dtype=np.float32)])
    assert not any(np.allclose(v, 1.0) for v in results["c"][1])  # two calls moved every variable
    for got, want in zip(results["c"][1], results["numpy"][1]):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_new_value_read_by_another_kernel_keeps_its_loop():
    """m' read by the update loop of p and by an output's loop: it is stored by its own loop, read
    back by both."""
    m, p = sg.param("m", (9,), init="ones"), sg.param("p", (9,), init="ones")
    g = sg.input("g", (9,))
    m1 = m * 0.9 + g
    plan = lower(Graph([g], [sg.exp(m1)], [(m, m1), (p, p - m1)]))
    assert not any(k.also for k in _loops(plan))


def test_the_storing_loop_waits_for_the_old_value_s_readers():
    """m is read (old) by an output's loop and its new value stored by p's update loop: the schedule
    runs that loop after the reader, so m' is still written into m in place, not copied."""
    m, p = sg.param("m", (9,), init="ones"), sg.param("p", (9,), init="ones")
    g = sg.input("g", (9,))
    m1 = m * 0.9 + g
    h = sg.input("h", (50, 9))  # the reader waits for a sum: the update loop is ready first
    plan = lower(Graph([g, h], [sg.exp(m) * sg.sum(sg.exp(h), axis=0)], [(m, m1), (p, p - m1 * 2.0)]))
    (loop,) = [k for k in _loops(plan) if k.also]
    assert sorted(plan.in_place) == ["m", "p"] and not [k for k in plan.kernels if k.name.endswith("_copy")]
    assert plan.kernels.index(loop) == len(plan.kernels) - 1


def test_stores_whose_waits_would_close_a_cycle_are_not_made():
    """x' (reading old y) and z' are stored by the output's loop, which then waits for old z's
    reader w' (a row group), which waits for y', which waits for old y's readers: that loop. The
    stores are dropped (each value its own loop, as before them) rather than the schedule given up;
    a given-up schedule lowered the row group before a constant it reads (KeyError)."""
    def make():
        x, y, z, w = (sg.param(n, (4, 4), init=np.random.default_rng(len(n)).standard_normal((4, 4)).astype(np.float32))
                      for n in ("x", "yy", "zzz", "wwww"))
        g = sg.input("g", (4, 4))
        x1 = x * 0.9 + y * 0.1
        z1 = z * 0.9 + x1
        y1 = y * 0.9 + w * 0.1
        w1 = (w - sg.max(w, axis=1, keepdims=True)) * 0.2 + z * 0.1
        return Graph([g], [z1 * 2.0, g + 1.0], [(x, x1), (z, z1), (y, y1), (w, w1)]), (x, y, z, w)
    graph, _ = make()
    plan = lower(graph)
    assert not any(k.also for k in _loops(plan))
    results = _c_and_numpy(make, [np.ones((4, 4), np.float32)])
    for got, want in zip([*results["c"][0], *results["c"][1]], [*results["numpy"][0], *results["numpy"][1]]):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_swapped_variables_beside_a_row_group_lower_in_the_graph_s_order():
    """x' reads old y and y' old x: each update waits for the other's loop, and no order writes
    both in place. The graph's order is taken with each row group after all it reads (the
    fallback had been the bare node order, and a softmax-like row group met its constant before
    it was made); the numbers are NumPy's."""
    def make():
        x, y = sg.param("x", (4, 4), init="ones"), sg.param("y", (4, 4), init="ones")
        g = sg.input("g", (4, 4))
        w = (g - sg.max(g, axis=1, keepdims=True)) * 3.0
        return Graph([g], [sg.exp(w) + 2.0], [(x, y * 0.5 + g), (y, x * 0.25 - g)]), (x, y)
    values = [np.random.default_rng(2).standard_normal((4, 4)).astype(np.float32)]
    results = _c_and_numpy(make, values)
    for got, want in zip([*results["c"][0], *results["c"][1]], [*results["numpy"][0], *results["numpy"][1]]):
        np.testing.assert_allclose(got, want, rtol=1e-6)
