"""Shared oracle utilities: the table of differentiable op cases and the compiled bundle.

Every op is described once as a `Case`: how to build it with symgrad, the
same computation in torch, and the inputs it takes (shape and domain). The
gradient tests (vs torch.autograd), the finite-difference tests and the
backend comparisons all read this one table.

All cases of one (backend, dtype) are compiled into ONE sg.function, so a
compiled backend pays for one build, not one per case; if that combined build
fails, each case falls back to its own build so only the broken ops fail.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as TF

import symgrad as sg

# --------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class Arg:
    """One operand: its shape and where its values are drawn from.

    domain: "any" N(0,1); "pos" U(0.5, 2); "away0" +-U(0.3, 2) (no kink of
    relu/abs/sqrt nearby); "labels<C>" int64 classes in [0, C); "bool".
    """

    shape: tuple
    domain: str = "any"

    @property
    def differentiable(self) -> bool:
        return not (self.domain.startswith("labels") or self.domain == "bool")

    def dtype(self, float_dtype: str) -> str:
        if self.domain.startswith("labels"):
            return "int64"
        if self.domain == "bool":
            return "bool"
        return float_dtype

    def sample(self, rng: np.random.Generator, float_dtype: str) -> np.ndarray:
        if self.domain.startswith("labels"):
            return rng.integers(0, int(self.domain[6:]), size=self.shape).astype(np.int64)
        if self.domain == "bool":
            return rng.random(self.shape) < 0.5
        if self.domain == "any":
            a = rng.standard_normal(self.shape)
        elif self.domain == "pos":
            a = rng.uniform(0.5, 2.0, self.shape)
        elif self.domain == "away0":
            a = rng.uniform(0.3, 2.0, self.shape) * rng.choice([-1.0, 1.0], self.shape)
        else:
            raise ValueError(f"unknown domain {self.domain!r}")
        return np.array(a, dtype=float_dtype)


@dataclass(frozen=True)
class Case:
    """One op application: symgrad builder, torch twin and operands."""

    name: str
    sg_fn: Callable
    torch_fn: Callable
    args: tuple
    second_order: bool = True   # also check a Hessian-vector product
    fd_tol: float = 1e-7        # finite differences: relative tolerance (float32 casts are rough)


def _axes_torch(axis, ndim):
    return tuple(range(ndim)) if axis is None else axis


# --------------------------------------------------------------------------
# The table

A = Arg
X34, X234 = A((3, 4)), A((2, 3, 4))
UNARY = {
    # name: (domain, torch function)
    "exp": ("any", torch.exp), "log": ("pos", torch.log), "sin": ("any", torch.sin),
    "cos": ("any", torch.cos), "tanh": ("any", torch.tanh), "sigmoid": ("any", torch.sigmoid),
    "relu": ("away0", torch.relu), "sqrt": ("pos", torch.sqrt), "abs": ("away0", torch.abs),
    "neg": ("any", torch.neg),
}


def _cases() -> list[Case]:
    cases = []
    add = cases.append
    for name, (domain, tfn) in UNARY.items():
        sfn = getattr(sg, name) if hasattr(sg, name) else (lambda v: -v)
        add(Case(name, sfn, tfn, (A((3, 4), domain),)))
    add(Case("neg_operator", lambda x: -x, lambda x: -x, (X34,)))
    add(Case("abs_operator", lambda x: abs(x), lambda x: abs(x), (A((3, 4), "away0"),)))
    # Binary ops: same shape, broadcasting, Python scalars on either side.
    binary = {"add": (lambda a, b: a + b, "any"), "sub": (lambda a, b: a - b, "any"),
              "mul": (lambda a, b: a * b, "any"), "div": (lambda a, b: a / b, "away0"),
              "maximum": (None, "any"), "minimum": (None, "any")}
    for name, (fn, domain_b) in binary.items():
        sfn = fn or getattr(sg, name)
        tfn = fn or getattr(torch, name)
        add(Case(name, sfn, tfn, (X34, A((3, 4), domain_b))))
        add(Case(f"{name}_broadcast", sfn, tfn, (A((3, 1, 4)), A((5, 4), domain_b))))
    add(Case("pow_tensor_tensor", lambda a, b: a ** b, lambda a, b: a ** b, (A((3, 4), "pos"), X34)))
    add(Case("pow_broadcast", sg.api.functional.pow, torch.pow, (A((3, 1), "pos"), A((2, 1, 4)))))
    add(Case("pow_tensor_scalar2", lambda x: x ** 2, lambda x: x ** 2, (X34,)))
    add(Case("pow_tensor_scalar3", lambda x: x ** 3, lambda x: x ** 3, (X34,)))
    add(Case("pow_tensor_half", lambda x: x ** 0.5, lambda x: x ** 0.5, (A((3, 4), "pos"),)))
    add(Case("pow_tensor_neg", lambda x: x ** -1.5, lambda x: x ** -1.5, (A((3, 4), "pos"),)))
    add(Case("pow_scalar_tensor", lambda x: 2 ** x, lambda x: 2 ** x, (X34,)))
    add(Case("pow_scalar_float_tensor", lambda x: 0.7 ** x, lambda x: 0.7 ** x, (X34,)))
    add(Case("radd", lambda x: 1 + x, lambda x: 1 + x, (X34,)))
    add(Case("rsub", lambda x: 1.5 - x, lambda x: 1.5 - x, (X34,)))
    add(Case("sub_scalar", lambda x: x - 2, lambda x: x - 2, (X34,)))
    add(Case("rmul", lambda x: 3 * x, lambda x: 3 * x, (X34,)))
    add(Case("rdiv", lambda x: 2 / x, lambda x: 2 / x, (A((3, 4), "away0"),)))
    add(Case("div_scalar", lambda x: x / 4, lambda x: x / 4, (X34,)))
    add(Case("numpy_scalar", lambda x: np.float64(2.5) * x + np.float64(1), lambda x: 2.5 * x + 1, (X34,)))
    add(Case("where", lambda c, a, b: sg.where(c, a, b), torch.where, (A((3, 4), "bool"), X34, X34)))
    add(Case("where_broadcast", lambda c, a, b: sg.where(c, a, b), torch.where,
             (A((3, 1), "bool"), A((4,)), A((3, 4)))))
    add(Case("where_compare", lambda x: sg.where(x > 0, x, 0.1 * x),
             lambda x: torch.where(x > 0, x, 0.1 * x), (A((3, 4), "away0"),)))
    add(Case("where_scalar", lambda x: sg.where(x < 0, 0.0, x * x),
             lambda x: torch.where(x < 0, 0.0, x * x), (A((3, 4), "away0"),)))
    add(Case("cast_roundtrip", lambda x: sg.cast(sg.cast(x * 3, "float32"), "float64") * x,
             lambda x: (x * 3).to(torch.float32).to(torch.float64) * x, (X34,), fd_tol=1e-3))
    add(Case("astype", lambda x: (x * 2).astype("float32").astype("float64") + x,
             lambda x: (x * 2).float().double() + x, (X34,), fd_tol=1e-3))
    # Reductions: each axis, negative axis, None, tuples, keepdims both ways.
    for red, tfn in (("sum", torch.sum), ("mean", torch.mean), ("max", torch.amax)):
        sfn = getattr(sg, red)
        for axis in (0, 1, 2, -1, None, (0, 2), (1, 2)):
            for keep in (False, True):
                def s(x, axis=axis, keep=keep, sfn=sfn):
                    return sfn(x, axis=axis, keepdims=keep)

                def t(x, axis=axis, keep=keep, tfn=tfn):
                    return tfn(x, dim=_axes_torch(axis, 3), keepdim=keep)
                add(Case(f"{red}_axis{axis}_keep{int(keep)}".replace(" ", ""), s, t, (X234,)))
    add(Case("sum_method", lambda x: x.sum(axis=1), lambda x: x.sum(dim=1), (X34,)))
    add(Case("mean_method", lambda x: x.mean(), lambda x: x.mean(), (X34,)))
    add(Case("max_method", lambda x: x.max(axis=0, keepdims=True), lambda x: x.amax(dim=0, keepdim=True), (X34,)))
    # Movement.
    add(Case("reshape", lambda x: sg.reshape(x, (4, 6)), lambda x: x.reshape(4, 6), (X234,)))
    add(Case("reshape_wildcard", lambda x: sg.reshape(x, (-1, 2)), lambda x: x.reshape(-1, 2), (X234,)))
    add(Case("reshape_method", lambda x: x.reshape(6, 4), lambda x: x.reshape(6, 4), (X234,)))
    add(Case("transpose", sg.transpose, lambda x: x.permute(2, 1, 0), (X234,)))
    add(Case("transpose_perm", lambda x: sg.transpose(x, (1, 2, 0)), lambda x: x.permute(1, 2, 0), (X234,)))
    add(Case("T", lambda x: x.T, lambda x: x.T, (X34,)))
    add(Case("broadcast_to", lambda x: sg.broadcast_to(x, (2, 3, 4)),
             lambda x: torch.broadcast_to(x, (2, 3, 4)), (A((3, 1)),)))
    add(Case("expand_dims", lambda x: sg.expand_dims(x, 1), lambda x: x.unsqueeze(1), (X34,)))
    add(Case("expand_dims_neg", lambda x: sg.expand_dims(x, -1), lambda x: x.unsqueeze(-1), (X34,)))
    add(Case("squeeze", sg.squeeze, lambda x: x.squeeze(), (A((3, 1, 4, 1)),)))
    add(Case("squeeze_axis", lambda x: sg.squeeze(x, 1), lambda x: x.squeeze(1), (A((3, 1, 4, 1)),)))
    # matmul, with 1-D operands as numpy / torch treat them.
    for name, sa, sb in (("matmul", (3, 4), (4, 5)), ("matmul_vec_mat", (4,), (4, 5)),
                         ("matmul_mat_vec", (3, 4), (4,)), ("matmul_vec_vec", (4,), (4,))):
        add(Case(name, lambda a, b: a @ b, torch.matmul, (A(sa), A(sb))))
    add(Case("matmul_fn", sg.matmul, torch.matmul, (A((2, 3)), A((3, 2)))))
    add(Case("rmatmul_numpy", lambda b: np.eye(3)[:2] @ b, lambda b: torch.eye(3, dtype=b.dtype)[:2] @ b,
             (A((3, 4)),)))
    # Composites.
    for axis in (-1, 0):
        add(Case(f"softmax_axis{axis}", lambda x, a=axis: sg.softmax(x, axis=a),
                 lambda x, a=axis: torch.softmax(x, dim=a), (X34,)))
        add(Case(f"log_softmax_axis{axis}", lambda x, a=axis: sg.log_softmax(x, axis=a),
                 lambda x, a=axis: torch.log_softmax(x, dim=a), (X34,)))
    for red in ("mean", "sum", "none"):
        add(Case(f"cross_entropy_{red}", lambda z, y, r=red: sg.cross_entropy(z, y, reduction=r),
                 lambda z, y, r=red: TF.cross_entropy(z, y, reduction=r), (A((5, 4)), A((5,), "labels4"))))
        add(Case(f"nll_loss_{red}", lambda z, y, r=red: sg.nll_loss(z, y, reduction=r),
                 lambda z, y, r=red: TF.nll_loss(z, y, reduction=r), (A((5, 4)), A((5,), "labels4"))))
        add(Case(f"mse_loss_{red}", lambda a, b, r=red: sg.mse_loss(a, b, reduction=r),
                 lambda a, b, r=red: TF.mse_loss(a, b, reduction=r), (X34, X34)))
    add(Case("nll_of_log_softmax", lambda z, y: sg.nll_loss(sg.log_softmax(z, axis=1), y),
             lambda z, y: TF.nll_loss(torch.log_softmax(z, dim=1), y), (A((5, 4)), A((5,), "labels4"))))
    # A small network: several ops, for gradients and Hessian-vector products.
    add(Case("mlp", lambda x, w, b, v: sg.sum(sg.tanh(x @ w + b) * sg.sigmoid(x @ w) @ v) + sg.mean(sg.exp(x) ** 2),
             lambda x, w, b, v: torch.sum(torch.tanh(x @ w + b) * torch.sigmoid(x @ w) @ v) + torch.mean(torch.exp(x) ** 2),
             (A((3, 4)), A((4, 5)), A((5,)), A((5,)))))
    add(Case("two_paths", lambda x: (x * x + 1) + (x * x) * 2 + sg.log(x * x),
             lambda x: (x * x + 1) + (x * x) * 2 + torch.log(x * x), (A((3,), "away0"),)))
    return cases


CASES = _cases()
CASE_NAMES = [c.name for c in CASES]
BY_NAME = {c.name: c for c in CASES}
assert len(BY_NAME) == len(CASES), "case names must be unique"


# --------------------------------------------------------------------------
# Building one case as graph code


@dataclass
class Built:
    """The graph values of one case: inputs (operands, cotangent, directions) and outputs."""

    case: Case
    operands: list            # sg.input per operand
    cotangent: object         # sg.input: grad_output of the result
    directions: list          # sg.input per differentiable operand (Hessian-vector product)
    out: object
    grads: list               # one per differentiable operand
    hvp: list                 # second derivatives, one per differentiable operand

    @property
    def inputs(self) -> list:
        return [*self.operands, self.cotangent, *self.directions]

    @property
    def outputs(self) -> list:
        return [self.out, *self.grads, *self.hvp]


def build_case(case: Case, dtype: str, prefix: str, second_order: bool = True) -> Built:
    """Inputs named `<prefix>_...`; grads via grad_output; HVP as grad of <grads, u>."""
    operands = [sg.input(f"{prefix}_x{i}", a.shape, dtype=a.dtype(dtype)) for i, a in enumerate(case.args)]
    out = case.sg_fn(*operands)
    g = sg.input(f"{prefix}_g", out.shape, dtype=out.dtype)
    diff = [x for x, a in zip(operands, case.args) if a.differentiable]
    grads = sg.grad(out, diff, grad_output=g)
    directions, hvp = [], []
    if case.second_order and second_order:
        directions = [sg.input(f"{prefix}_u{i}", x.shape, dtype=x.dtype) for i, x in enumerate(diff)]
        inner = sg.sum(grads[0] * directions[0])
        for gi, ui in zip(grads[1:], directions[1:]):
            inner = inner + sg.sum(gi * ui)
        hvp = sg.grad(inner, diff)
    return Built(case, operands, g, directions, out, grads, hvp)


def sample_case(built: "Built", dtype: str, seed: int) -> list:
    """Arrays for every input of a built case, drawn deterministically from `seed`."""
    rng = np.random.default_rng(seed)
    operands = [a.sample(rng, dtype) for a in built.case.args]
    rest = [np.array(rng.standard_normal(tuple(v.shape)), dtype=v.dtype)
            for v in [built.cotangent, *built.directions]]
    return [*operands, *rest]


# --------------------------------------------------------------------------
# The torch oracle


def torch_reference(case: Case, arrays: list) -> list:
    """out, grads and HVP computed by torch.autograd, as numpy arrays (same layout as Built.outputs)."""
    n = len(case.args)
    operands = [torch.tensor(a, requires_grad=arg.differentiable) for a, arg in zip(arrays[:n], case.args)]
    g = torch.tensor(arrays[n])
    diff = [t for t, a in zip(operands, case.args) if a.differentiable]
    out = case.torch_fn(*operands)
    # Directions follow the cotangent only when the case was built with its HVP.
    second_order = len(arrays) > n + 1
    grads = torch.autograd.grad(out, diff, g, create_graph=second_order, allow_unused=True)
    grads = [torch.zeros_like(x) if gr is None else gr for gr, x in zip(grads, diff)]
    results = [out, *grads]
    if second_order:
        directions = [torch.tensor(u) for u in arrays[n + 1:]]
        inner = sum((gr * u).sum() for gr, u in zip(grads, directions))
        if inner.requires_grad:
            hvp = torch.autograd.grad(inner, diff, allow_unused=True)
        else:
            hvp = [None] * len(diff)
        results += [torch.zeros_like(x) if h is None else h for h, x in zip(hvp, diff)]
    return [r.detach().numpy(force=True) for r in results]


# --------------------------------------------------------------------------
# Compiled bundles: all cases of one (backend, dtype) in one sg.function


class Bundle:
    """Every case compiled together: one call computes all cases on one draw.

    `results(seed)` feeds each case its own arrays for that seed and caches
    {case name: (arrays, outputs)}; `run_all(arrays_by_name)` runs any set of
    per-case arrays (finite differences perturb every case at once). Cases
    are compiled in chunks so one huge translation unit never dominates a
    compiled backend's build time; a chunk that fails to build falls back to
    one build per case, so only the broken ops fail.
    """

    CHUNK = 20

    def __init__(self, backend: str, dtype: str, cases=CASES, second_order: bool = True):
        self.backend, self.dtype = backend, dtype
        self.built = {c.name: build_case(c, dtype, f"c{k}", second_order) for k, c in enumerate(cases)}
        names = list(self.built)
        self.chunks = []   # (case names, compiled function or None, error)
        for lo in range(0, len(names), self.CHUNK):
            group = names[lo:lo + self.CHUNK]
            try:
                fn = sg.function([v for n in group for v in self.built[n].inputs],
                                 [v for n in group for v in self.built[n].outputs], backend=backend)
                self.chunks.append((group, fn, None))
            except Exception as exc:  # noqa: BLE001 - reported by test_every_case_compiles_together
                self.chunks.append((group, None, exc))
        self._single: dict = {}
        self._results: dict = {}

    @property
    def errors(self) -> list:
        return [err for _, fn, err in self.chunks if fn is None]

    def _run_one(self, name: str, arrays: list) -> list:
        if name not in self._single:
            built = self.built[name]
            self._single[name] = sg.function(built.inputs, built.outputs, backend=self.backend)
        return [np.asarray(o) for o in self._single[name](*arrays)]

    def run_all(self, arrays_by_name: dict) -> dict:
        """{case name: outputs} for every case, each fed its arrays."""
        out = {}
        for group, fn, _ in self.chunks:
            if fn is None:
                for name in group:
                    out[name] = _capture(self._run_one, name, arrays_by_name[name])
                continue
            results = fn(*[a for name in group for a in arrays_by_name[name]])
            pos = 0
            for name in group:
                n = len(self.built[name].outputs)
                out[name] = [np.asarray(o) for o in results[pos:pos + n]]
                pos += n
        return out

    def arrays(self, seed: int) -> dict:
        """{case name: input arrays} of one draw."""
        return {name: sample_case(b, self.dtype, seed + 1000 * k)
                for k, (name, b) in enumerate(self.built.items())}

    def results(self, name: str, seed: int) -> tuple[list, list]:
        """(input arrays, outputs) of one case on draw `seed`; every case runs once per seed."""
        if seed not in self._results:
            arrays = self.arrays(seed)
            self._results[seed] = (arrays, self.run_all(arrays))
        arrays, outputs = self._results[seed]
        result = outputs[name]
        if isinstance(result, Exception):
            raise result
        return arrays[name], result


def _capture(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - re-raised by the one test that asks for this case
        return exc


@functools.lru_cache(maxsize=None)
def bundle(backend: str, dtype: str = "float64") -> Bundle:
    """One Bundle per (backend, dtype) for the whole test session.

    float32 bundles leave out the Hessian-vector products (checked in
    float64), which halves what a compiled backend has to build for them.
    """
    return Bundle(backend, dtype, second_order=(dtype == "float64"))


# float32 on CUDA differs from the NumPy reference by summation order (block-tree reductions, tiled
# matmul) and the device's libm; issue 7 allows 1e-4 relative there. The CPU backends keep their
# tighter tolerances.
CUDA_FLOAT32_RTOL, CUDA_FLOAT32_ATOL = 1e-4, 1e-5


def float32_tolerance(backend: str, rtol: float, atol: float) -> tuple[float, float]:
    """(rtol, atol) for a float32 comparison on `backend`: as given on the CPU, widened to
    issue 7's float32 tolerance on CUDA."""
    if backend == "cuda":
        return max(rtol, CUDA_FLOAT32_RTOL), max(atol, CUDA_FLOAT32_ATOL)
    return rtol, atol


