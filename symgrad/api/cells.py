"""The one owner of a parameter's value: a `Cell` that its variable carries.

Every `sg.param` and every module buffer is a variable whose attributes hold a
`Cell` (`attrs["cell"]`): one host array with the parameter's current value.
The module, every train step, its accumulate / apply / predict programs and
every `sg.function` built from the model read and write that one array, so
they agree whenever each was built: training updates it, `load_state_dict`,
`step.load` and `step.params[name] = ...` set it, `state_dict()` reads it.
(The variable keeps no initial value beside it: that would be a second copy of every parameter.)

The NumPy and C backends run on the cell's array itself (the C code writes
it through a pointer), so nothing is copied or synchronised. A backend that
keeps variables in memory of its own (CUDA: device memory) works on a copy;
the cell then records which compiled object holds a value newer than its
array (`holder`), and counts changes (`version`) so that each such object
knows when its copy is stale. symgrad.step.compiled moves values across before
and after each call; a read from anywhere (`read`) asks the holder.

Variables of the other roles (optimizer state, the learning rate, random
counters, gradient buffers) belong to the step that made them and have no
cell.
"""

from __future__ import annotations

import contextlib
import weakref

import numpy as np

# The roles whose variables carry a cell: a module's parameters and buffers (sources.ROLES).
SHARED_ROLES = ("param", "state")


class Cell:
    """The current value of one parameter or buffer, shared by everything built from it.

    `array` is the host value (never replaced: compiled C code keeps a pointer to it). Where a
    compiled object holding its own copy has a newer value, `holder` names it, as (weak
    reference to the compiled object, the variable's name there, that object's storage dict:
    where its program leaves the value when it is freed). `version` counts changes, for the
    holders' copies. `lock` is the lock of the compiled objects that share the cell, once one
    is built: reads and writes take turns with their calls.
    """

    __slots__ = ("array", "version", "holder", "lock")

    def __init__(self, value: np.ndarray):
        self.array = np.array(value, copy=True, order="C")
        self.version = 0
        self.holder = None
        self.lock = None

    def __repr__(self) -> str:
        return f"<Cell {self.array.dtype}{list(self.array.shape)}>"

    def __reduce__(self):
        # A copy would be a second owner of the value: refused (the program cache then stores
        # nothing for a graph that would pickle one, and compiles it afresh).
        raise TypeError("a parameter's cell cannot be pickled or copied: it is the one owner of the value")

    def _guard(self):
        return self.lock if self.lock is not None else contextlib.nullcontext()

    def read(self) -> np.ndarray:
        """A copy of the current value (from the compiled object that holds a newer one, if any)."""
        with self._guard():
            holder = self.holder
            if holder is None:
                return self.array.copy()
            owner = holder[0]()
            if owner is None:  # freed: its program left the value in its storage
                return np.array(holder[2][holder[1]], copy=True)
            return owner._read_native(holder[1])

    def write(self, value: np.ndarray) -> None:
        """Set the current value (an array of the cell's shape, cast to its dtype by the caller):
        every copy elsewhere is stale from now on."""
        with self._guard():
            self.array[...] = value
            self.holder = None
            self.version += 1

    def fill(self, fill) -> None:
        """Set the current value by `fill(array)`, which writes the cell's own array in place (nn.init
        draws random numbers straight into it: a temporary of the parameter's size costs as much to
        fault in as to draw): every copy elsewhere is stale from now on."""
        with self._guard():
            fill(self.array)
            self.holder = None
            self.version += 1

    def flush(self) -> None:
        """Bring a holder's newer value into `array`, which is current again afterwards."""
        with self._guard():
            if self.holder is not None:
                self.array[...] = self.read()
                self.holder = None

    def held_by(self, compiled, name: str) -> None:
        """`compiled` (whose program keeps its own copy, as variable `name`) has just changed the
        value: it holds the newest one."""
        self.version += 1
        self.holder = (weakref.ref(compiled), name, compiled._storage)


def cell_of(variable) -> Cell | None:
    """The cell of a variable (None for roles without one, and for values that are not variables)."""
    if variable.op.name != "variable":
        return None
    return variable.attrs.get("cell")


def current_value(variable) -> np.ndarray:
    """A copy of a variable's value now: its cell's for a parameter or buffer, else its initial value."""
    cell = cell_of(variable)
    return cell.read() if cell is not None else np.array(variable.attrs["init"], copy=True)
