"""Elementwise epilogues fused into the C backend's matmul kernels, against the NumPy reference.

`relu(x @ W + b)` and relu's backward mask `where(h > 0, dy @ W, 0)` run as the GEMM stores each
element of the product: one MatmulKernel, no loop kernel, no buffer for the bare product. The
cases cover every matmul path (the blocked GEMM over several K chunks and its partial edge tiles,
A read in place or packed, the column-split OpenMP path, both narrow-N kernels) at sizes that are
not multiples of the register tile. One module per dtype holds every case.
"""

import numpy as np
import pytest

import symgrad as sg
from symgrad.backends import c as cbackend
from symgrad.backends.lower.lowering import PRODUCT, LoopKernel, MatmulKernel, contiguous_strides, lower
from symgrad.backends.render.languages import C_OPENMP
from symgrad.backends.render.renderer import Renderer
from symgrad.ir.graph import Graph

pytest.importorskip("symgrad.backends.c")

BATCHES = (7, 130)  # one row block; several 72-row blocks with a ragged last one
TOL = {"float32": dict(rtol=3e-5, atol=3e-5), "float64": dict(rtol=1e-11, atol=1e-11)}


def build_cases(dtype: str) -> tuple[list, dict]:
    """The inputs and {case name: output} of the suite; every output is an epilogue over a matmul."""
    B = sg.Dim("B")
    inp = {}

    def new(name, shape):
        inp[name] = sg.input(name, shape, dtype)
        return inp[name]

    cases = {
        # 37 x 600 x 45: K in 3 chunks of 200 (the epilogue must wait for the last), A packed,
        # a ragged last row tile (37 = 6 x 6 + 1) and column sliver (45 = 2 x 16 + 13)
        "bias_relu_k_chunks": sg.relu(new("x1", (37, 600)) @ new("w1", (600, 45)) + new("b1", (45,))),
        # 100 x 300 x 200: with 2+ threads each takes a slice of the columns (the epilogue's
        # columns are offset by the slice's start); 2 K chunks
        "bias_relu_column_split": sg.relu(new("x2", (100, 300)) @ new("w2", (300, 200)) + new("b2", (200,))),
        # narrow N = 10 with A's rows contiguous: the dot kernel, 2-row blocks, odd B
        "bias_tanh_narrow_dot": sg.tanh(new("x3", (B, 20)) @ new("w3", (20, 10)) + new("b3", (10,))),
        # narrow N = 10 with A transposed: the tn kernel; relu's backward mask reads an (M, N) operand
        "mask_narrow_tn": sg.where(new("h4", (B, 10)) > 0,
                                   sg.transpose(new("a4", (30, B))) @ new("w4", (30, 10)), 0.0),
        # N = 1: one column, a scalar bias broadcast to every element
        "narrow_one_column": sg.sigmoid(new("x5", (5, 3)) @ new("w5", (3, 1)) + 0.25),
        # B transposed (strided columns), 21 columns: A read in place; the other operand is (M, N)
        "transposed_b_where": sg.where(new("z6", (13, 21)) > 0.3,
                                       new("x6", (13, 17)) @ sg.transpose(new("w6", (21, 17))),
                                       new("z6b", (13, 21)) * 0.5),
        # A transposed with a Dim stride, an operand read through a transposed view (stride B)
        "transposed_operand": (sg.transpose(new("a7", (40, B))) @ new("w7", (40, 50)))
                              * sg.transpose(new("z7", (50, B))) - new("b7", (50,)),
    }
    return list(inp.values()), cases


@pytest.fixture(scope="module", params=["float32", "float64"])
def suite(request):
    dtype = request.param
    inputs, cases = build_cases(dtype)
    fn = sg.function(inputs, list(cases.values()), backend="c")
    ref = sg.function(inputs, list(cases.values()), backend="numpy")
    return dtype, inputs, list(cases), fn, ref


def _arrays(inputs, batch, seed):
    rng = np.random.default_rng(seed)
    shapes = [tuple(batch if not isinstance(s, int) else s for s in v.shape) for v in inputs]
    return [rng.standard_normal(shape).astype(v.dtype) for shape, v in zip(shapes, inputs)]


