"""Decide: every choice the back end makes about a graph, once, as printable data (`Decisions`).
"""
