"""The vector width the kernels are tiled in (symgrad.backends.build.vector_width): chosen by
measurement or `$SYMGRAD_VECTOR_BYTES`, kept per CPU, compiler and flags, and the products built
in 64-byte vectors against the NumPy reference on any machine (gcc splits a vector its target
lacks, so the wide tiles' edges are checked where CI runs, not only on a CPU that picks them)."""

from __future__ import annotations

import platform

import numpy as np
import pytest

import symgrad as sg
from helpers import c_build_options
from symgrad.backends.build import runtime, vector_width
from symgrad.backends.build.vector_width import DEFINE, vector_bytes, vector_flags

pytest.importorskip("symgrad.backends.c")

AVX2 = ["-O3", "-march=x86-64-v3", "-fopenmp", "-std=c11", "-fno-math-errno", "-fno-trapping-math"]
x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 -march levels")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache directory, no $SYMGRAD_VECTOR_BYTES and nothing chosen yet in this process."""
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SYMGRAD_VECTOR_BYTES", raising=False)
    monkeypatch.setattr(vector_width, "_CHOSEN", {})
    return tmp_path


def test_the_environment_chooses_without_measuring(fresh, monkeypatch):
    monkeypatch.setattr(vector_width, "measure", lambda flags: pytest.fail("measured"))
    monkeypatch.setenv("SYMGRAD_VECTOR_BYTES", "64")
    assert vector_flags(AVX2) == [DEFINE]
    assert runtime.default_flags()[-1] == DEFINE
    monkeypatch.setenv("SYMGRAD_VECTOR_BYTES", "32")
    assert vector_flags(AVX2) == []
    monkeypatch.setenv("SYMGRAD_VECTOR_BYTES", "48")
    with pytest.raises(ValueError, match="SYMGRAD_VECTOR_BYTES='48'"):
        vector_flags(AVX2)


def test_a_width_in_the_flags_is_left_as_it_is(fresh, monkeypatch):
    monkeypatch.setattr(vector_width, "measure", lambda flags: pytest.fail("measured"))
    assert vector_flags([*AVX2, "-DSG_VECTOR_BYTES=64"]) == []


@pytest.mark.parametrize("rates, chosen", [({32: 100.0, 64: 190.0}, 64),   # two 512-bit FMA units
                                           ({32: 100.0, 64: 104.0}, 32),   # Zen 4: one split in two
                                           (None, 32)])                    # no 64-byte registers
def test_64_bytes_where_they_multiply_add_at_least_half_again_as_fast(fresh, monkeypatch, rates, chosen):
    measured = []
    monkeypatch.setattr(vector_width, "measure", lambda flags: measured.append(flags) or rates)
    assert vector_bytes(AVX2) == chosen
    assert vector_bytes(AVX2) == chosen and len(measured) == 1, "the choice is kept, not measured again"
    assert list((fresh / "vector_width").glob("*.json")), "nothing kept in the cache"


@x86
def test_flags_without_64_byte_registers_measure_nothing(fresh):
    """x86-64-v3 has no AVX-512: the probe builds and says there is no choice to make."""
    assert vector_width.measure(AVX2) is None
    assert vector_bytes(AVX2) == 32


@x86
@pytest.mark.parametrize("march, defines, lanes", [("x86-64", [], 4), ("x86-64-v3", [], 8), ("x86-64-v4", [], 8),
                                                   ("x86-64-v4", [DEFINE], 16), ("x86-64-v3", [DEFINE], 16)])
def test_the_define_sets_the_lanes_of_every_kernel_vector(tmp_path, march, defines, lanes):
    """The runtime header's float vectors (which the GEMM, convolution and attention tiles are
    built of) have 16 lanes under the define on any target, else the target's own; checked by
    the compiler itself (a static assertion), nothing run."""
    import shutil
    import subprocess
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("needs gcc")
    (tmp_path / runtime.HEADER).write_text(runtime.header())
    (tmp_path / "lanes.c").write_text(f'#include "{runtime.HEADER}"\n'
                                      f'_Static_assert(SG_F32_VL == {lanes} && sizeof(sg_vec_f32) == {4 * lanes}, "lanes");\n')
    done = subprocess.run([gcc, "-std=c11", f"-march={march}", *defines, "-fsyntax-only", "lanes.c"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def wide_products():
    """Products of every GEMM path (register tiles with partial edges, narrow right-hand sides,
    an operand read transposed, a K of 1) and their gradients, built in 64-byte vectors, beside
    the NumPy reference."""
    shapes = [(70, 300, 45), (129, 33, 17), (9, 64, 3), (40, 1, 70), (300, 128, 256)]
    inputs, outs = [], []
    for k, (m, kk, n) in enumerate(shapes):
        a, b = sg.input(f"a{k}", (m, kk)), sg.input(f"b{k}", (kk, n))
        y = sg.tanh(a @ b)
        outs += [y, sg.transpose(a) @ y, *sg.grad((y * y).sum(), [a, b])]
        inputs += [a, b]
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(v.shape).astype(np.float32) * 0.3 for v in inputs]
    return (sg.function(inputs, outs, backend="c", **c_build_options("wide")),
            sg.function(inputs, outs, backend="numpy"), arrays)


def test_products_in_64_byte_vectors_match_the_reference(wide_products):
    wide, reference, arrays = wide_products
    for k, (got, want) in enumerate(zip(wide(*arrays), reference(*arrays))):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * max(1.0, np.abs(want).max()),
                                   err_msg=f"output {k}")
