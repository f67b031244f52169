"""A journal device for tests: writes really happen, syncs complete only when the test says so."""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


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
