"""The client: asyncio core (client.py, ledger.py, bookie_client.py) over a sans-I/O
quorum core (core/). The blocking twin is bookkeeper.sync."""
from bookkeeper.client.client import BookKeeper
from bookkeeper.client.ledger import LedgerEntry, ReadHandle, WriteHandle

__all__ = ["BookKeeper", "LedgerEntry", "ReadHandle", "WriteHandle"]
