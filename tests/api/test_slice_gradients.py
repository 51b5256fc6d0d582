"""Slices and their gradients on C against the NumPy reference and torch autograd (issue 32, defect 1).

A slice's gradient is `embed`: the cotangent written into a window of zeros. Its C lowering
(symgrad.backends.kinds.gather._embed) zeroes only the border outside the window, box by box, before it
stores the window; a sum of embeds into disjoint windows (symgrad.backends.lower.concat) stores each part
into one buffer and zeroes only what no window covers. A box left out, or a window stored past its
end, leaves values outside the slice: the issue saw ones in rows 3 and 4 of the gradient of
`sum(x[1:3, :])` on a [5, 6] input.

Every window shape the lowering tells apart is here, on 1 to 4 axes: touching either end of an
axis or both, inside, empty, one element, strided (steps 2 to 7), negative bounds, integer
indices, None and Ellipsis, a `Dim` axis covered whole or in part, two windows of one input
(disjoint and covering, with a gap, overlapping, the same twice). Each case gives five outputs:
the forward slice, the gradient of its sum (a broadcast constant cotangent), of its mean (a
constant 1/n, 1/(n B) on a Dim axis), of a weighted sum (a cotangent that is an input) and a
second-order gradient (of sum(g * v), g the gradient of sum(y ** 3)). Inputs are larger than
constant folding stores (passes/fold.py: 64 elements), so the constant gradients reach the
lowering instead of becoming stored constants; the issue's own [5, 6] cases, which fold, stay too.

All cases of one dtype are ONE sg.function per backend (a C build costs about a second).
Comparisons use no absolute tolerance: a zero of the reference is matched only by an exact zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

import symgrad as sg
from symgrad.backends.decide.decisions import decide

pytest.importorskip("symgrad.backends.c")
torch.set_num_threads(1)  # a 2-core machine shared by parallel runs: torch's thread pool only contends

B = sg.Dim("B")
B_VALUE = 9
# The inputs the cases slice: name -> shape (B: the Dim, bound to B_VALUE at the call).
SHAPES = {"v1": (70,), "m2": (9, 10), "s2": (5, 6), "t3": (4, 5, 6), "q4": (2, 3, 4, 5),
          "b_rows": (B, 10), "b_cols": (6, B)}
E = Ellipsis


@dataclass(frozen=True, eq=False)  # keyed by identity: slices are not hashable
class Case:
    """Windows of input `name`: y = the sum of x[key] over `keys` (one key: one window). `full`: all
    of KINDS, in both dtypes; else the forward slice and the gradient of its sum, in float64 (each
    output is a few C kernels, and a C build's time grows with its kernels). `in_place`: disjoint
    windows, whose gradient is a sum of embeds stored in place (backends/lower/concat.py)."""

    name: str
    keys: tuple
    full: bool = False
    in_place: bool = False

    @property
    def label(self) -> str:
        return f"{self.name}" + "+".join(repr(k) for k in self.keys)

    def kinds(self, dtype: str) -> tuple:
        return KINDS if self.full else KINDS[:2]


def _one(name, *keys, full=()):
    """Cases of one window each; those at the positions in `full` are full cases."""
    return [Case(name, (key,), k in full) for k, key in enumerate(keys)]


KINDS = ("forward", "sum", "mean", "weighted", "second order")
CASES = [
    *_one("s2", (slice(1, 3), slice(None)), (slice(1, 3), slice(2, 6)), (slice(1, 3), slice(2, 5)),  # the issue's
          full=(0, 1, 2)),
    *_one("v1", slice(5, 20), slice(60, None), slice(None, 10), slice(None, None, 7), slice(3, None, 5),
          slice(-9, -2), slice(69, 70), slice(0, 70), slice(30, 30), full=(1, 4)),
    *_one("m2", (slice(1, 3), slice(None)), (slice(1, 3), slice(2, 10)), (slice(1, 3), slice(2, 9)),
          (slice(None), slice(None)), (slice(0, 9), slice(0, 1)), (slice(8, 9), slice(9, 10)),
          (slice(-3, None), slice(-4, None)), (slice(None, -1), slice(1, None)), (slice(None, None, 2), slice(None)),
          (slice(1, None, 3), slice(None, None, 4)), (slice(2, 7, 2), slice(1, 10, 3)), slice(1, 3),
          (E, slice(3, None)), (4, slice(None)), (slice(None), -1), (None, slice(2, 5), slice(4, None)),
          (slice(3, 3), slice(None)), (slice(1, 8), slice(9, None)), (slice(0, 1), slice(0, None, 9)),
          full=(0, 1, 2, 6, 10, 15)),
    *_one("t3", (slice(1, 3), slice(None), slice(2, None)), (slice(None), slice(1, 4), slice(None)),
          (E, slice(5, None)), (slice(1, None), slice(None, None, 2), slice(1, None, 2)),
          (slice(None), slice(None), slice(None)), (0, slice(4, 5), slice(None)), (slice(3, 4), slice(0, 5)),
          full=(0, 3)),
    *_one("q4", (slice(None), slice(1, None), slice(2, 4), slice(3, None)), (1, E, slice(None, None, 2)),
          (slice(0, 1), slice(2, 3), slice(3, 4), slice(4, 5)), full=(0,)),
    *_one("b_rows", (slice(1, 3), slice(None)), (slice(1, None), slice(2, None)), (slice(None, -1), slice(None)),
          (slice(-2, None), slice(5, None)), (slice(None), slice(None, None, 3)), (slice(None), slice(9, 10)),
          (slice(2, -2), slice(1, 9)), full=(0, 1, 2, 6)),
    *_one("b_cols", (slice(1, 3), slice(None)), (slice(2, None), slice(1, None)), (slice(None), slice(None, -1)),
          (slice(1, 4), slice(-3, None)), (slice(5, 6), slice(0, 1)), full=(0, 1, 3)),
    # Two windows of one input: a sum of embeds, stored in place when the windows are disjoint. (Each
    # window of a sum stored in place appears in no other case: CSE would share its embed, read twice
    # it is lowered on its own, and the sum would not be stored in place.)
    Case("m2", ((slice(0, 3), slice(None)), (slice(3, 9), slice(None))), True, True),  # covering
    Case("m2", ((slice(None), slice(None, 4)), (slice(None), slice(6, None))), True, True),  # a gap between
    Case("m2", ((slice(1, 3), slice(3, 10)), (slice(5, 9), slice(0, 2))), False, True),  # apart on both axes
    Case("m2", ((slice(0, 5), slice(None)), (slice(3, 9), slice(None)))),       # overlapping
    Case("m2", ((slice(1, 3), slice(None)), (slice(1, 3), slice(None)))),       # the same window twice
    Case("b_rows", ((slice(None, 2), slice(None)), (slice(2, None), slice(None))), True, True),  # covering a Dim
]


def cases(dtype: str) -> list:
    """The cases compiled for `dtype`: every one in float64, the full ones in float32."""
    return [case for case in CASES if dtype == "float64" or case.full]


def _windows(x, w, case):
    """[(x[key], w[key]) for each key of the case] (w: the cotangent of the weighted kind)."""
    return [(x[key], w[key]) for key in case.keys]


def _total(terms: list):
    return sum(terms[1:], terms[0])


def _symgrad_outputs(x, w, v, case, kinds) -> list:
    """The case's outputs of `kinds` (in KINDS order), as graph values."""
    pairs = _windows(x, w, case)

    def second_order():
        g3 = sg.grad(_total([sg.sum(y ** 3) for y, _ in pairs]), [x])[0]
        return sg.grad(sg.sum(g3 * v), [x])[0]
    make = {"forward": lambda: pairs[0][0],
            "sum": lambda: sg.grad(_total([sg.sum(y) for y, _ in pairs]), [x])[0],
            "mean": lambda: sg.grad(_total([sg.mean(y) for y, _ in pairs]), [x])[0],
            "weighted": lambda: sg.grad(_total([sg.sum(y * c) for y, c in pairs]), [x])[0],
            "second order": second_order}
    return [make[kind]() for kind in kinds]


def _torch_outputs(x: np.ndarray, w: np.ndarray, v: np.ndarray, case, kinds) -> list:
    """The same outputs by torch autograd, in float64."""
    w, v = torch.tensor(w), torch.tensor(v)

    def gradient(loss_of, create_graph=False):
        xt = torch.tensor(x, requires_grad=True)
        loss = _total([loss_of(xt[key], w[key]) for key in case.keys])
        return xt, torch.autograd.grad(loss, xt, create_graph=create_graph)[0]

    def second_order():
        xt, g3 = gradient(lambda y, c: (y ** 3).sum(), create_graph=True)
        return torch.autograd.grad((g3 * v).sum(), xt)[0]
    make = {"forward": lambda: torch.tensor(x)[case.keys[0]],
            "sum": lambda: gradient(lambda y, c: y.sum())[1],
            "mean": lambda: gradient(lambda y, c: y.mean())[1],
            "weighted": lambda: gradient(lambda y, c: (y * c).sum())[1],
            "second order": second_order}
    return [make[kind]().numpy() for kind in kinds]


def _feed(dtype: str) -> dict:
    """name -> (x, w, v) arrays for every input, the Dim bound to B_VALUE."""
    rng = np.random.default_rng(32)
    feed = {}
    for name, shape in SHAPES.items():
        concrete = tuple(B_VALUE if size is B else size for size in shape)
        feed[name] = tuple(rng.uniform(0.5, 2.0, concrete).astype(dtype) for _ in range(3))
    return feed


def _poison(arrays) -> None:
    for array in arrays:
        array.fill(np.nan)


def _over_poison(compiled, arrays: list) -> tuple:
    """The outputs of a call that writes into NaN: the C program writes a call's outputs into the
    arrays of the call before when nobody kept them (symgrad.backends.c), so the first call's are
    filled with NaN and dropped; an element no kernel writes stays NaN, whatever memory the
    allocator hands out (fresh pages are zeroed, and would hide a border left unzeroed whenever an
    array lands on them). Returns (outputs, how many arrays were written again)."""
    first = compiled(*arrays)
    before = [id(array) for array in first]
    _poison(first)
    del first
    outputs = compiled(*arrays)
    return outputs, sum(id(array) == old for array, old in zip(outputs, before))


@pytest.fixture(scope="module", params=["float64", "float32"])
def results(request):
    """(dtype, the C function, its outputs, the NumPy reference's, the feed): every case of the dtype
    in one function per backend."""
    dtype = request.param
    leaves = {name: tuple(sg.input(f"{name}_{part}", shape, dtype=dtype) for part in "xwv")
              for name, shape in SHAPES.items()}
    outputs = [out for case in cases(dtype) for out in _symgrad_outputs(*leaves[case.name], case, case.kinds(dtype))]
    inputs = [leaf for triple in leaves.values() for leaf in triple]
    feed = _feed(dtype)
    arrays = [array for triple in feed.values() for array in triple]
    compiled = sg.function(inputs, outputs, backend="c")
    got, reused = _over_poison(compiled, arrays)
    assert reused == len(outputs), f"only {reused} of {len(outputs)} outputs were written over NaN"
    want = sg.function(inputs, outputs, backend="numpy")(*arrays)
    return dtype, compiled, got, want, feed


def _per_case(values: list, dtype: str) -> dict:
    """Outputs grouped per case: case -> {kind: array}."""
    it = iter(values)
    return {case: {kind: next(it) for kind in case.kinds(dtype)} for case in cases(dtype)}


def test_c_matches_the_numpy_reference(results):
    """Every output of every case, zeros outside the windows exact."""
    dtype, _, got, want, _ = results
    rtol = 1e-12 if dtype == "float64" else 2e-6
    failed = []
    for (case, c_values), reference in zip(_per_case(got, dtype).items(), _per_case(want, dtype).values()):
        for kind, a in c_values.items():
            b = reference[kind]
            if a.shape != b.shape or not np.allclose(a, b, rtol=rtol, atol=0.0):
                outside = int(np.count_nonzero((b == 0) & (a != 0))) if a.shape == b.shape else "?"
                failed.append(f"{case.label} {kind}: differs, {outside} element(s) nonzero where the reference is 0")
    assert not failed, "\n".join(failed)


def test_c_and_the_reference_match_torch_autograd(results):
    """C and the NumPy reference against torch autograd in float64 on the same values (a float32
    result within float32's rounding of torch's float64 one)."""
    dtype, _, got, want, feed = results
    rtol = 1e-12 if dtype == "float64" else 1e-5
    failed = []
    for (case, reference), c_values in zip(_per_case(want, dtype).items(), _per_case(got, dtype).values()):
        oracle = _torch_outputs(*(a.astype(np.float64) for a in feed[case.name]), case, case.kinds(dtype))
        for (kind, value), expected in zip(reference.items(), oracle):
            for backend, result in (("numpy", value), ("c", c_values[kind])):
                if result.shape != expected.shape or not np.allclose(result, expected, rtol=rtol, atol=0.0):
                    failed.append(f"{backend}: {case.label} {kind}")
    assert not failed, "\n".join(failed)


def test_the_constant_gradients_reach_the_lowering(results):
    """The gradients of the sums are computed by the program's kernels, not folded into stored
    constants (passes/fold.py), but on the [5, 6] input of the issue, which is small enough to fold;
    those of disjoint windows are sums stored in place, the others not."""
    dtype, compiled, _, _, _ = results
    optimized = compiled.optimized_graph
    in_place = decide(optimized).sums_in_place
    outputs = iter(optimized.outputs)
    for case in cases(dtype):
        by_kind = {kind: next(outputs) for kind in case.kinds(dtype)}
        if case.name != "s2":
            assert by_kind["sum"].op.name != "const", case.label
        # (The sum's gradient over windows covering the input is all ones, folded to a broadcast 1.)
        summed = by_kind["weighted" if case.full else "sum"]
        assert (id(summed) in in_place) == case.in_place, case.label
