"""Shared fixtures: the backends every op/gradient test runs on."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import symgrad as sg  # noqa: F401
from symgrad.backends.native import Building
from symgrad.backends.render import program as rendered_program

# Every program a test renders renders each kernel, not only the first of each sharing key, and
# checks that kernels with one key have one source (symgrad.backends.render.kernel_functions).
rendered_program.VERIFY_SHARING = True


def available_backends() -> list[str]:
    """numpy always; c when its backend module exists (a missing gcc fails loudly, not silently);
    cuda when an NVIDIA GPU is present (asked in a child process, so that CUDA is not initialised
    in this one before pytest or a test forks)."""
    names = ["numpy"]
    try:
        import symgrad.backends.c  # noqa: F401
        names.append("c")
    except ImportError:
        pass
    from symgrad.backends import cuda
    if cuda.probe_device_count()[0] > 0:
        names.append("cuda")
    return names


BACKENDS = available_backends()

# Test modules import graphs from each other by name (`from test_passes import GRAPHS`), which
# pytest makes importable only once it has collected the other file: every test folder is on the
# path (after pytest's own entries), so one file runs alone as it does in the whole suite.
sys.path.extend(str(folder) for folder in sorted(Path(__file__).parent.rglob("*"))
                if folder.is_dir() and folder.name != "__pycache__" and str(folder) not in sys.path)

# Under pytest-xdist each worker keeps its own cache below a SYMGRAD_CACHE_DIR given from outside
# (CI's): tests that clear or count the cache's entries (tests/backends/test_program_cache.py) must
# see their own worker's, not the other's. Set at import, before any test module compiles.
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("SYMGRAD_CACHE_DIR"):
    os.environ["SYMGRAD_CACHE_DIR"] = os.path.join(os.environ["SYMGRAD_CACHE_DIR"],
                                                   os.environ["PYTEST_XDIST_WORKER"])


@pytest.fixture(autouse=True)
def _builds_ended():
    """Each test's background builds end with it: a train step's predict build waits for the step's
    first call (symgrad.backends.native.Building's `held`), and one whose step was never called
    would start its compilers during a later test (inside its monkeypatched build, its cache count)."""
    yield
    Building.release_all(wait=True)


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Parametrizes a test over every backend this machine can run."""
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
