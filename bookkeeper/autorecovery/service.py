"""AutoRecoveryService: an auditor candidate and a replication worker on a thread of their own.

Lives in: a bookie's supervisor (`autorecovery = true`: bookie/supervisor.py
start_autorecovery) or `bk autorecovery run`. Neither caller is async, so the service runs
its own uvloop event loop on a daemon thread: start() returns at once, stop() joins, and
status() may be called from any thread (the admin HTTP's) at any time.

The loop holds one BookKeeper client (one ZooKeeper session: the election node and the
ledger locks are ephemeral on it) and three tasks: the auditor candidate, the worker, and a
refresher of the under-replicated count (one stat per bucket every COUNT_REFRESH_S). If
ZooKeeper is unreachable at start the service keeps trying; stop() ends it either way,
releasing the lock and the election node (explicitly, and in any case with the session).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kazoo.protocol.states import KazooState

from bookkeeper.autorecovery.auditor import Auditor, AuditorStats
from bookkeeper.autorecovery.events import Switch, wait_any
from bookkeeper.autorecovery.replicator import ReplicationStats
from bookkeeper.autorecovery.worker import ReplicationWorker
from bookkeeper.client.client import BookKeeper
from bookkeeper.client.config import ClientConfig
from bookkeeper.errors import BKError, ConfigError
from bookkeeper.meta.underreplication import UnderReplicationManager

if TYPE_CHECKING:
    from bookkeeper.config import BookieConfig

log = logging.getLogger(__name__)

CONNECT_RETRY_S = 2.0
COUNT_REFRESH_S = 5.0
STOP_TIMEOUT_S = 30.0


def bookie_client_trust(cfg: BookieConfig) -> dict[str, Any]:
    """The `connect` keywords of auto-recovery running in a bookie: the bookie's own
    credentials. Its copies read from and write to other bookies, which check their clients
    as this bookie checks its own: TLS as the bookie's `tls` says, against its CA, with its
    certificate as the client certificate (a bookie certificate is issued for client use too),
    and its auth_provider with its auth_token; its seal key opens the ledgers' passwords. ConfigError (naming auto-recovery) when those
    cannot make a client, e.g. auth_provider = "token" without the bookie's own auth_token."""
    kwargs: dict[str, Any] = {"tls": cfg.tls, "tls_reload_interval_s": cfg.tls_reload_interval_s,
                              "auth_provider": cfg.auth_provider, "auth_token": cfg.auth_token,
                              "zk_auth": cfg.zk_auth, "password_seal_key_file": cfg.password_seal_key_file}
    if cfg.tls != "off":
        kwargs.update(tls_ca_file=cfg.tls_ca_file, tls_cert_file=cfg.tls_cert_file, tls_key_file=cfg.tls_key_file)
    try:
        ClientConfig(**kwargs).validate()
    except ConfigError as e:
        raise ConfigError(f"auto-recovery connects with this bookie's credentials: {e}") from None
    return kwargs


