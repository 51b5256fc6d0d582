"""Adam, with torch.optim.Adam's exact update (amsgrad=False, L2 weight decay)."""

from __future__ import annotations

import sympy

from ..api import functional as F
from ..ir.value import Value
from .optimizer import Optimizer, formula


class Adam(Optimizer):
    """torch.optim.Adam(params, lr=1e-3, betas, eps, weight_decay), as graph code (`params` as
    torch's, or left out and given to sg.train_step; see Optimizer).

        t = t + 1                                   (per parameter: `<p>.step`)
        g = grad + weight_decay * p
        m = m + (1 - beta1) * (g - m)               (`<p>.exp_avg`; torch's lerp)
        v = beta2 * v + (1 - beta2) * g * g         (`<p>.exp_avg_sq`)
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    The step count and bias corrections are float64 scalars, as torch
    computes them in Python floats; the learning rate is a runtime
    hyperparameter (`step.lr = ...`). t, m, v, each bias correction and
    p's update are one elementwise node each (optimizer.formula), their
    operations in torch's order: float32 and float64 parameters round each
    operation, as torch does; for a 16-bit parameter each node computes in
    float32 and rounds once (as torch's lerp does; its other in-place steps
    round after each).
    """

    def __init__(self, params=None, lr: float | None = None, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        super().__init__(params, lr, default_lr=1e-3)
        beta1, beta2 = betas
        if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
            raise ValueError(f"Adam: betas must be in [0, 1), got {betas}")
        if eps < 0 or weight_decay < 0:
            raise ValueError(f"Adam: eps and weight_decay must be non-negative, got {eps}, {weight_decay}")
        self.betas, self.eps, self.weight_decay = (float(beta1), float(beta2)), float(eps), float(weight_decay)
        self._init_groups()

    def l2_gradient(self, param: Value, grad: Value) -> Value:
        """The gradient with Adam's L2 weight decay added (AdamW decays the parameter instead)."""
        return grad + self.weight_decay * param if self.weight_decay else grad

    def decayed(self, param: Value, lr: Value) -> Value:
        """The parameter that the step moves: itself (AdamW decays it first)."""
        return param

    def update(self, param: Value, grad: Value) -> Value:
        beta1, beta2 = self.betas
        g = self.l2_gradient(param, grad)
        t = self.state(param, "step", shape=(), dtype="float64")
        m = self.state(param, "exp_avg")
        v = self.state(param, "exp_avg_sq")
        t_new = formula("adam_step", lambda t: t + 1, t)
        # Each moment one node, its operations in torch's order. lerp's weight 1 - beta1 is an operand:
        # a number in the expression, sympy would distribute it over g - m and join the m terms
        # (0.1 g + 0.9 m), rounding otherwise than torch's m + w (g - m).
        weight1 = self.constant(1.0 - beta1, m.dtype)
        m_new = formula("adam_exp_avg", lambda m, g, w: m + w * (g - m), m, g, weight1)
        rest = 1.0 - beta2
        v_new = formula("adam_exp_avg_sq", lambda v, g: beta2 * v + rest * (g * g), v, g)
        self.assign(t, t_new)
        self.assign(m, m_new)
        self.assign(v, v_new)
        lr = self.hyper("lr", self.lr, t_new)
        step_size = F.cast(formula("adam_step_size", lambda lr, t: lr / (1 - beta1 ** t), lr, t_new), param.dtype)
        correction2 = F.cast(formula("adam_correction", lambda t: sympy.sqrt(1 - beta2 ** t), t_new), param.dtype)
        eps = self.eps
        return formula("adam_param", lambda p, s, m, v, c: p - s * m / (sympy.sqrt(v) / c + eps),
                       self.decayed(param, lr), step_size, m_new, v_new, correction2)
