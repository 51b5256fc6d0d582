"""Render: a kernel plan becomes C or CUDA source, through templates/ and a language's row.
"""
