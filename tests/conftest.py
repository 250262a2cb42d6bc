"""Shared fixtures: one pool of gloo workers per world size, reused by every test that asks for it."""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Self-check verdicts (admission by proof) go to a fresh cache: never the user's, never shared by runs.
os.environ["NEREUS_FAMILY_CACHE"] = tempfile.mkdtemp(prefix="nereus-families-")
os.environ.setdefault("MPLBACKEND", "Agg")

_POOLS: dict[int, object] = {}


def _pool(world_size: int):
    from nereus_lightning.testing import WorkerPool

    if world_size not in _POOLS:
        _POOLS[world_size] = WorkerPool(world_size)
    return _POOLS[world_size]


@pytest.fixture(scope="session")
def dist4():
    """Four gloo ranks (one process group) shared by the whole session."""
    return _pool(4)


@pytest.fixture(scope="session")
def dist8():
    """Eight gloo ranks shared by the whole session."""
    return _pool(8)


def pytest_sessionfinish(session, exitstatus):
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
