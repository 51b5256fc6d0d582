"""The runtime's bfloat16 GEMM (templates/c/gemm_bf16.c.j2), checked where its speed is decided:
the k loop gcc writes for an AVX512_BF16 target is vdpbf16ps on a register tile that never touches
the stack, and a target without it keeps the float32 path. Read in the assembly, not run: this
machine need not have AVX512_BF16."""

from __future__ import annotations

import pytest

from asm_loops import assembly, innermost_loops


@pytest.fixture(scope="module")
def runtime_source() -> str:
    """The runtime's preamble and its bfloat16 GEMM alone (gcc on the whole runtime takes 15 s)."""
    from symgrad.backends import runtime
    source = runtime.source()
    preamble = source.split("void sg_team_begin_call", 1)[0]
    start = source.index("/*\n * sg_gemm_bf16:")
    end = source.index("#endif", source.index("return sg_gemm_f32(M, N, K, A, sam, sak, B, sbk, sbn, C, context, ep);"))
    return preamble + source[start:end + len("#endif")] + "\n"


def test_bf16_k_loop_is_vdpbf16ps_in_registers(runtime_source):
    """sapphirerapids (AVX512_BF16): the micro-kernel's k loop holds 16 vdpbf16ps (8 rows x 2
    vectors of 16 float32 sums: 32 multiply-adds each), 2 loads of B and 8 broadcasts of A's pairs,
    and no load or store through the stack (16 accumulators within the 32 registers)."""
    asm = assembly(runtime_source, "sapphirerapids")
    loops = [loop for loop in innermost_loops(asm) if loop.function.startswith("sg_micro_bf16")
             and any("vdpbf16ps" in line for line in loop.lines)]
    assert len(loops) == 1, [loop.function for loop in loops]
    (loop,) = loops
    instructions = [line.split()[0] for line in loop.lines if line.startswith("\t") and not line.lstrip().startswith(".")]
    assert instructions.count("vdpbf16ps") == 16
    assert instructions.count("vpbroadcastd") == 8
    assert not loop.stack_accesses, loop.stack_accesses
    assert not any(i.startswith("vfmadd") for i in instructions)


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v4"])
def test_without_avx512_bf16_the_float32_gemm_computes_it(runtime_source, march):
    """Without AVX512_BF16 (SSE2, AVX2, AVX-512 of Skylake) no vdpbf16ps is emitted and
    sg_gemm_bf16 calls sg_gemm_f32, whose products of bfloat16 values are exact."""
    asm = assembly(runtime_source, march)
    assert "vdpbf16ps" not in asm
    body = asm.split("sg_gemm_bf16:", 1)[1].split(".size\tsg_gemm_bf16", 1)[0]
    assert "sg_gemm_f32" in body
