"""Finite-difference checks of every differentiable op in float64, along random directions.

For each case of tests/helpers.py, with L(x) = <out(x), g>: the directional
derivative dL/dx . d from a 4-point central stencil must equal
sum_i <grad_i, d_i>, and the change of the gradients along d must equal the
Hessian-vector product the graph computes. All cases move at once, so each
stencil point is one call of the shared compiled bundle.
"""

import functools

import numpy as np
import pytest

from helpers import BY_NAME, CASE_NAMES, bundle

H = 1e-3          # step: the 4-point stencil's error is O(H**4), rounding O(eps/H)
STENCIL = ((2, -1 / 12), (1, 8 / 12), (-1, -8 / 12), (-2, 1 / 12))


@functools.lru_cache(maxsize=None)
def finite_differences(backend: str, seed: int):
    """{case: (analytic dL.d, numeric dL.d, analytic <hvp, d>, numeric <dgrad, u>)} for one draw."""
    b = bundle(backend, "float64")
    base = b.arrays(seed)
    rng = np.random.default_rng(seed + 77)
    directions = {}
    for name, built in b.built.items():
        n = len(built.case.args)
        directions[name] = [rng.standard_normal(a.shape) if arg.differentiable else None
                            for a, arg in zip(base[name][:n], built.case.args)]
    at = b.run_all(base)
    numeric_l = {name: 0.0 for name in base}
    numeric_h = {name: 0.0 for name in base}
    for k, weight in STENCIL:
        moved = {}
        for name, arrays in base.items():
            n = len(b.built[name].case.args)
            moved[name] = [a + (k * H) * d if d is not None else a
                           for a, d in zip(arrays[:n], directions[name])] + list(arrays[n:])
        results = b.run_all(moved)
        for name, outs in results.items():
            if isinstance(outs, Exception):
                continue
            g = base[name][len(b.built[name].case.args)]
            numeric_l[name] += weight * float(np.sum(outs[0] * g)) / H
            ndiff = len(b.built[name].grads)
            us = base[name][len(b.built[name].case.args) + 1:]
            numeric_h[name] += weight * sum(float(np.sum(gr * u)) for gr, u in zip(outs[1:1 + ndiff], us)) / H
    report = {}
    for name, outs in at.items():
        if isinstance(outs, Exception):
            report[name] = outs
            continue
        ndiff = len(b.built[name].grads)
        ds = [d for d in directions[name] if d is not None]
        analytic_l = sum(float(np.sum(gr * d)) for gr, d in zip(outs[1:1 + ndiff], ds))
        analytic_h = sum(float(np.sum(h * d)) for h, d in zip(outs[1 + ndiff:], ds))
        report[name] = (analytic_l, numeric_l[name], analytic_h, numeric_h[name])
    return report


@pytest.mark.parametrize("seed", [11, 12])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_gradient_matches_finite_differences(backend, name, seed):
    result = finite_differences(backend, seed)[name]
    if isinstance(result, Exception):
        raise result
    analytic, numeric, _, _ = result
    tol = BY_NAME[name].fd_tol
    assert abs(analytic - numeric) <= tol * (1 + abs(numeric)), \
        f"{name}: dL.d analytic {analytic!r} vs finite differences {numeric!r}"


@pytest.mark.parametrize("name", [n for n in CASE_NAMES if BY_NAME[n].second_order])
def test_hessian_vector_product_matches_finite_differences(backend, name):
    result = finite_differences(backend, 11)[name]
    if isinstance(result, Exception):
        raise result
    _, _, analytic, numeric = result
    tol = BY_NAME[name].fd_tol
    assert abs(analytic - numeric) <= tol * (1 + abs(numeric)), \
        f"{name}: d.H.u analytic {analytic!r} vs finite differences {numeric!r}"
