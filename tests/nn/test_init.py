"""sg.nn.init against torch.nn.init: the same fans, gains and bounds (exactly: torch's own numbers
are captured from its calls), the same distributions (statistics of large draws), values set
through the parameter's one owner, and the same seed giving the same values."""

from __future__ import annotations

import math
import tracemalloc
from unittest import mock

import numpy as np
import pytest
import torch

import symgrad as sg
from symgrad import nn
from symgrad.nn import init

torch.set_num_threads(1)

SHAPES = {"linear": (30, 20), "conv1d": (8, 3, 7), "conv2d": (16, 3, 5, 3), "grouped conv2d": (12, 2, 3, 3)}


def _param(shape, dtype="float64") -> sg.Value:
    return sg.param("w", shape, dtype=dtype)


def _value(p) -> np.ndarray:
    return p.attrs["cell"].read()


def _torch_bounds(fn, shape, *args, **kwargs) -> tuple[float, float]:
    """The (low, high) torch's `fn` passes to Tensor.uniform_ (its exact bound)."""
    seen = []
    with mock.patch.object(torch.Tensor, "uniform_", lambda self, a, b, generator=None: seen.append((a, b)) or self):
        fn(torch.empty(shape, dtype=torch.float64), *args, **kwargs)
    (bounds,) = seen
    return bounds


def _our_bounds(fn, shape, *args, **kwargs) -> tuple[float, float]:
    """The (low, high) our `fn` (a function, or its name in sg.nn.init) draws between."""
    seen = []
    original = init.uniform_
    with mock.patch.object(init, "uniform_", lambda t, a, b, g=None: seen.append((a, b)) or original(t, a, b, g)):
        (getattr(init, fn) if isinstance(fn, str) else fn)(_param(shape), *args, **kwargs)
    (bounds,) = seen
    return bounds


def _torch_std(fn, shape, *args, **kwargs) -> float:
    seen = []
    with mock.patch.object(torch.Tensor, "normal_", lambda self, mean=0, std=1, generator=None: seen.append(std) or self):
        fn(torch.empty(shape, dtype=torch.float64), *args, **kwargs)
    (std,) = seen
    return std


@pytest.mark.parametrize("name", list(SHAPES))
def test_fans_are_torchs(name):
    shape = SHAPES[name]
    assert init._calculate_fan_in_and_fan_out(_param(shape)) == \
        torch.nn.init._calculate_fan_in_and_fan_out(torch.empty(shape))
    for mode in ("fan_in", "fan_out"):
        assert init._calculate_correct_fan(_param(shape), mode) == \
            torch.nn.init._calculate_correct_fan(torch.empty(shape), mode)


def test_fans_of_the_layers_weights():
    assert init._calculate_fan_in_and_fan_out(nn.Linear(20, 30).weight) == (20, 30)
    # Conv2d(6 -> 12, groups 3, kernel 3x5): weight [12, 2, 3, 5]
    assert init._calculate_fan_in_and_fan_out(nn.Conv2d(6, 12, (3, 5), groups=3).weight) == (2 * 15, 12 * 15)
    assert init._calculate_fan_in_and_fan_out(nn.Conv1d(4, 8, 5).weight) == (20, 40)
    with pytest.raises(ValueError, match="fewer than 2 dimensions"):
        init.xavier_uniform_(_param((5,)))
    with pytest.raises(ValueError, match="Mode 'fan_avg' not supported"):
        init.kaiming_normal_(_param((3, 4)), mode="fan_avg")


@pytest.mark.parametrize("nonlinearity, param", [("linear", None), ("conv2d", None), ("sigmoid", None),
                                                 ("tanh", None), ("relu", None), ("leaky_relu", None),
                                                 ("leaky_relu", 0.2), ("leaky_relu", math.sqrt(5)),
                                                 ("selu", None)])
def test_calculate_gain_is_torchs(nonlinearity, param):
    assert init.calculate_gain(nonlinearity, param) == torch.nn.init.calculate_gain(nonlinearity, param)


def test_calculate_gain_refuses_what_torch_refuses():
    with pytest.raises(ValueError, match="Unsupported nonlinearity gelu"):
        init.calculate_gain("gelu")
    with pytest.raises(ValueError, match="not a valid number"):
        init.calculate_gain("leaky_relu", "0.1")


