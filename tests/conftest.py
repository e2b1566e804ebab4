"""Fixtures shared by every test layer."""
from __future__ import annotations

import pytest

from tokenserve.runtime.ports import free_port


@pytest.fixture
def port() -> int:
    return free_port()
