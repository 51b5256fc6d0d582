"""Lower: a decided graph becomes a kernel plan (buffers, views, kernels, the arena), through
the kinds' lowerings.
"""
