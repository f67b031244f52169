"""Shared fixtures: real ZooKeeper and real bookie processes on 127.0.0.1.

`cluster5` is one session-wide cluster (5 bookies x 2 shards, io_uring journal) for
tests that do not break it; tests that kill or corrupt bookies build their own
with `make_cluster` and it is stopped (by pid) when the test ends.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import uvloop

from bookkeeper.testing.cluster import LocalCluster

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on a fresh uvloop event loop (the client's production loop)."""
    return uvloop.run(coro)


@pytest.fixture(scope="session")
def cluster5(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("cluster5"), bookies=5, shards=2, journal_sync="io_uring")
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    """Factory for a private cluster; everything it started is stopped after the test."""
    made: list[LocalCluster] = []

    def make(**kwargs: Any) -> LocalCluster:
        c = LocalCluster(tmp_path / f"cluster{len(made)}", **kwargs)
        made.append(c)
        return c.start()

    yield make
    for c in made:
        c.stop()


@pytest.fixture
def arun() -> Callable[[Coroutine[Any, Any, T]], T]:
    return run


__all__ = ["asyncio", "run"]
