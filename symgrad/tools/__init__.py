"""The applications, users of the public API: the command line, the demos, inspect, export,
data parallelism, gradcheck and the import of torch models.
"""
