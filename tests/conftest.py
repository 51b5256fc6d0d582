"""Shared fixtures: the backends every op/gradient test runs on."""

import os

import numpy as np
import pytest

import symgrad as sg  # noqa: F401


def available_backends() -> list[str]:
    """numpy always; c when its backend module exists (a missing gcc fails loudly, not silently)."""
    names = ["numpy"]
    try:
        import symgrad.backends.c  # noqa: F401
        names.append("c")
    except ImportError:
        pass
    return names


BACKENDS = available_backends()


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Parametrizes a test over every backend built so far."""
    return request.param


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Compiled modules go to one cache per test session unless CI chose one."""
    if "SYMGRAD_CACHE_DIR" not in os.environ:
        os.environ["SYMGRAD_CACHE_DIR"] = str(tmp_path_factory.mktemp("symgrad-cache"))
    yield
