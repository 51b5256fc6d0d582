"""The fused attention kernels' products, read in gcc's assembly for each x86-64 level (no timing).

A tile's five products run on a register tile of SG_ATTENTION_ROWS x 2 vectors
(templates/attention/attention_tile.h.j2): its k loop must hold every accumulator and both vectors of b in
registers (no stack access; no multiply reading memory, which would load b once per row), run on
whole vectors, and on the levels with FMA (v3: AVX2, v4: AVX-512) as fused multiply-adds, which
-std=c11 turns off and the template opts back in to. The kernels must call it, and their
softmax loops run on vectors too. A tile too large for the level's registers, a b folded into
each multiply, a lost opt-in, or a kernel that computed its products another way fails here.
"""

from __future__ import annotations

import re

import pytest

import symgrad as sg
from symgrad.backends.kinds.attention import AttentionKernel
from asm_loops import LEVELS, WIDE

ROWS = {"x86-64": 4, "x86-64-v3": 4, "x86-64-v4": 8, WIDE: 8}  # runtime.TARGETS' attention_rows


@pytest.fixture(scope="module")
def attention_c():
    """Causal self-attention and its gradient, nanoGPT's layout (batch, T, heads, 32), in float32
    and float64."""
    outs, inputs = [], []
    for dtype in ("float32", "float64"):
        x = sg.input(f"x_{dtype}", (2, 70, 3, 32), dtype=dtype)
        heads = sg.swapaxes(x, 1, 2)
        y = sg.nn.functional.scaled_dot_product_attention(heads, heads, heads, is_causal=True)
        inputs.append(x)
        outs += [y, *sg.grad((y * y).sum(), [x])]
    return sg.function(inputs, outs, backend="c")


@pytest.mark.parametrize("march", LEVELS)
def test_attention_products_run_on_register_tiles(attention_c, march):
    from asm_loops import assembly, functions, innermost_loops
    asm = assembly(attention_c.source, march)
    loops = innermost_loops(asm)
    for suffix in ("f32", "f64"):
        tile = f"sg_attention_tile{ROWS[march]}_{suffix}"
        tile_loops = [loop for loop in loops if loop.function == tile and loop.vector_multiplies > 0]
        assert tile_loops, f"{march}: no vector k loop in {tile}"
        for loop in tile_loops:
            assert loop.vector_multiplies == 2 * ROWS[march], \
                f"{march}: {tile} multiplies {loop.vector_multiplies} times a step"
            assert not loop.stack_accesses, f"{march}: {tile} spills: {loop.stack_accesses[:3]}"
            folded = [line for line in loop.lines if re.match(r"\s+vfn?madd\w+\s+[-\w]*\(", line)]
            assert not folded, f"{march}: {tile} reads b from memory in each multiply: {folded[:2]}"
            if march != "x86-64":  # SSE2 has no FMA
                assert all("vfmadd" in line for line in loop.lines if "mul" in line), \
                    f"{march}: {tile} multiplies and adds apart"
    bodies = functions(asm)
    names = [k.name for k in attention_c.program.plan.kernels if isinstance(k, AttentionKernel)]
    assert len(names) == 4  # the forward and the gradient, in each dtype
    for name in names:
        text = "\n".join(line for fn, lines in bodies.items() if fn.startswith(name) for line in lines)
        assert re.search(r"call\s+sg_attention_(product|tile)", text), f"{march}: {name} computes its products itself"
        softmax = [loop for loop in loops if loop.function.startswith(name) and loop.vector_multiplies > 0]
        assert softmax, f"{march}: {name}'s rows (scale, exp, rescale) run one element at a time"
