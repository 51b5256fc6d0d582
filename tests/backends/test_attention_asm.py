"""The fused attention kernels' inner loops, read in gcc's assembly for each x86-64 level (no timing).

Their dot products and row updates must run on whole vectors on every level, and on the levels
with FMA (v3: AVX2, v4: AVX-512) as fused multiply-adds: -std=c11 turns contraction off, and
the kernel's template opts back in as the GEMM's does. A kernel that ran one element at a time,
or that lost the opt-in, fails here on any machine.
"""

from __future__ import annotations

import pytest

import symgrad as sg
from symgrad.backends.attention import AttentionKernel


@pytest.fixture(scope="module")
def attention_c():
    """Causal self-attention and its gradient in float32, nanoGPT's layout: (batch, T, heads, 32)."""
    x = sg.input("x", (2, 70, 3, 32))
    heads = sg.swapaxes(x, 1, 2)
    y = sg.nn.functional.scaled_dot_product_attention(heads, heads, heads, is_causal=True)
    return sg.function([x], [y, *sg.grad((y * y).sum(), [x])], backend="c")


@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3", "x86-64-v4"])
def test_attention_loops_are_vector_code_with_fused_multiply_adds(attention_c, march):
    from asm_loops import assembly, kernel_loops
    names = [k.name for k in attention_c.program.plan.kernels if isinstance(k, AttentionKernel)]
    assert len(names) == 2  # the forward and the gradient
    asm = assembly(attention_c.source, march)
    for name in names:
        loops = kernel_loops(asm, name)
        assert len(loops) >= 2, f"{march}: {name} has {len(loops)} vector loops (its dots and row updates)"
        if march != "x86-64":  # SSE2 has no FMA
            fused = [loop for loop in loops if any("vfmadd" in line or "vfnmadd" in line for line in loop.lines)]
            assert len(fused) >= 2, f"{march}: {name}'s loops multiply and add apart (contraction is off)"
