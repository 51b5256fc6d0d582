"""Gradient clipping by global norm, inside the compiled step (torch.nn.utils.clip_grad_norm_)."""

from __future__ import annotations

import numpy as np

from ..api import functional as F
from ..ir.value import Value
from ..api.sources import variable
from .optimizer import check_hyperparameter

#: The name of the runtime variable holding max_norm (`step.state[MAX_NORM] = 0.5` changes it).
MAX_NORM = "clip_grad_norm"


def max_norm_variable(max_norm: float) -> Value:
    """The runtime hyperparameter holding max_norm: checked as a learning rate is (finite, >= 0)."""
    check_hyperparameter("train_step: clip_grad_norm", max_norm)
    return variable(MAX_NORM, np.array(max_norm, dtype=np.float64), role="hyper")


def clip_grad_norm(grads: list[Value], max_norm: Value) -> list[Value]:
    """The gradients scaled by min(1, max_norm / (total_norm + 1e-6)), total_norm the 2-norm of all
    of them together, as torch's clip_grad_norm_ computes it (per-gradient norms, then the norm of
    those). A non-finite total norm gives non-finite gradients, as in torch (error_if_nonfinite=False)."""
    norms = [F.sqrt(F.sum(g * g)) for g in grads]
    total = F.sqrt(sum((n * n for n in norms[1:]), norms[0] * norms[0]))
    coefficient = F.minimum(F.cast(max_norm, total.dtype) / (total + 1e-6), 1.0)
    return [g * F.cast(coefficient, g.dtype) for g in grads]
