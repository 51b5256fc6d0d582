"""The one place that knows where templates/ lives, and the jinja2 Environment.

In a wheel the templates ship as symgrad/templates/; in a source checkout
(and an editable install) they are templates/ at the repository root.
One Environment with StrictUndefined serves every backend, so a missing
variable in a template is an error, never an empty string.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import jinja2

_PACKAGE = Path(__file__).resolve().parents[2]  # symgrad/ (this is symgrad/backends/render/templates.py)


def template_dir() -> Path:
    """The directory holding c/ and cuda/ templates."""
    for candidate in (_PACKAGE / "templates", _PACKAGE.parent / "templates"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"symgrad's templates are missing: looked in {_PACKAGE / 'templates'} "
                            f"and {_PACKAGE.parent / 'templates'}; reinstall symgrad")


class _BytecodeCache(jinja2.FileSystemBytecodeCache):
    """Compiled templates, kept as Python keeps a module's bytecode: compiling a program's
    templates costs a fresh process 0.1-0.2 s (a quarter of a new model's cold compile).

    Entries are checked against the template source's checksum by jinja2; a cache that
    cannot be written (read-only, removed meanwhile) only means compiling again.
    """

    def dump_bytecode(self, bucket) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            super().dump_bytecode(bucket)
        except OSError:
            pass


def bytecode_dir() -> Path:
    """Where compiled templates are kept: templates/__pycache__ beside them, as .pyc files beside
    a package's modules (they belong to the installed symgrad, not to any model, and outlive a
    cleared build cache), or the build cache's templates/ when the install is read-only."""
    from ...settings import cache_dir
    here = template_dir() / "__pycache__"
    writable = os.access(here, os.W_OK) if here.is_dir() else os.access(template_dir(), os.W_OK)
    return here if writable else cache_dir() / "templates"


@lru_cache(maxsize=None)
def environment() -> jinja2.Environment:
    """The shared jinja2 Environment (StrictUndefined, no autoescape: the output is C)."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        bytecode_cache=_BytecodeCache(str(bytecode_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def render(name: str, **context) -> str:
    """Render templates/<name>; a template error names the template and line."""
    try:
        return environment().get_template(name).render(**context)
    except jinja2.TemplateError as exc:
        where = f"{getattr(exc, 'filename', None) or name}:{getattr(exc, 'lineno', '?')}"
        raise RuntimeError(f"template {where}: {exc}") from exc