def assert_close(got, want, rtol, atol, what=""):
    """assert_allclose that also checks shapes and says which output differs."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


def assert_near_reference(got: list, want: list, dtype: str) -> None:
    """Each output within 1e-12 (float64) or 2e-5 (float32) of its reference array's largest
    element (at least 1): a compiled program against the NumPy reference's same graph, whose
    sums it adds in another order."""
    tol = 1e-12 if dtype == "float64" else 2e-5
    for k, (g, r) in enumerate(zip(got, want)):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert np.abs(g - r).max() <= tol * max(np.abs(r).max(), 1.0), f"output {k}"


def c_build_options(level: str) -> dict:
    """sg.function's options building a C program and its runtime for a SIMD level instead of this
    machine's: "sse2" (x86-64), "avx2" (x86-64-v3), "wide" (this machine's, with the kernels in
    64-byte vectors, as a CPU with two 512-bit FMA units gets them: on any machine, since gcc splits
    a vector its target lacks), or "" (this machine: no options)."""
    if not level:
        return {}
    march = {"sse2": "x86-64", "avx2": "x86-64-v3", "wide": "native"}[level]
    wide = ["-DSG_VECTOR_BYTES=64"] if level == "wide" else []
    return {"flags": ["-O3", f"-march={march}", "-fopenmp", "-std=c11", "-fno-math-errno", "-fno-trapping-math", *wide]}


def compiled_beside_reference(loss, inputs: list, level: str = "") -> tuple:
    """(C function, NumPy function) of `loss` and its gradient in every input, the C program and
    its runtime built for SIMD `level` (c_build_options)."""
    outputs = [loss, *sg.grad(loss, inputs)]
    return (sg.function(inputs, outputs, backend="c", **c_build_options(level)),
            sg.function(inputs, outputs, backend="numpy"))


def train_beside_torch(step, twin, optimizer, batches, dtype: str, rtol: float) -> None:
    """Steps a symgrad train step (inputs x, y) and its torch twin (with its `optimizer`, cross
    entropy) on the same `batches`: each step's losses within `rtol`, the loss lower at the end
    than at the start, and every parameter and buffer of the twin's state within 100 rtol."""
    losses = []
    for xb, yb in batches:
        xb = xb.astype(dtype)
        ours = step(x=xb, y=yb)
        optimizer.zero_grad()
        loss = TF.cross_entropy(twin(torch.from_numpy(xb)), torch.from_numpy(yb))
        loss.backward()
        optimizer.step()
        losses.append((ours, loss.item()))
    for k, (ours, theirs) in enumerate(losses):
        assert abs(ours - theirs) <= rtol * abs(theirs), f"step {k}: {ours} against torch's {theirs}"
    assert losses[-1][0] < losses[0][0], "the network did not learn"
    for name, value in twin.state_dict().items():
        np.testing.assert_allclose(step.state_dict()[name], value.numpy(), rtol=100 * rtol, atol=100 * rtol,
                                   err_msg=name)


