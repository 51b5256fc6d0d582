"""The narrow-product limit has one home (symgrad.narrow_limit): the API, the col2im pass and the runtime read it."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from symgrad import narrow_limit as narrow  # (sg.narrow is torch's narrow)
from symgrad.backends.build import runtime
from symgrad.passes import col2im

PACKAGE = Path(__file__).resolve().parents[2] / "symgrad"


def test_the_limit_is_defined_once_and_read_by_all_three():
    convolution = importlib.import_module("symgrad.api.convolution")  # sg.convolution is a function
    assert runtime.NARROW_N is narrow.NARROW_N and convolution.NARROW_N is narrow.NARROW_N
    assert col2im.NARROW_N is narrow.NARROW_N
    copies = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
              if re.search(r"^NARROW(_N|_CHANNELS)?\s*=\s*\d", p.read_text(), re.M)]
    assert copies == ["narrow_limit.py"], f"a copy of the narrow limit: {copies}"
