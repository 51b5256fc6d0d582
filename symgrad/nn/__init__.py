"""`sg.nn`: modules and layer functions in PyTorch's shapes and names, building graph code."""

from . import functional
from .containers import ModuleDict, ModuleList, Sequential
from .layers import GELU, BatchNorm1d, Dropout, Embedding, Flatten, Identity, LayerNorm, Linear, ReLU, Sigmoid, Tanh
from .module import Module

__all__ = ["Module", "Linear", "ReLU", "Tanh", "Sigmoid", "GELU", "Identity", "Sequential", "ModuleList",
           "ModuleDict", "Dropout", "BatchNorm1d", "LayerNorm", "Flatten", "functional"]
