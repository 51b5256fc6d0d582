"""AdamW, with torch.optim.AdamW's exact update: Adam with decoupled weight decay."""

from __future__ import annotations

from ..api import functional as F
from ..ir.value import Value
from .adam import Adam
from .optimizer import formula


class AdamW(Adam):
    """torch.optim.AdamW(params, lr=1e-3, betas, eps, weight_decay=0.01), as graph code.

        p = p * (1 - lr * weight_decay)            (decoupled: not added to the gradient)
        then Adam's update of p, without L2 decay

    The decay factor is computed in float64 from the runtime learning rate,
    as torch computes it in Python floats, then applied in the parameter's dtype.
    """

    def __init__(self, params=None, lr: float | None = None, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, lr, betas, eps, weight_decay)

    def decayed(self, param: Value, lr: Value) -> Value:
        """The parameter after the decoupled decay, which Adam's step then moves."""
        if not self.weight_decay:
            return param
        decay = self.weight_decay
        return param * F.cast(formula("adamw_decay", lambda lr: 1 - lr * decay, lr), param.dtype)

    def l2_gradient(self, param: Value, grad: Value) -> Value:
        return grad  # the decay is decoupled
