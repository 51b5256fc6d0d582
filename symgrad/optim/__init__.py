"""Optimizers whose update rules are graph code, compiled into the training step, constructed as
torch's (`sg.optim.AdamW(model.parameters(), lr=...)`), and torch's lr schedulers (`lr_scheduler`)."""

from . import lr_scheduler
from .adam import Adam
from .adamw import AdamW
from .from_torch import from_torch
from .optimizer import Optimizer
from .sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "lr_scheduler", "from_torch"]
