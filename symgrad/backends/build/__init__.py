"""Build: source becomes a loaded library (compilers, caches, the prebuilt runtime, the
importable module).
"""
