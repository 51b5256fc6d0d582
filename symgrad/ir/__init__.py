"""The IR: values, ops, graphs, dtypes, symbolic shapes, and their printing."""

from . import ops as _ops  # noqa: F401  (registers the primitive ops)
from . import ops_indexing as _ops_indexing  # noqa: F401  (slice, embed, take, scatter_add)
from . import ops_attention as _ops_attention  # noqa: F401  (attention, attention_grad)
from . import ops_collective as _ops_collective  # noqa: F401  (all_reduce)
from . import ops_integer as _ops_integer  # noqa: F401  (floor_divide, remainder, fmod, bitwise ops)
from .graph import Graph, toposort
from .registry import REGISTRY, OpDef, lookup
from .shapes import Dim
from .value import Value

__all__ = ["Graph", "toposort", "REGISTRY", "OpDef", "lookup", "Dim", "Value"]
