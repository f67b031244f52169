"""Auto-recovery: an elected auditor marks the ledgers of lost bookies under-replicated;
replication workers copy their missing fragments to other bookies (docs/autorecovery.md).

    service = AutoRecoveryService(uri, lost_bookie_delay_s=30, open_ledger_rereplication_grace_s=30,
                                  audit_interval_s=5)
    service.start(); service.status(); service.stop()

What lives where: README.md in this package.
"""
from bookkeeper.autorecovery.service import AutoRecoveryService  # noqa: F401

__all__ = ["AutoRecoveryService"]