UNIFORMS = [
    ("xavier_uniform_", (), {}), ("xavier_uniform_", (), {"gain": 5 / 3}),
    ("kaiming_uniform_", (), {}), ("kaiming_uniform_", (), {"a": math.sqrt(5)}),
    ("kaiming_uniform_", (), {"mode": "fan_out", "nonlinearity": "relu"}),
    ("kaiming_uniform_", (0.2,), {"nonlinearity": "leaky_relu"}),
    ("uniform_", (-0.3, 0.7), {}),
]


@pytest.mark.parametrize("shape", [SHAPES["linear"], SHAPES["conv2d"]])
@pytest.mark.parametrize("name, args, kwargs", UNIFORMS)
def test_uniform_bounds_are_torchs_exactly(name, args, kwargs, shape):
    theirs = _torch_bounds(getattr(torch.nn.init, name), shape, *args, **kwargs)
    assert _our_bounds(name, shape, *args, **kwargs) == theirs
    big = _param((400, *shape[1:]))
    getattr(init, name)(big, *args, **kwargs)
    values = _value(big)
    low, high = _torch_bounds(getattr(torch.nn.init, name), big.shape, *args, **kwargs)
    assert values.min() >= low and values.max() <= high
    span = high - low
    assert values.min() < low + 0.01 * span and values.max() > high - 0.01 * span  # the whole range
    assert abs(values.std() - span / math.sqrt(12)) < 0.02 * span


NORMALS = [("xavier_normal_", (), {}), ("xavier_normal_", (), {"gain": 2.0}), ("kaiming_normal_", (), {}),
           ("kaiming_normal_", (), {"mode": "fan_out", "nonlinearity": "relu"}), ("normal_", (0.5, 0.02), {})]


@pytest.mark.parametrize("name, args, kwargs", NORMALS)
def test_normal_statistics_are_torchs(name, args, kwargs):
    shape = (200, 30, 3, 3)
    std = _torch_std(getattr(torch.nn.init, name), shape, *args, **kwargs)
    p = getattr(init, name)(_param(shape), *args, **kwargs)
    values = _value(p)
    mean = args[0] if name == "normal_" else 0.0
    n = values.size
    assert abs(values.mean() - mean) < 5 * std / math.sqrt(n)
    assert abs(values.std() / std - 1) < 5 / math.sqrt(2 * n)


@pytest.mark.parametrize("mean, std, a, b", [(0.0, 1.0, -2.0, 2.0), (0.0, 0.02, -0.04, 0.04),
                                             (1.0, 2.0, 0.0, 10.0), (0.0, 1.0, 2.0, 3.0)])
def test_trunc_normal_is_torchs_distribution(mean, std, a, b):
    n = 50_000
    ours = _value(init.trunc_normal_(_param((n,)), mean, std, a, b))
    torch.manual_seed(0)
    theirs = torch.nn.init.trunc_normal_(torch.empty(n, dtype=torch.float64), mean, std, a, b).numpy()
    assert ours.min() >= a and ours.max() <= b
    scale = theirs.std()
    assert abs(ours.mean() - theirs.mean()) < 6 * scale / math.sqrt(n)
    assert abs(ours.std() / scale - 1) < 6 / math.sqrt(n)


def test_constant_ones_zeros_and_the_float32_cast():
    p = _param((3, 4), dtype="float32")
    assert init.constant_(p, 0.1) is p
    np.testing.assert_array_equal(_value(p), np.full((3, 4), 0.1, np.float32))
    init.ones_(p)
    assert (_value(p) == 1).all() and _value(p).dtype == np.float32
    init.zeros_(p)
    assert not _value(p).any()
    counter = nn.BatchNorm1d(3).num_batches_tracked  # an int64 buffer: constants only
    init.constant_(counter, 7)
    assert _value(counter) == 7
    with pytest.raises(TypeError, match="random values need a float tensor"):
        init.normal_(counter)


def test_the_same_seed_gives_the_same_values():
    def draw():
        a, b = _param((20, 10)), _param((5, 6, 3))
        init.kaiming_uniform_(a, a=math.sqrt(5))
        init.trunc_normal_(b, std=0.02)
        return _value(a), _value(b)

    sg.manual_seed(3)
    first = draw()
    sg.manual_seed(3)
    second = draw()
    sg.manual_seed(4)
    third = draw()
    for x, y, z in zip(first, second, third):
        np.testing.assert_array_equal(x, y)
        assert not np.array_equal(x, z)
    mine = [_value(init.normal_(_param((4,)), generator=np.random.default_rng(9))) for _ in range(2)]
    np.testing.assert_array_equal(*mine)


