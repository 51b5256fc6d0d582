"""`sg.nn`: modules and layer functions in PyTorch's shapes and names, building graph code."""

from . import functional, init
from .convolutional import AdaptiveAvgPool2d, AvgPool2d, Conv1d, Conv2d, MaxPool2d
from .containers import ModuleDict, ModuleList, Sequential
from .layers import GELU, BatchNorm1d, BatchNorm2d, Dropout, SyncBatchNorm, Embedding, Flatten, Identity, LayerNorm, Linear, ReLU, Sigmoid, Tanh
from .module import Module

__all__ = ["Module", "Linear", "ReLU", "Tanh", "Sigmoid", "GELU", "Identity", "Sequential", "ModuleList",
           "ModuleDict", "Dropout", "BatchNorm1d", "BatchNorm2d", "SyncBatchNorm", "LayerNorm", "Flatten", "Embedding", "Conv1d", "Conv2d",
           "MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d", "functional", "init"]
