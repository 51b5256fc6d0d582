"""The seeds' softmax regression in the form `symgrad inspect` reads.

    symgrad inspect examples/inspect_softmax.py --out /tmp/softmax
"""

import symgrad as sg


def build():
    """The model: loss and the parameters to train (SGD lr 0.1 by default)."""
    B = sg.Dim("B")
    x = sg.input("x", (B, 784))
    y = sg.input("y", (B,), dtype="int64")
    W = sg.param("W", (784, 10), init="zeros")
    b = sg.param("b", (10,), init="zeros")
    return sg.cross_entropy(x @ W + b, y), [W, b]
