"""Under-replication metadata in ZooKeeper: marks, locks, the disabled flag, auditor election.

Layout under the metadata root (docs/autorecovery.md):
  underreplication/                                  persistent
  underreplication/disabled                          present: auto-recovery paused (Apache's
                                                     autoRecoveryEnabled = false)
  underreplication/auditorelection/candidate-<seq>   ephemeral sequential: one per candidate,
                                                     the lowest sequence is the auditor (JSON:
                                                     owner_info, plus bookie_id in a bookie)
  underreplication/ledgers/B<6 digits>/L<10 digits>  persistent: a ledger with a segment on a
                                                     missing bookie (JSON mark, below)
  underreplication/locks/L<10 digits>                ephemeral: the worker copying that ledger

Why buckets: a flat directory of every marked ledger could outgrow one ZooKeeper reply
(jute.maxbuffer, 1 MiB: ~80,000 names); bucket B<id // 10^4> holds at most 10^4 names
(~140 KB), so every listing stays bounded, and the bucket of a ledger is computed, never
searched. Apache BookKeeper hashes into four hex levels for the same reason.

Mark (JSON, sorted keys): {"missing": [bookie_id, ...], "forced": [bookie_id, ...],
"marked_ms": N}. `missing`: bookies whose copies the ledger lost (or must lose); `forced`:
those an operator asked to move off (`bk recover`, `bk decommission`) even if they are up;
`marked_ms`: wall clock of the first mark, which starts an open ledger's grace.

Every method is a blocking kazoo call (thread-safe): async callers run them in an executor.
`mark`, the auditor's one write, returns how many ZooKeeper writes it made: the auditor counts them.
"""
from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError, NotEmptyError
from kazoo.protocol.states import WatchedEvent

from bookkeeper.errors import MetadataFormatError
from bookkeeper.meta.zk import ZkMetadataStore

BUCKET_SPAN = 10_000  # ledgers per bucket: a bucket listing is at most 10^4 names
ELECTION_PREFIX = "candidate-"


@dataclass(frozen=True, slots=True)
class Mark:
    """One under-replicated ledger as read from ZooKeeper (version: for a checked delete)."""

    ledger_id: int
    missing: tuple[str, ...]
    forced: tuple[str, ...]
    marked_ms: int
    version: int

    def to_json(self) -> dict[str, Any]:
        return {"ledger_id": self.ledger_id, "missing": list(self.missing), "forced": list(self.forced),
                "marked_ms": self.marked_ms}


def owner_info() -> dict[str, Any]:
    """Who holds an election node or a lock: for operators reading them, never for decisions."""
    return {"hostname": socket.gethostname(), "pid": os.getpid(), "since_ms": int(time.time() * 1000)}


def _encode(missing: Iterable[str], forced: Iterable[str], marked_ms: int) -> bytes:
    return json.dumps({"missing": sorted(set(missing)), "forced": sorted(set(forced)), "marked_ms": marked_ms},
                      sort_keys=True).encode()


