"""Session-scoped gloo worlds: ``world2``, ``world3`` and ``world4`` fixtures (rebuilt if a test broke them)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from world import World  # noqa: E402

_worlds: dict[int, World] = {}


def _get(size: int) -> World:
    w = _worlds.get(size)
    if w is None or w.broken:
        if w is not None:
            w.close()
        w = _worlds[size] = World(size)
    return w


@pytest.fixture
def world2() -> World:
    return _get(2)


@pytest.fixture
def world3() -> World:
    return _get(3)


@pytest.fixture
def world4() -> World:
    return _get(4)


@pytest.fixture(scope="session", autouse=True)
def _close_worlds() -> Iterator[None]:
    yield
    for w in _worlds.values():
        w.close()
