"""Shared fixtures of the engine unit tests."""
from __future__ import annotations

import pytest

from services.engine import cpu_kernels


@pytest.fixture(scope="session")
def lib():
    """The AVX2 kernel library; tests that need it skip where it cannot be built."""
    lib = cpu_kernels.load()
    if lib is None:
        pytest.skip("no AVX2/FMA/F16C or no compiler here: torch ops are used instead")
    return lib
