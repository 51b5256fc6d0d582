"""The graph-building API: the functions a user calls on graph values, in torch's names and meanings.
"""
