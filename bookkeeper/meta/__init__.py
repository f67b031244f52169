"""Metadata: ledger metadata, bookie registration, cookies and ledger ids, in ZooKeeper.

ZooKeeper is written when a ledger is created, changes ensemble or closes, and
when a bookie starts: never per entry. Layout: docs/metadata.md.
"""
from bookkeeper.meta.ledger_metadata import DigestType, LedgerMetadata, LedgerState  # noqa: F401