class AutoRecoveryService:
    """Auto-recovery for one cluster: auditor candidate + replication worker (thread + loop)."""

    def __init__(self, metadata_uri: str, *, lost_bookie_delay_s: float, open_ledger_rereplication_grace_s: float,
                 audit_interval_s: float, bookie_id: str | None = None,
                 client_kwargs: Mapping[str, Any] | None = None) -> None:
        """client_kwargs: `BookKeeper.connect` keywords of its client (trust: in a bookie,
        bookie_client_trust(cfg); `bk autorecovery run`: the operator's client settings)."""
        if lost_bookie_delay_s < 0 or open_ledger_rereplication_grace_s < 0:
            raise ConfigError("lost_bookie_delay_s and open_ledger_rereplication_grace_s must be >= 0")
        if audit_interval_s <= 0:
            raise ConfigError(f"audit_interval_s must be > 0, got {audit_interval_s}")
        self.metadata_uri = metadata_uri
        self.lost_bookie_delay_s = lost_bookie_delay_s
        self.grace_s = open_ledger_rereplication_grace_s
        self.audit_interval_s = audit_interval_s
        self.bookie_id = bookie_id  # the bookie it runs in (None: `bk autorecovery run`): the auditor's name
        self.client_kwargs = dict(client_kwargs or {})
        self.auditor_stats = AuditorStats()
        self.replication_stats = ReplicationStats()
        self._switch: Switch | None = None
        self._under_replicated: int | None = None
        self._connected = False
        self._worker: ReplicationWorker | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stopping = threading.Event()

    # -- life ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the service's thread and return at once."""
        if self._thread is not None:
            raise RuntimeError("auto-recovery service already started")
        self._thread = threading.Thread(target=self._thread_main, name="autorecovery", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop the auditor and the worker (the copy in hand is abandoned: its metadata is not
        switched, so nothing is lost), release the lock and the election node, join."""
        self._stopping.set()
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass  # the loop already ended
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("auto-recovery did not stop within %.0f s", timeout_s)

    def _thread_main(self) -> None:
        import uvloop

        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(self._main())
        except Exception:
            log.exception("auto-recovery service failed")

    async def _main(self) -> None:
        """Connect and serve until stopped; a failure while setting up (ZooKeeper unreachable,
        its session lost at the wrong moment) is retried, never the end of the service."""
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        while not self._stopping.is_set():
            try:
                await self._serve(self._stop)
            except BKError as e:
                log.warning("auto-recovery: %s; retrying in %.0f s", e, CONNECT_RETRY_S)
                await wait_any([self._stop], CONNECT_RETRY_S)

    async def _serve(self, stop: asyncio.Event) -> None:
        """One client (one ZooKeeper session) running the three tasks until stop is set."""
        loop = asyncio.get_running_loop()
        bk = await BookKeeper.connect(self.metadata_uri, **self.client_kwargs)
        self._connected = True
        try:
            urm = UnderReplicationManager(bk.store)
            await bk.metadata_call(urm.ensure_layout)
            enabled = self._switch = Switch(loop, await bk.metadata_call(urm.is_enabled))
            await bk.metadata_call(urm.watch_enabled, enabled.set_threadsafe)
            auditor = Auditor(bk, urm, lost_bookie_delay_s=self.lost_bookie_delay_s,
                              audit_interval_s=self.audit_interval_s, stats=self.auditor_stats,
                              bookie_id=self.bookie_id)
            worker = self._worker = ReplicationWorker(bk, urm, grace_s=self.grace_s, stats=self.replication_stats)

            def on_state(state: str) -> None:  # kazoo's thread
                if state == KazooState.LOST:
                    loop.call_soon_threadsafe(auditor.session_lost)
            bk.store.zk.add_listener(on_state)
            tasks = [asyncio.ensure_future(auditor.run(stop, enabled)),
                     asyncio.ensure_future(worker.run(stop, enabled)),
                     asyncio.ensure_future(self._refresh(bk, urm, enabled, stop))]
            await stop.wait()
            for t in tasks:
                t.cancel()
            for r in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(r, Exception):
                    log.warning("auto-recovery task ended with %s: %s", type(r).__name__, r)
            bk.store.zk.remove_listener(on_state)
        finally:
            self._connected = False
            await bk.close()

    async def _refresh(self, bk: BookKeeper, urm: UnderReplicationManager, enabled: Switch,
                       stop: asyncio.Event) -> None:
        """Keep the under-replicated count status() shows fresh (and fresh at once after enable)."""
        while not stop.is_set():
            try:
                self._under_replicated = await bk.metadata_call(urm.count)
            except BKError as e:
                log.debug("under-replicated count: %s", e)
            await wait_any([stop, enabled.changed], COUNT_REFRESH_S)

    # -- what operators see --------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """A JSON-able snapshot (any thread): /api/v1/autorecovery/status and the metrics."""
        a, r = self.auditor_stats, self.replication_stats
        worker, switch = self._worker, self._switch
        return {
            "running": self._thread is not None and self._thread.is_alive() and not self._stopping.is_set(),
            "connected": self._connected,
            "enabled": switch.value if switch is not None else None,
            "is_auditor": a.is_auditor,
            "auditor_terms": a.terms,
            "audits": a.audits,
            "last_audit_ms": a.last_audit_ms,
            "lost_bookies_pending": dict(a.pending),
            "lost_bookies_marked": list(a.lost),
            "absences_cancelled": a.absences_cancelled,
            "scans": a.scans,
            "ledgers_scanned": a.ledgers_scanned,
            "ledgers_marked": a.ledgers_marked,
            "auditor_zk_reads": a.zk_reads,
            "auditor_zk_writes": a.zk_writes,
            "last_scan": dict(a.last_scan) if a.last_scan else None,
            "under_replicated": self._under_replicated if self._under_replicated is not None else 0,
            "current_ledger": worker.current if worker is not None else None,
            "ledgers_replicated": r.ledgers_replicated,
            "fragments_replicated": r.fragments_replicated,
            "entries_copied": r.entries_copied,
            "bytes_copied": r.bytes_copied,
            "ledgers_recovered": r.ledgers_recovered,
            "replication_failures": r.failures,
            "last_error": r.last_error,
            "lost_bookie_delay_s": self.lost_bookie_delay_s,
            "open_ledger_rereplication_grace_s": self.grace_s,
            "audit_interval_s": self.audit_interval_s,
        }