class UnderReplicationManager:
    """The `underreplication/` subtree of one cluster (any thread; kazoo is thread-safe)."""

    def __init__(self, store: ZkMetadataStore) -> None:
        self.store = store
        self.zk = store.zk
        self.base = f"{store.root}/underreplication"
        self.ledgers = f"{self.base}/ledgers"
        self.locks = f"{self.base}/locks"
        self.election = f"{self.base}/auditorelection"
        self.disabled = f"{self.base}/disabled"

    def ensure_layout(self) -> None:
        """Create the persistent directories (idempotent; part of start-up, not of auditing)."""
        for path in (self.ledgers, self.locks, self.election):
            self.zk.ensure_path(path)

    # -- paths --------------------------------------------------------------
    def bucket_path(self, ledger_id: int) -> str:
        return f"{self.ledgers}/B{ledger_id // BUCKET_SPAN:06d}"

    def mark_path(self, ledger_id: int) -> str:
        return f"{self.bucket_path(ledger_id)}/L{ledger_id:010d}"

    def lock_path(self, ledger_id: int) -> str:
        return f"{self.locks}/L{ledger_id:010d}"

    # -- marks ----------------------------------------------------------------
    def mark(self, ledger_id: int, missing: Iterable[str], *, forced: bool = False) -> int:
        """Record that `missing` bookies' copies of the ledger must be replaced; returns the
        ZooKeeper writes made (0: already recorded, 1: created or widened, 2: + its bucket)."""
        missing = set(missing)
        path = self.mark_path(ledger_id)
        writes = 0
        while True:
            try:
                self.zk.create(path, _encode(missing, missing if forced else (), int(time.time() * 1000)))
                return writes + 1
            except NoNodeError:
                try:
                    self.zk.create(self.bucket_path(ledger_id), b"")
                except NodeExistsError:
                    pass
                else:
                    writes += 1
                continue
            except NodeExistsError:
                pass
            current = self.get_mark(ledger_id)
            if current is None:
                continue  # unmarked meanwhile: create again
            new_forced = set(current.forced) | (missing if forced else set())
            if missing <= set(current.missing) and new_forced == set(current.forced):
                return writes
            try:
                self.zk.set(path, _encode(set(current.missing) | missing, new_forced, current.marked_ms),
                            version=current.version)
                return writes + 1
            except (BadVersionError, NoNodeError):
                continue  # changed under us: read it again

    def get_mark(self, ledger_id: int) -> Mark | None:
        try:
            data, stat = self.zk.get(self.mark_path(ledger_id))
        except NoNodeError:
            return None
        try:
            d = json.loads(data)
            return Mark(ledger_id, tuple(d["missing"]), tuple(d.get("forced", ())), int(d.get("marked_ms", 0)),
                        stat.version)
        except (ValueError, KeyError, TypeError) as e:
            raise MetadataFormatError(f"corrupt under-replication mark of ledger {ledger_id}: {e}") from e

    def unmark(self, mark: Mark, bookies: Iterable[str] | None = None) -> bool:
        """Take `bookies` (default: all) off the mark, deleting it once none is left; checked
        against mark.version. False: the mark changed since it was read (a bookie was added),
        so the caller reads it again; a mark already gone counts as done."""
        drop = set(mark.missing) if bookies is None else set(bookies)
        left = [b for b in mark.missing if b not in drop]
        path = self.mark_path(mark.ledger_id)
        try:
            if left:
                self.zk.set(path, _encode(left, [b for b in mark.forced if b not in drop], mark.marked_ms),
                            version=mark.version)
                return True
            self.zk.delete(path, version=mark.version)
        except BadVersionError:
            return False
        except NoNodeError:
            return True
        try:
            self.zk.delete(self.bucket_path(mark.ledger_id))  # emptied bucket: keep listings short
        except (NotEmptyError, NoNodeError):
            pass
        return True

    def buckets(self, watch: Callable[[WatchedEvent], None] | None = None) -> list[str]:
        """Bucket names (sorted); `watch` fires once when a bucket appears or goes."""
        try:
            return sorted(self.zk.get_children(self.ledgers, watch=watch))
        except NoNodeError:
            return []

    def bucket_ledgers(self, bucket: str) -> list[int]:
        """Marked ledger ids in one bucket (one read, at most BUCKET_SPAN names)."""
        try:
            names = self.zk.get_children(f"{self.ledgers}/{bucket}")
        except NoNodeError:
            return []
        return sorted(int(n[1:]) for n in names if n.startswith("L") and n[1:].isdigit())

    def marked_ledgers(self) -> Iterator[int]:
        """Every marked ledger id, ascending, one bucket listing at a time."""
        for bucket in self.buckets():
            yield from self.bucket_ledgers(bucket)

    def count(self) -> int:
        """How many ledgers are marked: one stat per bucket (numChildren), no names transferred."""
        total = 0
        for bucket in self.buckets():
            stat = self.zk.exists(f"{self.ledgers}/{bucket}")
            total += stat.numChildren if stat is not None else 0
        return total

    # -- locks ----------------------------------------------------------------
    def try_lock(self, ledger_id: int) -> bool:
        """Take the ledger's replication lock (ephemeral: a dead worker's lock goes with its
        session); False if another worker holds it."""
        try:
            self.zk.create(self.lock_path(ledger_id), json.dumps(owner_info()).encode(), ephemeral=True)
            return True
        except NodeExistsError:
            return False

    def locked_count(self) -> int:
        """How many ledgers workers hold now (one read)."""
        try:
            return len(self.zk.get_children(self.locks))
        except NoNodeError:
            return 0

    def unlock(self, ledger_id: int) -> None:
        """Release our lock; one our expired session lost, and another worker took since, stays."""
        path = self.lock_path(ledger_id)
        stat = self.zk.exists(path)
        if stat is None or stat.ephemeralOwner != self.zk.client_id[0]:
            return
        try:
            self.zk.delete(path, version=stat.version)
        except (NoNodeError, BadVersionError):
            pass

    # -- enabled / disabled ------------------------------------------------------
    def is_enabled(self) -> bool:
        return self.zk.exists(self.disabled) is None

    def set_enabled(self, enabled: bool) -> None:
        """Disable: the auditor stops marking and workers stop taking ledgers (work under way
        finishes its ledger). Enable: both resume."""
        if enabled:
            try:
                self.zk.delete(self.disabled)
            except NoNodeError:
                pass
        else:
            try:
                self.zk.create(self.disabled, b"", makepath=True)
            except NodeExistsError:
                pass

    def watch_enabled(self, callback: Callable[[bool], None]) -> None:
        """callback(enabled) now and on every change of the flag (kazoo's thread)."""
        def on_change(_data: bytes | None, stat: Any) -> None:
            callback(stat is None)
        self.zk.DataWatch(self.disabled, on_change)

    # -- auditor election ------------------------------------------------------
    def join_election(self, bookie_id: str | None = None) -> str:
        """Become a candidate; returns the name of this candidate's ephemeral sequential node.
        bookie_id: the bookie the candidate runs in (what status() names as the auditor)."""
        info = {**owner_info(), **({"bookie_id": bookie_id} if bookie_id else {})}
        path = self.zk.create(f"{self.election}/{ELECTION_PREFIX}", json.dumps(info).encode(),
                              ephemeral=True, sequence=True)
        return path.rsplit("/", 1)[1]

    def candidates(self) -> list[str]:
        """Candidate node names, lowest sequence (the auditor) first."""
        try:
            names = self.zk.get_children(self.election)
        except NoNodeError:
            return []
        return sorted((n for n in names if n.startswith(ELECTION_PREFIX)), key=lambda n: n[len(ELECTION_PREFIX):])

    def candidate_info(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.zk.get(f"{self.election}/{name}")[0])
        except NoNodeError:
            return None

    def watch_candidate(self, name: str, watch: Callable[[WatchedEvent], None]) -> bool:
        """Whether candidate `name` still exists; `watch` fires once when it changes or goes."""
        return self.zk.exists(f"{self.election}/{name}", watch=watch) is not None

    def auditor_id(self) -> str | None:
        """The elected auditor: the bookie id its candidate node names, `HOST/pid-N` for a
        candidate outside a bookie (`bk autorecovery run`); None when no candidate stands.
        The first candidate listed may be gone before its node is read: the next is then first."""
        for name in self.candidates():
            info = self.candidate_info(name)
            if info is None:
                continue
            if info.get("bookie_id"):
                return str(info["bookie_id"])
            return f"{info['hostname']}/pid-{info['pid']}" if "hostname" in info and "pid" in info else name
        return None

    def status(self) -> dict[str, Any]:
        """The cluster's auto-recovery as Apache BookKeeper's /api/v1/autorecovery/status answers it:
        {"enabled": the cluster-wide flag, "auditor": auditor_id(), "underreplicated": count()}."""
        return {"enabled": self.is_enabled(), "auditor": self.auditor_id(), "underreplicated": self.count()}

    def leave_election(self, name: str) -> None:
        try:
            self.zk.delete(f"{self.election}/{name}")
        except NoNodeError:
            pass
