"""The narrow-product limit: the output columns at or below which a product runs the runtime's narrow kernels.

One home for a number that three stages read: the GEMM table (backends.decide.gemm_table, which
picks its narrow-N GEMM kernels), the graph API's convolution (which factors a few output channels
over short patches as per-image products rather than one product whose every output is a short dot
product) and the col2im pass (which leaves narrow products alone). A leaf module, so the API and the
passes read it without importing the back end.
"""

from __future__ import annotations

# 16 columns fill the blocked GEMM's micro-kernel sliver of two float vectors (AVX-512) or four (AVX2):
# fewer, and its tile computes mostly padding; the narrow kernels take such products as dot products.
NARROW_N = 16
