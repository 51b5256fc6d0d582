"""Stochastic gradient descent, with torch.optim.SGD's exact update."""

from __future__ import annotations

from ..api import functional as F
from ..ir.value import Value
from .optimizer import Optimizer


class SGD(Optimizer):
    """torch.optim.SGD(params, lr=1e-3, momentum, dampening, weight_decay, nesterov), as graph code.

    `params` as torch's (parameters, or parameter-group dicts), or left out and given to
    sg.train_step instead (`SGD(lr=0.1)`); see Optimizer.

        g = grad + weight_decay * p
        buf = g on the first step, else momentum * buf + (1 - dampening) * g
        g = g + momentum * buf if nesterov else buf      (when momentum != 0)
        p = p - lr * g
    """

    def __init__(self, params=None, lr: float | None = None, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False):
        super().__init__(params, lr, default_lr=1e-3)  # torch's default lr
        if momentum < 0 or weight_decay < 0:
            raise ValueError(f"SGD: momentum and weight_decay must be non-negative, got {momentum}, {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: nesterov needs momentum > 0 and dampening = 0 (as in torch)")
        self.momentum, self.dampening = momentum, dampening
        self.weight_decay, self.nesterov = weight_decay, nesterov
        self._init_groups()

    def update(self, param: Value, grad: Value) -> Value:
        g = grad
        if self.weight_decay:
            g = g + self.weight_decay * param
        if self.momentum:
            buf = self.state(param, "momentum_buffer")
            new_buf = self.momentum * buf + (1 - self.dampening) * g
            if self.dampening:
                # torch starts the buffer at g itself, not at (1 - dampening) * g.
                started = self.state(param, "momentum_started", 0.0, shape=(), dtype="bool")
                new_buf = F.where(started, new_buf, g)
                self.assign(started, F.constant(True))
            self.assign(buf, new_buf)
            g = g + self.momentum * new_buf if self.nesterov else new_buf
        return param - self.hyper("lr", self.lr, param) * g
