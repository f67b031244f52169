"""Shared fixtures: real ZooKeeper and real bookie processes on 127.0.0.1.

`cluster5` is one session-wide cluster (5 bookies x 2 shards, io_uring journal) for
tests that do not break it; tests that kill or corrupt bookies build their own
with `make_cluster` and it is stopped (by pid) when the test ends.
"""
from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import uvloop

from bookkeeper.testing.cluster import LocalCluster

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]

# Every Spark driver JVM the tests start (the session fixture's, `bk bench spark`'s) compiles
# with C1 only: its C2 compiler spent ~35 CPU-seconds per JVM on queries over a few MB (test_spark
# alone: 96 -> 62 CPU-s, and faster), on a 2-core machine where the suite is CPU-bound. Spark's
# own launcher passes SPARK_SUBMIT_OPTS to the driver's JVM; a value set by the user is kept.
os.environ.setdefault("SPARK_SUBMIT_OPTS", "-XX:TieredStopAtLevel=1")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on a fresh uvloop event loop (the client's production loop)."""
    return uvloop.run(coro)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """On the controller (not in an xdist worker): remove the test hosts (network namespaces,
    their processes) of any run whose owner died, e.g. a worker killed by a timeout: a run
    leaves nothing on the machine. Only where such runs can exist (namespaces usable)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from bookkeeper.testing.hosts import cleanup_stale, namespaces_unavailable

    if namespaces_unavailable() is None:
        cleanup_stale()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules marked `runtime(seconds)` first, longest first; the others after them in file
    order, and every module's own tests in file order. `make test` hands whole modules to
    two workers in collection order (`--dist loadfile --no-loadscope-reorder`): a module of
    five minutes started last would keep one worker busy long after the other ran out of
    work, so the long ones start at once and the short ones fill in around them."""
    def runtime(item: pytest.Item) -> float:
        marker = item.get_closest_marker("runtime")
        return float(marker.args[0]) if marker else 0.0

    items.sort(key=lambda item: -runtime(item))


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


SOURCE_DATE_EPOCH = "315532800"  # ansible/roles/bookie/defaults/main.yml: bookie_wheel_source_date_epoch


def source_files() -> list[Path]:
    """The checkout's source files, relative (tracked, and new ones git does not ignore): a
    source tree with nothing built in it, as a controller or a user checks it out."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
    return [Path(rel) for rel in filter(None, listed) if (REPO / rel).is_file()]


WHEEL_CACHE_ENV = "BK_TEST_WHEEL_CACHE"  # the run's wheel cache directory, set by the controller
WHEEL_CACHE_MAX_AGE_S = 6 * 3600  # a cached wheel older than this is built again (build tools move on)


def _wheel_cache() -> Path:
    """Where this checkout's wheel for this interpreter is kept: named by the interpreter and a
    hash of every source file's path and bytes, so any edit names another directory."""
    h = hashlib.sha256(SOURCE_DATE_EPOCH.encode())
    for rel in sorted(source_files()):
        h.update(str(rel).encode() + b"\0" + (REPO / rel).read_bytes() + b"\0")
    return REPO / "build" / f"wheel-{sys.implementation.cache_tag}-{h.hexdigest()[:16]}"


def pytest_configure(config: pytest.Config) -> None:
    """On the controller (xdist workers inherit its environment): the run's wheel cache,
    named once from the sources as they are now, and the caches of other sources or past
    WHEEL_CACHE_MAX_AGE_S removed, before any worker can be using one."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    cache = _wheel_cache()
    os.environ[WHEEL_CACHE_ENV] = str(cache)
    cache.parent.mkdir(exist_ok=True)
    with open(cache.parent / ".wheel.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for old in cache.parent.glob(f"wheel-{sys.implementation.cache_tag}-*"):
            if old != cache or time.time() - old.stat().st_mtime > WHEEL_CACHE_MAX_AGE_S:
                shutil.rmtree(old)


@pytest.fixture(scope="session")
def built_wheel() -> Path:
    """The project's wheel, built as a user would (`pip wheel .`: pip's isolated build
    environment gets setuptools, Cython and liburing from pyproject.toml), reproducibly
    (SOURCE_DATE_EPOCH: the same sources give the same bytes, which deployments compare; the
    value is the Ansible role's bookie_wheel_source_date_epoch, so the role's own build of
    this commit gives these very bytes).
    Built once per source tree and interpreter, kept under build/ (pytest_configure names the
    directory and prunes the others) for WHEEL_CACHE_MAX_AGE_S: `make test` runs pytest
    twice (the multi-host module alone, then the rest), and a build is ~90 s of CPU on a
    2-core machine, which the Ansible module, the longest, waited out at its start. Under
    xdist the first worker that needs it builds it and the others wait for that one (a file
    lock)."""
    out = Path(os.environ[WHEEL_CACHE_ENV])
    with open(out.parent / ".wheel.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not list(out.glob("bookkeeper_py-*.whl")):
            subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)],
                           check=True, timeout=600, env={**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH},
                           stdin=subprocess.DEVNULL)
        (wheel,) = out.glob("bookkeeper_py-*.whl")
    return wheel


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local[2] SparkSession for the whole test session (a JVM start costs ~8 s), with the
    "bookkeeper" format registered; its JVM is stopped by pid at the end."""
    from bookkeeper.spark.session import local_session, stop_session
    session = local_session(app="bookkeeper-tests")
    try:
        yield session
    finally:
        stop_session(session)


@pytest.fixture
def arun() -> Callable[[Coroutine[Any, Any, T]], T]:
    return run


__all__ = ["asyncio", "run"]
