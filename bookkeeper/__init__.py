"""BookKeeper in Python: replicated, durable, low-latency log storage.

    from bookkeeper import BookKeeper, DigestType
    async with await BookKeeper.connect("zk://127.0.0.1:2181/ledgers") as bk: ...

See README.md and docs/ for the architecture, protocol and metadata layout.
"""
from bookkeeper import errors
from bookkeeper.client import BookKeeper, LedgerEntry, ReadHandle, WriteHandle
from bookkeeper.meta.ledger_metadata import DigestType, LedgerMetadata, LedgerState

LedgerHandle = WriteHandle

__all__ = ["BookKeeper", "DigestType", "LedgerEntry", "LedgerHandle", "LedgerMetadata", "LedgerState",
           "ReadHandle", "WriteHandle", "errors"]
