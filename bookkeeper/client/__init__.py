"""The client: asyncio core (client.py, ledger.py, bookie_client.py) over a sans-I/O
quorum core (core/). The blocking twin is bookkeeper.sync."""
from bookkeeper.client.client import BookKeeper  # noqa: F401
from bookkeeper.client.ledger import LedgerEntry, ReadHandle, WriteHandle  # noqa: F401
