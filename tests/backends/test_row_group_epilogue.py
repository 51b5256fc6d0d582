"""A reduction whose epilogue root a row group computes is a kernel of its own, before the group.

The fuzzer (seed 27112026, batch 14, graph 192) drew v0 + sigmoid(exp(max_pool2d(x))): the
gradient's sum of the cotangent over v0's broadcast chose the map multiplying it by the sigmoid's
derivative as its epilogue, and that map joined the pooling's row group. The group's kernel
computed the map, so the sum's kernel was never emitted and lowering failed (KeyError).
"""

import numpy as np
import torch

import symgrad as sg


def test_the_reduction_is_computed_before_the_group_that_reads_it():
    x, v0 = sg.input("x", (3, 3, 2, 3), dtype="float64"), sg.input("v0", (4,), dtype="float64")
    z = v0 + sg.sigmoid(sg.exp(sg.max_pool2d(x, kernel_size=(2, 3), stride=2, padding=1, dilation=2)))
    cot = sg.input("cot", z.shape, dtype="float64")
    grads = sg.grad(sg.sum(z * cot), [x, v0])
    rng = np.random.default_rng(0)
    values = [rng.standard_normal((3, 3, 2, 3)), rng.standard_normal(4), rng.standard_normal(tuple(z.shape))]
    got = sg.function([x, v0, cot], [z, *grads], backend="c")(*values)
    tx, tv = (torch.tensor(a, requires_grad=True) for a in values[:2])
    tz = tv + torch.sigmoid(torch.exp(torch.nn.functional.max_pool2d(tx, (2, 3), stride=2, padding=1, dilation=2)))
    (tz * torch.from_numpy(values[2])).sum().backward()
    for ours, theirs in zip(got, [tz.detach(), tx.grad, tv.grad]):
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-12, atol=1e-14)
