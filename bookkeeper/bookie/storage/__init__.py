"""Per shard: ledger storage (entry logs, LMDB index, ledger state). See ledger_storage.py."""
from bookkeeper.bookie.storage.ledger_storage import LedgerState, LedgerStorage, Snapshot  # noqa: F401
