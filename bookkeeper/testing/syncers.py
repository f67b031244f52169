"""A journal device for tests: writes really happen, syncs complete only when the test says so;
and a filler that prepares the journal's next file at once (no thread)."""
from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable
from typing import Any


class InlineExecutor(concurrent.futures.Executor):
    """Runs a job at once, in the caller: the journal's next file is ready when the roll comes
    (the simulator: no thread; tests that count rolls: no race with one)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - the future carries it, as a pool's would
            fut.set_exception(e)
        return fut


class ManualSyncer:
    """The Syncer protocol of bookkeeper.bookie.journal.syncer, with completion under test control."""

    kind = "manual"

    def __init__(self) -> None:
        self.pending: list[Callable[[OSError | None], None]] = []
        self.submits = 0

    def submit(self, fd: int, buf: Any, offset: int, done: Callable[[OSError | None], None]) -> None:
        os.pwrite(fd, buf, offset)
        self.submits += 1
        self.pending.append(done)

    def complete_one(self) -> None:
        """The oldest sync in flight returns (successfully)."""
        self.pending.pop(0)(None)

    def release_all(self) -> None:
        """Every sync in flight returns, including ones submitted while releasing."""
        while self.pending:
            self.complete_one()

    def close(self) -> None:
        pass
