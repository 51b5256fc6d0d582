"""No C function symgrad emits is over MAX_FUNCTION_LINES lines (issue 33), as none of its Python is
(tests/test_package_layout.py): a kernel too long to read at once is split into named helpers
(static inline: the machine code of its inner loops stays the same, checked in their assembly by
test_gemm_kernels.py, test_conv_rows.py and test_attention_asm.py).

The C read is what programs are built from: the runtime (its header and source, for every target
its #if chains choose between: tests/c_functions.py), the golden training steps (a GPT
block, a CNN taking every convolution kind, the softmax regression: tests/golden/*.c, held equal
to what is emitted by test_golden_models.py and test_golden_step.py) and fused attention rendered
both ways it is emitted beside the golden GPT's (its gradient apart from its forward, and not causal).
Nothing is compiled. (An export's sources, train_main and the library, are checked in
tests/tools/test_export.py, where they are written.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

import symgrad as sg
from symgrad.backends.build import runtime
from symgrad.backends.driver import compile_stages
from symgrad.backends.render.languages import C_ENTRY, C_SCRATCH_BYTES, C_OPENMP, C_WORKSPACE_SIZES
from symgrad.ir.ops_attention import attention, attention_grad

from c_functions import PROGRAM_LISTS, function_lengths, over_the_limit

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def _attention_source() -> str:
    """Fused attention and its gradient apart from it (the forward's output handed in: it sweeps
    for the softmax), causal and not: the kernels' variants the golden GPT block has not."""
    q, g, out = (sg.input(name, (3, 70, 16)) for name in ("q", "g", "out"))
    outputs = []
    for causal in (True, False):
        outputs += [attention(q, q * 0.5, sg.tanh(q), causal, 0.3),
                    attention_grad(q, q * 0.5, sg.tanh(q), out, g, causal, 0.3)]
    graph = sg.function([q, g, out], outputs, backend="numpy").program.graph
    return compile_stages(graph, C_OPENMP).source


@pytest.fixture(scope="module")
def sources() -> dict[str, str]:
    texts = {"runtime source": runtime.source(), "runtime header": runtime.header(),
             "attention": _attention_source()}
    texts.update({f"tests/golden/{p.name}": p.read_text() for p in sorted(GOLDEN.glob("*.c"))})
    return texts


def test_no_emitted_c_function_over_the_limit(sources):
    lengths = {name: function_lengths(text) for name, text in sources.items()}
    assert all(lengths[f"tests/golden/{n}"] for n in ("gpt_block_step.c", "cnn_step.c"))
    assert any(f.startswith("sg_conv_rows") for f in lengths["runtime source"])
    assert any("_attention_grad_t" in f for f in lengths["attention"])
    long = {f"{name}: {f}": n for name, text in sources.items() for f, n in over_the_limit(text).items()}
    assert long == {}


def test_the_exempt_lists_are_the_programs_entry_points():
    assert PROGRAM_LISTS == {C_ENTRY, C_WORKSPACE_SIZES, C_SCRATCH_BYTES}


def test_the_length_check_reads_c_as_its_reader_does():
    """Lines from the name to the closing brace; braces in comments, strings and initialisers
    neither open nor close a function; a function defined once per target in an #if chain is
    measured in each branch (its longest counts); a macro's body is no function."""
    source = "\n".join([
        "#define BLOCK(x) { x; }",
        "static const int table[2] = { 1, 2 };",
        "/* f { */",
        "static int f(int a,",
        "             int b)",
        "{",
        '    const char* s = "}";',
        "    return a + b + table[0];  /* } */",
        "}",
        "#if defined(__AVX512VL__)",
        "void g(void) {",
        "}",
        "#elif defined(__AVX__)",
        "void g(void)",
        "{",
        "    int x = 1;",
        "    (void)x;",
        "}",
        "#else",
        "void g(void) { }",
        "#endif",
        "typedef struct { int a; } pair;",
    ])
    assert function_lengths(source) == {"f": 6, "g": 5}
