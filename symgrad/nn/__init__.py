"""`sg.nn`: modules and layer functions in PyTorch's shapes and names, building graph code."""

from . import functional
from .layers import BatchNorm1d, Dropout, Identity, Linear, ReLU, Sequential, Sigmoid, Tanh
from .module import Module

__all__ = ["Module", "Linear", "ReLU", "Tanh", "Sigmoid", "Identity", "Sequential", "Dropout", "BatchNorm1d",
           "functional"]
