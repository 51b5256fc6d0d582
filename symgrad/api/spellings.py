"""torch's and NumPy's spellings of an op's axes: `dim=` / `keepdim=` beside `axis=` / `keepdims=`.

symgrad's functions were written with NumPy's names; torch users write torch's. `torch_dims`
wraps a function whose parameters are `axis` (and `keepdims`) so that it also takes `dim=` (and
`keepdim=`), with the same meaning. Giving both spellings of one argument is a TypeError naming
the op, rather than one silently winning.
"""

from __future__ import annotations

import functools
import inspect

__all__ = ["torch_dims", "one_of"]

# torch's name -> NumPy's name, for the arguments both libraries have.
_SPELLINGS = (("dim", "axis"), ("keepdim", "keepdims"))


def one_of(op: str, torch_name: str, torch_value, numpy_name: str, numpy_value, unset=None):
    """The value given under either name (`unset` where neither was): refuses both at once."""
    if torch_value is not unset and numpy_value is not unset:
        raise TypeError(f"{op}: got both {torch_name}= and {numpy_name}= (torch's and NumPy's names of "
                        f"one argument); give one")
    return numpy_value if torch_value is unset else torch_value


def torch_dims(fn):
    """`fn` (parameters `axis`, maybe `keepdims`) also taking torch's `dim=` and `keepdim=`.

    The translation runs only when a torch keyword is given, so graph code that calls `fn` with
    NumPy's names pays one dict lookup per name. A positional axis counts as given: `sum(x, 1,
    dim=0)` is refused like `sum(x, axis=1, dim=0)`.
    """
    signature = inspect.signature(fn)
    spellings = [(t, n) for t, n in _SPELLINGS if n in signature.parameters]
    op = fn.__name__

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        torch_given = {t: (n, kwargs.pop(t)) for t, n in spellings if t in kwargs}
        if torch_given:
            try:
                given = signature.bind_partial(*args, **kwargs).arguments
            except TypeError as exc:
                raise TypeError(f"{op}: {exc}") from None
            for torch_name, (numpy_name, value) in torch_given.items():
                if numpy_name in given:
                    raise TypeError(f"{op}: got both {torch_name}= and {numpy_name} (torch's and NumPy's "
                                    f"names of one argument); give one")
                kwargs[numpy_name] = value
        return fn(*args, **kwargs)

    # help() and inspect show both spellings: torch's as keyword-only parameters.
    extra = [inspect.Parameter(t, inspect.Parameter.KEYWORD_ONLY, default=signature.parameters[n].default)
             for t, n in spellings]
    params = list(signature.parameters.values())
    at = next((k for k, p in enumerate(params) if p.kind == inspect.Parameter.VAR_KEYWORD), len(params))
    wrapper.__signature__ = signature.replace(parameters=params[:at] + extra + params[at:])
    return wrapper