def output_labels(case: Case) -> list[str]:
    """Names of a case's outputs, for error messages: out, grad0.., hvp0.."""
    n = sum(a.differentiable for a in case.args)
    return ["out", *(f"grad{i}" for i in range(n)), *((f"hvp{i}" for i in range(n)) if case.second_order else ())]


class MySquare(sg.Function):
    """The seeds' custom op: x * x with a hand-written backward, 2 * x * g."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return 2 * x * grad_output


def omp_threads() -> int:
    """omp_get_max_threads() of the calling thread, from the OpenMP runtime the programs use (gcc's
    libgomp): the team a program's runtime scratch is sized for."""
    import ctypes
    return int(ctypes.CDLL("libgomp.so.1").omp_get_max_threads())


def set_omp_threads(n: int) -> None:
    """omp_set_num_threads(n) for the calling thread's later parallel regions (and scratch counts)."""
    import ctypes
    ctypes.CDLL("libgomp.so.1").omp_set_num_threads(int(n))


def omp_threads() -> int:
    """omp_get_max_threads() of the calling thread, from the OpenMP runtime the programs use (gcc's
    libgomp): the team a program's runtime scratch is sized for."""
    import ctypes
    return int(ctypes.CDLL("libgomp.so.1").omp_get_max_threads())


def set_omp_threads(n: int) -> None:
    """omp_set_num_threads(n) for the calling thread's later parallel regions (and scratch counts)."""
    import ctypes
    ctypes.CDLL("libgomp.so.1").omp_set_num_threads(int(n))