@pytest.mark.parametrize("batch", BATCHES)
def test_fused_epilogues_match_numpy(suite, batch):
    dtype, inputs, names, fn, ref = suite
    arrays = _arrays(inputs, batch, seed=batch)
    got, want = fn(*arrays), ref(*arrays)
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(g, w, **TOL[dtype], err_msg=name)


def test_every_case_is_one_matmul_kernel_writing_the_output(suite):
    _, _, names, fn, _ = suite
    plan = fn.program.plan
    assert not [k.name for k in plan.kernels if isinstance(k, LoopKernel)]
    assert len(plan.workspace) == 0  # no product is materialized
    for name, out in zip(names, plan.outputs):
        (kernel,) = [k for k in plan.kernels if k.out is out]
        assert isinstance(kernel, MatmulKernel) and kernel.epilogue_statements, name
    assert "matmul + 2 fused op(s)" in fn.report()


def test_every_matmul_path_is_called_with_its_epilogue(suite):
    dtype, _, _, fn, _ = suite
    src = fn.source
    suffix = "f32" if dtype == "float32" else "f64"
    # 10 columns: the dot kernel in two blocks of 5 (6 at most per block), the tn kernel in one
    for gemm in (f"sg_gemm_{suffix}(", f"sg_gemm_dot5_{suffix}(", f"sg_gemm_tn10_{suffix}("):
        calls = [c for c in src.split(gemm)[1:] if "&epilogue" in c.split(";")[0]]
        assert calls, gemm
    assert src.count("&epilogue, context->scratch);") == 7
    # each epilogue function computes its nodes with the loop kernels' sympy printing, one commented
    # line per node, between reading the product back and storing the root
    exprs = Renderer(fn.program.plan, C_OPENMP).ex
    for k in fn.program.plan.kernels:
        body = src.split(f"static void {k.name}_epilogue(")[1].split("\n}\n")[0]
        at = exprs.index(0, ["row", "col"], contiguous_strides((k.M, k.N)))
        lines = [f"{PRODUCT} = {k.out.name}[{at}];"]
        lines += [f"{st.name} = {exprs.statement(st)};  /* {cbackend.comment(st.line)} */"
                  for st in k.epilogue_statements]
        lines.append(f"{k.out.name}[{at}] = {k.epilogue_result};")
        where = [body.find(line) for line in lines]
        assert -1 not in where and where == sorted(where), (k.name, lines)


def test_bare_product_is_kept_when_something_else_reads_it():
    """The product is an output too, a bool result cannot be stored by the GEMM, and a variable's new
    value keeps its in-place loop: no epilogue for any of them."""
    x, y, w = sg.input("x", (8, 5)), sg.input("y", (8, 3)), sg.param("w", (5, 3), init="ones")
    prod = x @ w
    plan = lower(Graph([x], [prod, sg.relu(prod), (x @ w) > 0]), matmul_epilogues=True)
    assert not any(isinstance(k, MatmulKernel) and k.epilogue_statements for k in plan.kernels)
    step = Graph([x, y], [], [(w, w - 0.1 * (sg.transpose(x) @ y))])
    plan = lower(step, matmul_epilogues=True)
    assert plan.in_place == ["w"] and not any(isinstance(k, MatmulKernel) and k.epilogue_statements
                                          for k in plan.kernels)


def test_epilogues_are_off_by_default():
    """lower() keeps the product in a buffer of its own unless asked (the CUDA backend's matmul has
    no epilogue yet); with matmul_epilogues=True the chain moves into the matmul kernel."""
    x, w, b = sg.input("x", (8, 5)), sg.input("w", (5, 3)), sg.input("b", (3,))
    graph = Graph([x, w, b], [sg.relu(x @ w + b)])
    plain = lower(graph)
    assert [type(k).__name__ for k in plain.kernels] == ["MatmulKernel", "LoopKernel"]
    (fused,) = lower(graph, matmul_epilogues=True).kernels
    assert isinstance(fused, MatmulKernel) and [s.node.op.name for s in fused.epilogue_statements] == ["add", "relu"]