def test_init_sets_the_value_everything_built_from_the_model_sees():
    sg.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2)).double()
    x = sg.input("x", (sg.Dim("B"), 3), "float64")
    y = sg.input("y", (sg.Dim("B"),), "int64")
    f = sg.function([x], model(x), backend="numpy")
    step = sg.train_step(sg.cross_entropy(model(x), y), model.parameters(), sg.optim.SGD(lr=0.1), backend="numpy")
    xb, yb = np.ones((4, 3)), np.zeros(4, np.int64)
    step(x=xb, y=yb)  # trained: the value is the trained one now
    init.constant_(model[0].weight, 0.5)
    init.zeros_(model[0].bias)
    np.testing.assert_array_equal(step.params["0.weight"], np.full((2, 3), 0.5))
    np.testing.assert_array_equal(model.state_dict()["0.weight"], np.full((2, 3), 0.5))
    np.testing.assert_allclose(f(xb), np.full((4, 2), 1.5))
    before = step.params["0.weight"]
    step(x=xb, y=yb)  # the step trains from the value init set
    torch_model = torch.nn.Linear(3, 2).double()
    torch.nn.init.constant_(torch_model.weight, 0.5)
    torch.nn.init.zeros_(torch_model.bias)
    torch_opt = torch.optim.SGD(torch_model.parameters(), lr=0.1)
    torch.nn.functional.cross_entropy(torch_model(torch.from_numpy(xb)), torch.from_numpy(yb)).backward()
    torch_opt.step()
    np.testing.assert_allclose(step.params["0.weight"], torch_model.weight.detach().numpy(), atol=1e-12)
    assert not np.array_equal(before, step.params["0.weight"])


def test_apply_visits_children_first_and_returns_self_as_torch():
    def tree(lib):
        return lib.Sequential(lib.Linear(2, 3), lib.Sequential(lib.Tanh(), lib.Linear(3, 3)), lib.ReLU())

    ours, theirs = [], []
    model = tree(nn)
    assert model.apply(lambda m: ours.append(type(m).__name__)) is model
    tree(torch.nn).apply(lambda m: theirs.append(type(m).__name__))
    assert ours == theirs
    with pytest.raises(TypeError, match="apply: expected a function"):
        model.apply(3)


def test_apply_with_nanogpts_init_weights():
    def init_weights(module):
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=0.02)

    sg.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 40), nn.Linear(40, 300), nn.Linear(300, 40, bias=False))
    model.apply(init_weights)
    state = model.state_dict()
    for name in ("0.weight", "1.weight", "2.weight"):
        assert abs(state[name].std() - 0.02) < 0.002, name
    assert not state["1.bias"].any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_draws_are_the_generators_own_in_the_targets_precision(dtype):
    """A float32 parameter (or array) gets the generator's float32 draws, a float64 one its float64
    draws, each scaled in that precision: rng.random's numbers of that dtype from the same seed, and
    for normal values float32 Box-Muller over them (init.standard_normal_float32) or
    rng.standard_normal in float64. float64 draws cast to float32 took twice the time for digits the
    cast drops; a float64 target's numbers are those of rng.normal and rng.uniform, as before."""
    name = np.dtype(dtype).name
    p = init.normal_(_param((50, 40), name), 0.5, 0.02, generator=np.random.default_rng(7))
    if dtype == np.float32:
        want = np.empty((50, 40), np.float32)
        init.standard_normal_float32(np.random.default_rng(7), want)
    else:
        want = np.random.default_rng(7).standard_normal((50, 40), dtype=dtype)
    want = want * dtype(0.02) + dtype(0.5)
    np.testing.assert_array_equal(_value(p), want)
    array = init.uniform_(np.empty((50, 40), dtype), -0.3, 0.7, generator=np.random.default_rng(8))
    np.testing.assert_array_equal(array, np.random.default_rng(8).random((50, 40), dtype=dtype) * dtype(1.0) + dtype(-0.3))
    if dtype == np.float64:
        np.testing.assert_array_equal(want, np.random.default_rng(7).normal(0.5, 0.02, (50, 40)))
    else:   # narrower floats (bfloat16) get float32 draws, rounded
        bf16 = init.normal_(_param((50, 40), "bfloat16"), 0.5, 0.02, generator=np.random.default_rng(7))
        np.testing.assert_array_equal(_value(bf16), want.astype(_value(bf16).dtype))


