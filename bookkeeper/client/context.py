"""What a ledger handle may use of its client: the narrow context (the client implements it).

Why: handles used to hold the whole `BookKeeper` and call its private metadata helpers, and
`client.py` and `ledger.py` imported each other. A handle needs the bookie connections, the
settings, health and quarantine, the clock, its counters, and five metadata and placement
calls; nothing else of the client is its business, and a test or the simulator can hand it
anything with these names.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from bookkeeper._ext.client import LatencyHistogram
from bookkeeper.client.bookie_client import BookieClientPool, BookieHealth
from bookkeeper.client.config import ClientConfig
from bookkeeper.clock import Clock
from bookkeeper.meta.ledger_metadata import LedgerMetadata

if TYPE_CHECKING:
    from bookkeeper.client.lac_wheel import LacWheel


class LedgerContext(Protocol):
    """The client as a ledger handle sees it."""

    config: ClientConfig
    pool: BookieClientPool
    health: BookieHealth      # slow or failing bookies: read last
    quarantine: BookieHealth  # bookies that failed a write: not placed again for a while
    clock: Clock
    stats: dict[str, int]
    add_latency: LatencyHistogram
    read_latency: LatencyHistogram
    lac_wheel: LacWheel       # the client's one explicit-LAC timer (client/lac_wheel.py)

    def master_key(self, password: bytes) -> bytes: ...

    async def ledger_metadata(self, ledger_id: int) -> LedgerMetadata:
        """The ledger's metadata as ZooKeeper has it now."""
        ...

    async def write_metadata(self, md: LedgerMetadata) -> LedgerMetadata:
        """Compare-and-set md over the version it was read at: MetadataVersionError if another
        writer changed it since."""
        ...

    async def watch_metadata(self, ledger_id: int, fired: Callable[[Any], None]) -> int | None:
        """A one-shot watch on the ledger's metadata: its version now (None: gone)."""
        ...

    async def replacement_ensemble(self, md: LedgerMetadata, base: list[str], slots: list[int],
                                   exclude: set[str]) -> list[str]:
        """`base` with each of `slots` replaced by a writable bookie not in `exclude`."""
        ...

    async def bookies_for(self, ensembles: Iterable[list[str]]) -> None:
        """Before a read: the registrations fresh enough to route to these bookies."""
        ...
