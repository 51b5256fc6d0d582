"""The convolutional layers in torch's names, parameters and default initialisation:
Conv1d, Conv2d, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d."""

from __future__ import annotations

import numbers

from ..api import convolution, pooling
from ..ir.value import Value
from ..api.sources import param
from .layers import _default_weight_and_bias, _initial
from .module import Module


class _ConvNd(Module):
    """Weight (out, in/groups, *kernel) and bias (out,), both U(-1/sqrt(fan_in), 1/sqrt(fan_in)) as
    torch's kaiming_uniform(a=sqrt(5)) default."""

    dims = 2

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, init=None, dtype: str = "float32"):
        super().__init__()
        name = type(self).__name__
        kernel = (kernel_size,) * self.dims if isinstance(kernel_size, numbers.Integral) else tuple(kernel_size)
        for what, n in (("in_channels", in_channels), ("out_channels", out_channels), ("groups", groups)):
            if not isinstance(n, numbers.Integral) or n < 1:
                raise ValueError(f"{name}: {what} must be a positive int, got {n!r}")
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"{name}: in_channels {in_channels} and out_channels {out_channels} must be "
                             f"multiples of groups {groups}")
        if len(kernel) != self.dims or any(not isinstance(k, numbers.Integral) or k < 1 for k in kernel):
            raise ValueError(f"{name}: kernel_size must be a positive int or {self.dims} of them, got {kernel_size!r}")
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, kernel
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        shape = (out_channels, in_channels // groups, *kernel)
        weight_init, bias_init = _default_weight_and_bias(shape)
        self.weight = param("weight", shape, init=_initial(init, shape, dtype, weight_init), dtype=dtype)
        self.bias = param("bias", (out_channels,), init=_initial(init, (out_channels,), dtype, bias_init),
                          dtype=dtype) if bias else None

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, bias={self.bias is not None}")


class Conv2d(_ConvNd):
    """torch.nn.Conv2d over (N, C, H, W)."""

    def forward(self, x: Value) -> Value:
        return convolution.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class Conv1d(_ConvNd):
    """torch.nn.Conv1d over (N, C, L)."""

    dims = 1

    def forward(self, x: Value) -> Value:
        return convolution.conv1d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class MaxPool2d(Module):
    """torch.nn.MaxPool2d."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False):
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.dilation, self.ceil_mode = dilation, ceil_mode

    def forward(self, x: Value) -> Value:
        return pooling.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AvgPool2d(Module):
    """torch.nn.AvgPool2d."""

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True,
                 divisor_override=None):
        super().__init__()
        self.kernel_size, self.stride, self.padding, self.ceil_mode = kernel_size, stride, padding, ceil_mode
        self.count_include_pad, self.divisor_override = count_include_pad, divisor_override

    def forward(self, x: Value) -> Value:
        return pooling.avg_pool2d(x, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                                  self.count_include_pad, self.divisor_override)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AdaptiveAvgPool2d(Module):
    """torch.nn.AdaptiveAvgPool2d."""

    def __init__(self, output_size):
        super().__init__()
        self.output_size = output_size

    def forward(self, x: Value) -> Value:
        return pooling.adaptive_avg_pool2d(x, self.output_size)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"
