"""Graph -> Graph optimization passes, one module each, and the pipeline that runs them."""

from .cse import cse
from .dce import dce
from .fold import fold
from .masks import masks
from .pipeline import DEFAULT_PIPELINE, format_report, optimize
from .simplify import simplify
from .verify import VerifyError, verify

__all__ = ["cse", "dce", "fold", "masks", "simplify", "optimize", "DEFAULT_PIPELINE", "format_report",
           "verify", "VerifyError"]
