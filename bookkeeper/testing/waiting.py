"""Waiting for a condition in tests: one poll loop with a deadline, not a sleep that guesses.

Lives in: the test harness (tests and `bk` benchmarks that drive a LocalCluster).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(what: str, check: Callable[[], T], *, timeout_s: float = 60.0, every_s: float = 0.05) -> T:
    """Call check() every every_s until it returns something true, and return that; an
    AssertionError naming `what` once timeout_s has passed without it."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"not {what} within {timeout_s} s"
        time.sleep(every_s)
