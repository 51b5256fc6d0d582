"""Convolution, padding, pooling, resizing and 4-D BatchNorm against torch, in float64, forward and gradient.

Each case is a symgrad function and the same function in torch; its gradient is that of
sum(out * fixed random weights) with respect to every float input. On every backend.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import symgrad as sg

RNG = np.random.default_rng(17)
X = RNG.standard_normal((2, 4, 7, 6))
W = RNG.standard_normal((6, 4, 3, 3))
WG = RNG.standard_normal((6, 2, 3, 2))     # groups=2
WD = RNG.standard_normal((4, 1, 3, 3))     # depthwise
B = RNG.standard_normal(6)
X1 = RNG.standard_normal((2, 3, 9))
W1 = RNG.standard_normal((5, 3, 3))
TIES = np.repeat(np.repeat(RNG.integers(0, 3, (1, 2, 3, 3)).astype(np.float64), 2, axis=2), 2, axis=3)  # 2x2 ties


def _convs(lib, x, w, wg, wd, b, x1, w1):
    conv2d, conv1d = (TF.conv2d, TF.conv1d) if lib == "torch" else (sg.conv2d, sg.conv1d)
    # (each 3x3 convolution is 9 products forward and 18 backward: few cases keep the C program small)
    return [conv2d(x, w, b, stride=2, padding=1), conv2d(x, w, None, padding=(2, 1), dilation=(2, 1)),
            conv2d(x, w, b, padding="same"), conv2d(x, wg, None, groups=2, padding=1),
            conv2d(x, wd, None, groups=4, stride=2), conv1d(x1, w1, None, stride=2, padding=2, dilation=2)]


def _pools(lib, x, ties):
    T = lib == "torch"
    mp, ap = (TF.max_pool2d, TF.avg_pool2d) if T else (sg.max_pool2d, sg.avg_pool2d)
    aap, interp, pad = (TF.adaptive_avg_pool2d, TF.interpolate, TF.pad) if T else \
        (sg.adaptive_avg_pool2d, sg.interpolate, sg.pad)
    return [mp(x, 2), mp(x, 3, stride=2, padding=1), mp(x, 2, stride=2, ceil_mode=True), mp(x, 2, stride=1, dilation=2),
            mp(ties, 2), mp(ties, 3, stride=1, padding=1),
            ap(x, 2), ap(x, 3, stride=2, padding=1), ap(x, 3, stride=2, padding=1, count_include_pad=False),
            ap(x, 2, stride=2, ceil_mode=True), ap(x, 2, divisor_override=3),
            aap(x, (3, 4)), aap(x, 1), interp(x, size=(9, 4)), interp(x, scale_factor=2),
            pad(x, (1, 2, 0, 1)), pad(x, (1, 2, 2, 1), value=0.5), pad(x, (2, 1, 3, 0), mode="reflect"),
            pad(x, (2, 1, 3, 0), mode="replicate")]


def _sliced_convs(lib, x, w, x1, w1, column):
    """Convolutions of slices: images that start inside their buffer, read where they lie (C read
    the first images of the buffer for a direct convolution: its pointer had no offset)."""
    conv2d, conv1d = (TF.conv2d, TF.conv1d) if lib == "torch" else (sg.conv2d, sg.conv1d)
    return [conv2d(x[1:, :, 2:, :], w, None, padding=1), conv1d(x1[:, 1:, 3:], w1[:, 1:], None),
            conv1d(column[None, 5:-1, 0:1], w1[:1, :, :1], None, stride=3, dilation=2)]


weight_arr, bias_arr = RNG.standard_normal(4), RNG.standard_normal(4)
CASES = {
    "convolutions": (_convs, (X, W, WG, WD, B, X1, W1)),
    "sliced convolutions": (_sliced_convs, (RNG.standard_normal((3, 4, 9, 6)), W, X1, W1, RNG.standard_normal((9, 1)))),
    "pooling": (_pools, (X, TIES)),
}


def _weights(shape):
    return np.random.default_rng(sum(shape) * 31 + len(shape)).standard_normal(tuple(shape))


def _torch(case):
    build, arrays = CASES[case]
    tensors = [torch.tensor(a, requires_grad=True) for a in arrays]
    outs = build("torch", *tensors)
    total = sum((o * torch.tensor(_weights(o.shape))).sum() for o in outs)
    grads = torch.autograd.grad(total, tensors, allow_unused=True)
    return [o.detach().numpy() for o in outs], [None if g is None else g.numpy() for g in grads]


def _symgrad(case, backend):
    build, arrays = CASES[case]
    inputs = [sg.input(f"a{k}", a.shape, dtype="float64") for k, a in enumerate(arrays)]
    outs = build("sg", *inputs)
    total = sum(((o * sg.constant(_weights(o.shape), "float64")).sum() for o in outs), sg.constant(0.0, "float64"))
    results = sg.function(inputs, outs + list(sg.grad(total, inputs)), backend=backend)(*arrays)
    return results[:len(outs)], results[len(outs):]


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_gradient_match_torch(case, backend):
    want_out, want_grad = _torch(case)
    got_out, got_grad = _symgrad(case, backend)
    for k, (g, w) in enumerate(zip(got_out, want_out)):
        assert g.shape == w.shape, f"{case} output {k}: shape {g.shape}, torch {w.shape}"
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12, err_msg=f"{case} output {k}")
    for k, (g, w) in enumerate(zip(got_grad, want_grad)):
        if w is None:
            np.testing.assert_array_equal(g, 0)
        else:
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-11, err_msg=f"{case} gradient {k}")


def test_max_pool_ties_send_the_gradient_to_the_first_element_as_torch():
    t = torch.tensor(TIES, requires_grad=True)
    (want,) = torch.autograd.grad(TF.max_pool2d(t, 2).sum(), [t])
    x = sg.input("x", TIES.shape, dtype="float64")
    (got,) = sg.function([x], sg.grad(sg.max_pool2d(x, 2).sum(), [x]), backend="numpy")(TIES)
    np.testing.assert_array_equal(got, want.numpy())
    assert got.sum() == TIES.size / 4      # one element per window, never split


def test_max_pool_lets_a_nan_win_over_inf_as_torch(backend):
    """torch's scan keeps the first maximum and lets every NaN replace it: a window holding inf
    before a NaN is NaN (symgrad gave inf; the fuzzer found it), its gradient goes to the last NaN."""
    inf, nan = np.inf, np.nan
    a = np.array([[[[inf, nan, 1.0, 2.0, nan, 0.0], [0.0, nan, nan, -inf, inf, -inf],
                    [-inf, -inf, 3.0, 3.0, 1.0, inf], [nan, inf, 5.0, 5.0, inf, 1.0]]]])
    cot = np.arange(1.0, 7.0).reshape(1, 1, 2, 3)
    t = torch.tensor(a, requires_grad=True)
    want = TF.max_pool2d(t, 2)
    (want_grad,) = torch.autograd.grad(want, [t], torch.tensor(cot))
    x, c = sg.input("x", a.shape, dtype="float64"), sg.input("c", cot.shape, dtype="float64")
    y = sg.max_pool2d(x, 2)
    got, got_grad = sg.function([x, c], [y, *sg.grad(sg.sum(y * c), [x])], backend=backend)(a, cot)
    np.testing.assert_array_equal(got, want.detach().numpy())
    np.testing.assert_array_equal(got_grad, want_grad.numpy())


def test_batch_norm_2d_trains_and_updates_statistics_as_torch():
    x = sg.input("x", X.shape, dtype="float64")
    sg.manual_seed(0)
    bn = sg.nn.BatchNorm2d(4, momentum=0.2).double()
    bn.load_state_dict({"weight": weight_arr, "bias": bias_arr}, strict=False)
    loss = (bn(x) * sg.constant(_weights(X.shape), "float64")).sum()
    step = sg.train_step(loss, bn.parameters(), sg.optim.SGD(lr=0.1), backend="numpy")
    twin = torch.nn.BatchNorm2d(4, momentum=0.2).double()
    twin.load_state_dict({"weight": torch.tensor(weight_arr), "bias": torch.tensor(bias_arr),
                          "running_mean": torch.zeros(4), "running_var": torch.ones(4),
                          "num_batches_tracked": torch.tensor(0)})
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    for _ in range(2):
        ours = step(x=X)
        opt.zero_grad()
        theirs = (twin(torch.tensor(X)) * torch.tensor(_weights(X.shape))).sum()
        theirs.backward()
        opt.step()
        assert ours == pytest.approx(theirs.item(), rel=1e-12)
    for name, value in twin.state_dict().items():
        np.testing.assert_allclose(step.state_dict()[name], value.numpy(), rtol=1e-12, err_msg=name)


@pytest.mark.parametrize("fn, inputs", [
    (lambda x, w: sg.conv2d(x, w, stride=2, padding=1), [X[:1, :2, :5, :5], W[:2, :2]]),
    (lambda x: sg.max_pool2d(x, 2, stride=1), [X[:1, :1, :4, :4]]),
    (lambda x: sg.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False), [X[:1, :1]]),
    (lambda x: sg.pad(x, (2, 1, 1, 2), mode="reflect") ** 2, [X[:1, :1, :4, :4]]),
], ids=["conv2d", "max_pool2d", "avg_pool2d", "reflect-pad"])
def test_gradients_match_finite_differences(fn, inputs):
    assert sg.gradcheck(fn, [np.ascontiguousarray(a) for a in inputs])


def test_modules_have_torchs_parameters_and_refuse_bad_arguments():
    sg.manual_seed(0)
    conv = sg.nn.Conv2d(4, 6, (3, 2), groups=2, bias=True)
    twin = torch.nn.Conv2d(4, 6, (3, 2), groups=2)
    assert {k: v.shape for k, v in conv.state_dict().items()} == {k: tuple(v.shape) for k, v in twin.state_dict().items()}
    bound = 1 / np.sqrt(2 * 3 * 2)
    assert np.abs(conv.state_dict()["weight"]).max() <= bound
    assert list(sg.nn.Conv1d(3, 5, 3).state_dict()) == ["weight", "bias"]
    x = sg.input("x", (2, 4, 7, 6), dtype="float64")
    with pytest.raises(ValueError, match="conv2d: input .* do not fit groups=3"):
        sg.conv2d(x, sg.input("w", (6, 4, 3, 3), dtype="float64"), groups=3)
    with pytest.raises(ValueError, match="conv2d: the kernel 9x3"):
        sg.conv2d(x, sg.input("w", (6, 4, 9, 3), dtype="float64"))
    with pytest.raises(ValueError, match="padding='same' needs stride 1"):
        sg.conv2d(x, sg.input("w", (6, 4, 3, 3), dtype="float64"), padding="same", stride=2)
    with pytest.raises(ValueError, match="max_pool2d: padding .* at most half the kernel"):
        sg.max_pool2d(x, 2, padding=2)
    with pytest.raises(ValueError, match="pad: reflect padding"):
        sg.pad(x, (6, 0), mode="reflect")
    with pytest.raises(ValueError, match="Conv2d: in_channels 4 and out_channels 6 must be multiples of groups 4"):
        sg.nn.Conv2d(4, 6, 3, groups=4)
    with pytest.raises(ValueError, match="BatchNorm2d\\(3\\): expected input"):
        sg.nn.BatchNorm2d(3)(x)


def test_the_report_shows_each_convolutions_im2col_and_its_bytes():
    """step.report() names the lowering issue 17 asks it to show: the im2col of each convolution
    (channels last and one GEMM without groups, per image and group with them, and per image for
    a few output channels over short patches), its col2im in the backward, and the bytes of each
    patch matrix: stored by a take, or gathered by the GEMMs as they pack it (implicit GEMM: the
    forward product and the weight's gradient, which reads it transposed), or, per image along whole
    output rows, read in place by a direct convolution."""
    x = sg.input("x", (4, 6, 10, 9))
    w, wg = sg.param("w", (24, 6, 3, 3), init="normal"), sg.param("wg", (8, 3, 3, 3), init="normal")
    narrow = sg.param("narrow", (8, 6, 3, 3), init="normal")  # 8 outputs over patches of 54: per image
    loss = (sg.sum(sg.conv2d(x, w, padding=1) ** 2) + sg.sum(sg.conv2d(x, wg, groups=2, stride=2) ** 2)
            + sg.sum(sg.conv2d(x, narrow, padding=1) ** 2))
    report = sg.function([x], [loss, *sg.grad(loss, [x, w, wg, narrow])], backend="c").report()
    lines = str(report.kernels).split("== gathers by purpose ==")[1].split("\n\n")[0].strip().splitlines()
    plain = [line for line in lines if "channels last: 360 x 54 patch rows, one GEMM" in line]
    grouped = [line for line in lines if "groups=2: 27 x 16 patches per image and group" in line]
    per_image = [line for line in lines if "groups=1: 54 x 90 patches per image and group" in line]
    assert len(plain) == 3 and len(grouped) == 2 and len(per_image) == 3, lines   # each im2col and its col2im
    direct = [line for line in per_image if "(direct convolution)" in line]   # read by both products in place
    assert len(direct) == 2 and sum("read transposed from" in line for line in direct) == 1, per_image
    assert all(line.endswith(f"{54 * 90 * 4 * 4 / 1024:.1f} KiB never stored") for line in direct), direct
    assert sum("col2im, the gradient of conv2d 3x3 im2col" in line for line in lines) == 3
    patch_bytes = 360 * 54 * 4   # (N*Ho*Wo, KH*KW*C) float32: 4 images of 10x9 positions
    implicit = [line for line in plain if "(implicit GEMM)" in line]
    assert len(implicit) == 2 and sum("gathered transposed from" in line for line in implicit) == 1, plain
    assert all(line.endswith(f"{patch_bytes / 1024:.1f} KiB never stored") for line in implicit), implicit
    assert not any("take" in line for line in plain), plain   # no take stores those patches


def test_pools_of_tiles_copy_their_windows_and_their_gradients_scatter_nothing():
    """Windows that tile the input (stride = kernel, no padding, no dilation; floor mode drops the
    last row) are a copy of a view of it, not a gather: the gradient is the copy back, not a
    scatter-add (on LeNet's step the pools took 20% longer as gathers). _pools checks the values
    and gradients of these pools against torch; this, that no gather is left."""
    x = sg.input("x", (2, 3, 7, 6), dtype="float64")
    y = sg.sum(sg.max_pool2d(x, 2)) + sg.sum(sg.avg_pool2d(x, (3, 2)))
    ops = {n.op.name for n in sg.Graph([x], [y, *sg.grad(y, [x])]).nodes}
    assert "take" not in ops and "scatter_add" not in ops, ops
    z = sg.max_pool2d(x, 2, stride=1)   # overlapping windows are gathered
    assert "take" in {n.op.name for n in sg.Graph([x], [z]).nodes}


def test_max_pool_of_minus_inf_beside_padding_sends_the_gradient_into_the_input(backend):
    """torch scans a window's elements inside the input only: where they are all -inf, the first
    of them is the maximum and gets the gradient. symgrad's windows hold the -inf padding too, and
    took the padding (the gradient was lost; the fuzzer found it). Padding, dilation, ceil mode."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal((1, 2, 4, 5))
    a[0, 0, 0, :2], a[0, 1, :2, :2], a[0, 0, 3, 4] = -np.inf, -np.inf, -np.inf
    for kw in (dict(kernel_size=2, padding=1), dict(kernel_size=(2, 3), stride=2, padding=1, ceil_mode=True),
               dict(kernel_size=3, stride=1, padding=1, dilation=2)):
        t = torch.tensor(a, requires_grad=True)
        want = TF.max_pool2d(t, **kw)
        cot = rng.standard_normal(tuple(want.shape))
        (want_grad,) = torch.autograd.grad(want, [t], torch.tensor(cot))
        x, c = sg.input("x", a.shape, dtype="float64"), sg.input("c", cot.shape, dtype="float64")
        y = sg.max_pool2d(x, **kw)
        got, got_grad = sg.function([x, c], [y, *sg.grad(sg.sum(y * c), [x])], backend=backend)(a, cot)
        np.testing.assert_array_equal(got, want.detach().numpy(), err_msg=str(kw))
        np.testing.assert_array_equal(got_grad, want_grad.numpy(), err_msg=str(kw))


def test_direct_convolution_weight_gradient_with_infinite_gradients_as_torch(backend):
    """The weight gradient of a direct convolution (sg_conv_rows, transposed) with infinite
    gradients at positions its last vector covers twice: those lanes are zeroed in both factors
    (an infinite gradient times a zeroed pixel was NaN on C, where torch has the infinity)."""
    x0 = RNG.standard_normal((1, 6, 11))
    w0 = RNG.standard_normal((3, 2, 2))
    g0 = RNG.standard_normal((1, 3, 11))
    g0[0, :, 5], g0[0, :, 7] = np.inf, -np.inf   # inside the overlap for 4 and for 8 lanes
    x, w, g = (sg.input(n, a.shape, dtype="float64") for n, a in (("x", x0), ("w", w0), ("g", g0)))
    out = sg.conv1d(x, w, groups=3, padding="same")
    step = sg.function([x, w, g], sg.grad(sg.sum(out * g), [w]), backend=backend)
    if backend == "c":
        assert "sg_conv_rows" in step.source   # the path under test
    wt = torch.tensor(w0, requires_grad=True)
    (want,) = torch.autograd.grad(TF.conv1d(torch.tensor(x0), wt, groups=3, padding="same"), wt, torch.tensor(g0))
    np.testing.assert_allclose(step(x0, w0, g0)[0], want.numpy(), rtol=1e-12)
