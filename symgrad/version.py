"""symgrad's version: a leaf every stage may read (build keys, the generated code's header,
`symgrad --version`) without importing the package's public API, which imports them all."""

__version__ = "0.1.0"