def test_float32_normal_draws_are_standard_normal():
    """Box-Muller's float32 values (init.standard_normal_float32) are N(0, 1): a million of them
    against the normal CDF (Kolmogorov-Smirnov: 0.0020 is the 0.1% critical value at this count),
    their tails beyond 3 sigma (0.27%) and their end at 5.77, where a float32 uniform's last step
    below 1 puts it. A block's odd end and a transposed (not C-ordered) target get values too."""
    values = np.empty(1_000_003, np.float32)
    init.standard_normal_float32(np.random.default_rng(3), values)
    x = np.sort(values.astype(np.float64))
    cdf = 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    n = x.size
    ks = max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))
    assert ks < 0.0020, ks
    assert abs(np.mean(np.abs(x) > 3) - 0.0027) < 0.0003
    assert np.abs(x).max() <= 5.78
    assert np.isfinite(values).all()
    transposed = np.zeros((30, 7), np.float32).T
    init.standard_normal_float32(np.random.default_rng(4), transposed)
    contiguous = np.zeros((7, 30), np.float32)
    init.standard_normal_float32(np.random.default_rng(4), contiguous)
    np.testing.assert_array_equal(transposed, contiguous)
    assert np.all(contiguous != 0)


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_drawing_makes_no_temporary_of_the_parameters_size():
    """normal_ and uniform_ draw straight into a parameter's storage (its cell's array), and a layer's
    default into the array the layer then hands sg.param, which keeps one copy: a temporary of a
    parameter's size costs as much to fault in as to draw (a GPT of 11M parameters took 0.3 s to
    build, with a float64 draw, its float32 cast and two more copies of every weight)."""
    p = _param((1000, 1000), "float32")   # 4 MB
    assert _peak_bytes(lambda: (init.normal_(p, std=0.02), init.uniform_(p, -1.0, 1.0))) < 0.1 * 4e6
    assert _peak_bytes(lambda: nn.Linear(1000, 1000)) < 2.5 * 4e6   # the filled array and the cell's copy


def test_layers_defaults_are_torchs_kaiming_uniform():
    sg.manual_seed(0)
    for layer, torch_layer in ((nn.Linear(50, 40), torch.nn.Linear(50, 40)),
                               (nn.Conv2d(6, 12, 3, groups=2), torch.nn.Conv2d(6, 12, 3, groups=2))):
        fan_in = torch.nn.init._calculate_fan_in_and_fan_out(torch_layer.weight)[0]
        bound = 1 / math.sqrt(fan_in)
        for name, values in layer.state_dict().items():
            assert np.abs(values).max() <= bound and np.abs(values).max() > 0.8 * bound, name
        assert _our_bounds(lambda w: init.kaiming_uniform_(w, a=math.sqrt(5)), tuple(torch_layer.weight.shape)) == \
            _torch_bounds(lambda w: torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5)), tuple(torch_layer.weight.shape))


def test_bad_targets_and_arguments_are_refused():
    x = sg.input("x", (3, 4))
    with pytest.raises(TypeError, match="expected an sg.param or a module's buffer"):
        init.normal_(x * 2)
    with pytest.raises(TypeError, match="expected an sg.param, a module's buffer or a NumPy array"):
        init.zeros_([1.0, 2.0])
    with pytest.raises(ValueError, match="std must be non-negative"):
        init.normal_(_param((2,)), std=-1.0)
    with pytest.raises(ValueError, match="expects a <= b"):
        init.uniform_(_param((2,)), 1.0, 0.0)
    with pytest.raises(ValueError, match="expects std > 0 and a < b"):
        init.trunc_normal_(_param((2,)), a=1.0, b=-1.0)
    with pytest.raises(TypeError, match="generator must be a numpy.random.Generator"):
        init.normal_(_param((2,)), generator=torch.Generator())
    with pytest.warns(UserWarning, match="zero-element"):
        init.kaiming_uniform_(_param((0, 3)))
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        init.ones_(frozen)


def test_numpy_arrays_are_filled_in_place():
    array = np.zeros((4, 5), np.float32)
    assert init.xavier_uniform_(array) is array
    assert 0 < np.abs(array).max() <= math.sqrt(6 / 9)
