"""Custom ops with a hand-written backward, as torch.autograd.Function.

    class MySquare(sg.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    y = MySquare.apply(x)

The forward runs once, as graph code, when `apply` is called; its result is
wrapped in a `custom` node whose VJP calls `backward` (graph code too, so it
can be differentiated again). Gradients never trace through the forward.
"""

from __future__ import annotations

from ..ir import shapes as S
from ..ir.registry import lookup
from ..ir.value import Value, make


class Context:
    """What forward leaves for backward: saved values and any attributes."""

    def __init__(self):
        self.saved: tuple = ()

    def save_for_backward(self, *values) -> None:
        """Keep values for the backward (read back as ctx.saved / ctx.saved_tensors)."""
        self.saved = tuple(values)

    @property
    def saved_tensors(self) -> tuple:
        return self.saved


class _Binding:
    """One application of a Function: its class, context and which arguments are values."""

    def __init__(self, function, ctx: Context, value_positions: list[int], n_args: int):
        self.function, self.ctx = function, ctx
        self.value_positions, self.n_args = value_positions, n_args

    @property
    def name(self) -> str:
        return self.function.__name__

    def vjp(self, node, g, wants):
        grads = self.function.backward(self.ctx, g)
        if not isinstance(grads, (tuple, list)):
            grads = (grads,)
        if len(grads) != self.n_args:
            raise TypeError(f"{self.name}.backward returned {len(grads)} gradient(s) for "
                            f"{self.n_args} forward input(s)")
        out = []
        for pos, want in zip(self.value_positions, wants):
            gi, xi = grads[pos], node.inputs[1 + len(out)]
            if gi is not None and not isinstance(gi, Value):
                raise TypeError(f"{self.name}.backward: gradient {pos} must be a graph value or None, "
                                f"got {type(gi).__name__}")
            if gi is not None:
                S.broadcast_shapes(gi.shape, xi.shape, op=f"{self.name}.backward")
            out.append(gi if want else None)
        return out


class Function:
    """Base class for an op with a user-written backward (torch.autograd.Function)."""

    @staticmethod
    def forward(ctx: Context, *args):
        raise NotImplementedError("a Function subclass defines forward(ctx, *inputs)")

    @staticmethod
    def backward(ctx: Context, *grads):
        raise NotImplementedError("a Function subclass defines backward(ctx, grad_output)")

    @classmethod
    def apply(cls, *args) -> Value:
        """Run forward as graph code and attach backward as its VJP."""
        ctx = Context()
        result = cls.forward(ctx, *args)
        if not isinstance(result, Value):
            raise TypeError(f"{cls.__name__}.forward must return a graph value, got {type(result).__name__}")
        positions = [k for k, a in enumerate(args) if isinstance(a, Value)]
        binding = _Binding(cls, ctx, positions, len(args))
        return make(lookup("custom"), (result, *(args[k] for k in positions)), function=binding)
