"""One status enum: the runtime's header, the program and the exported library take their codes from Status."""

from __future__ import annotations

import re

from symgrad.backends.export import library
from symgrad.backends.render import languages
from symgrad.backends.build import runtime
from symgrad.backends.status import MEANINGS, Status


def test_every_code_is_defined_once_with_one_meaning():
    values = [int(s) for s in Status]
    assert len(values) == len(set(values)), "two statuses share a code"
    assert set(MEANINGS) == set(Status) and len(set(MEANINGS.values())) == len(MEANINGS)
    assert languages.C_BAD_LABEL is Status.BAD_LABEL


def test_the_runtime_header_codes_are_the_enums():
    """symgrad_runtime.h's SG_* status codes are Status's, by name and value."""
    line = next(t for t in runtime.header().splitlines() if "SG_OK" in t and t.startswith("enum"))
    codes = dict(re.findall(r"SG_([A-Z_]+) = (\d+)", line))
    assert codes and {name: int(v) for name, v in codes.items()} == {name: int(Status[name]) for name in codes}


def test_the_exported_librarys_codes_are_the_enums():
    """The exported library lists every Status under its own prefix, with the same value: a code the
    entry returns means the same through the library."""
    statuses = library.statuses("mlp")
    assert [(s["name"], s["value"]) for s in statuses] == [(f"MLP_{s.name}", int(s)) for s in Status]
    assert [s["text"] for s in statuses] == [MEANINGS[s] for s in Status]
