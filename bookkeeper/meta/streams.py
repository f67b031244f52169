"""Stream metadata in ZooKeeper: namespaces, streams, their segments and writer locks.

Layout under the metadata root (docs/streams.md):
  streams/<ns>                                 namespace: JSON {"format": 1, "ctime_ms"}
  streams/<ns>/<stream>                        stream: JSON settings + next_seq (below)
  streams/<ns>/<stream>/segments/<seq:010d>    one segment (one ledger): JSON (below)
  streams/<ns>/<stream>/lock/w-<zk seq>        ephemeral sequential: writers, newest owns

Stream JSON: {"format", "ctime_ms", "retention_max_age_s", "retention_max_bytes",
"ensemble", "write_quorum", "ack_quorum", "next_seq", "epoch"}. Segment JSON: {"format", "seq",
"ledger_id", "state" (open | closed | truncated), "first_txid", "last_txid", "first_entry",
"last_entry", "records", "bytes", "ctime_ms", "closed_ms"}.

Why every update is a compare-and-set: two writers (an old one that has not noticed its
takeover, and the new one) may both try to change a stream. Adding a segment is one
multi-op that sets the stream node at its read version (bumping next_seq) and creates the
segment node, so a writer that read a stale stream can never add a segment; closing a
segment is a versioned set of its node. A writer that opens bumps `epoch` (a versioned set)
before it recovers the previous writer's segment, so the previous writer, which remembers the
version of its own last write, can no longer add a segment even if it never hears of the
takeover. `format` is the JSON layout's version: readers
refuse a newer one instead of misreading it.

The ledger subtree ignores this one: ledger levels are two-digit children of the root.
Every method is a blocking kazoo call (thread-safe): async callers use an executor.
"""
from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import (AuthFailedError, BadVersionError, NoAuthError, NodeExistsError, NoNodeError,
                              NotEmptyError, RolledBackError)
from kazoo.protocol.states import WatchedEvent, ZnodeStat

from bookkeeper.errors import (
    InternalError,
    InvalidArgumentError,
    InvalidStreamNameError,
    MetadataFormatError,
    MetadataVersionError,
    StreamExistsError,
    StreamNotFoundError,
)
from bookkeeper.meta.zk import metadata_auth_error

FORMAT = 1
LOCK_PREFIX = "w-"
MAX_NAME = 200
_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_NAME - 1}}}")
# The most namespaces, and streams per namespace. Why a limit: a listing (`list_streams`, `bk
# stream list`) is one ZooKeeper reply, and a reply past jute.maxbuffer (0xfffff bytes by
# default) is refused by ZooKeeper's Java clients and tools: the znode could no longer be
# listed there. A name costs 4 bytes + its length in the reply, so 4,096 names of the longest
# allowed length (200) take 820 KiB: room for any names, and for a few creates racing past
# the count (each checks the count it read, not a lock).
MAX_CHILDREN = 4096


def check_name(kind: str, name: str) -> str:
    """Namespace and stream names become znode names: letters, digits, '.', '_', '-'."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidStreamNameError(f"invalid {kind} name {name!r}: 1-200 characters of letters, digits, "
                                     f"'.', '_' or '-', starting with a letter or digit")
    return name


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True, slots=True)
class StreamMeta:
    """A stream's settings and segment counter, with the znode version for CAS."""

    name: str
    ensemble: int
    write_quorum: int
    ack_quorum: int
    retention_max_age_s: float | None
    retention_max_bytes: int | None
    next_seq: int
    ctime_ms: int
    epoch: int = 0                 # writers that opened the stream so far
    version: int = -1

    def to_json(self) -> bytes:
        d = dataclasses.asdict(self)
        del d["name"], d["version"]
        return json.dumps({"format": FORMAT, **d}, sort_keys=True).encode()


@dataclass(frozen=True, slots=True)
class Segment:
    """One segment (a ledger) of a stream, with the znode version for CAS."""

    seq: int
    ledger_id: int
    state: str = "open"            # open | closed | truncated
    first_txid: int = -1           # -1: no record yet
    last_txid: int = -1
    first_entry: int = 0
    last_entry: int = -1
    records: int = 0
    size_bytes: int = 0
    ctime_ms: int = 0
    closed_ms: int = 0
    version: int = -1

    def to_json(self) -> bytes:
        d = dataclasses.asdict(self)
        del d["version"]
        d["bytes"] = d.pop("size_bytes")
        return json.dumps({"format": FORMAT, **d}, sort_keys=True).encode()

    def describe(self) -> dict[str, Any]:
        """The `bk stream describe --json` view of a segment."""
        return {"seq": self.seq, "ledger_id": self.ledger_id, "state": self.state,
                "first_txid": self.first_txid, "last_txid": self.last_txid, "first_entry": self.first_entry,
                "last_entry": self.last_entry, "records": self.records, "bytes": self.size_bytes,
                "ctime_ms": self.ctime_ms, "closed_ms": self.closed_ms}


def _load(data: bytes, what: str) -> dict[str, Any]:
    try:
        d = json.loads(data)
    except ValueError as e:
        raise MetadataFormatError(f"{what}: metadata is not JSON ({e})") from e
    if d.get("format", 0) > FORMAT:
        raise MetadataFormatError(f"{what}: metadata format {d['format']} is newer than this client's ({FORMAT}); upgrade it")
    d.pop("format", None)
    return d


class StreamStore:
    """The one place that knows the stream znode layout."""

    def __init__(self, zk: KazooClient, root: str) -> None:
        self.zk = zk
        self.base = f"{root}/streams"

    # -- paths ---------------------------------------------------------------------
    def ns_path(self, ns: str) -> str:
        return f"{self.base}/{check_name('namespace', ns)}"

    def stream_path(self, ns: str, name: str) -> str:
        return f"{self.ns_path(ns)}/{check_name('stream', name)}"

    def lock_path(self, ns: str, name: str) -> str:
        return f"{self.stream_path(ns, name)}/lock"

    def _segment_path(self, ns: str, name: str, seq: int) -> str:
        return f"{self._segments_base(ns, name)}/{seq:010d}"

    # -- namespaces and streams ---------------------------------------------------------
    def ensure_namespace(self, ns: str) -> None:
        path = self.ns_path(ns)
        if self.zk.exists(path) is None:
            self.zk.ensure_path(self.base)
            _check_room(self.zk.exists(self.base), f"namespace {ns!r}", "the cluster",
                        "delete unused namespaces")
            try:
                self.zk.create(path, json.dumps({"format": FORMAT, "ctime_ms": now_ms()}).encode())
            except NodeExistsError:
                pass

    def create_stream(self, ns: str, meta: StreamMeta) -> None:
        """Stream node, segments/ and lock/ in one multi-op: a stream exists whole or not at all."""
        path = self.stream_path(ns, meta.name)
        stat = self.zk.exists(self.ns_path(ns))
        if stat is None:
            raise StreamNotFoundError(f"namespace {ns!r} does not exist")
        _check_room(stat, f"stream {meta.name!r}", f"namespace {ns!r}", "create it in another namespace")
        t = self.zk.transaction()
        t.create(path, meta.to_json())
        t.create(f"{path}/segments", b"")
        t.create(f"{path}/lock", b"")
        results = t.commit()
        if any(isinstance(r, NodeExistsError) for r in results):
            raise StreamExistsError(f"stream {meta.name!r} already exists in namespace {ns!r}")
        _raise_first(results, f"create stream {meta.name!r}")

    def list_streams(self, ns: str) -> list[str]:
        try:
            return sorted(self.zk.get_children(self.ns_path(ns)))
        except NoNodeError:
            return []

    def read_stream(self, ns: str, name: str) -> StreamMeta:
        try:
            data, stat = self.zk.get(self.stream_path(ns, name))
        except NoNodeError:
            raise StreamNotFoundError(f"stream {name!r} does not exist in namespace {ns!r}") from None
        return StreamMeta(name=name, version=stat.version, **_load(data, f"stream {ns}/{name}"))

    def segments(self, ns: str, name: str) -> list[Segment]:
        """All segments, oldest first (list_segments without its version or watch)."""
        return self.list_segments(ns, name)[1]

    def list_segments(self, ns: str, name: str, watch: Callable[[WatchedEvent], None] | None = None, *,
                      known: Iterable[Segment] = ()) -> tuple[int, list[Segment]]:
        """(the segment list's version, all segments oldest first); with `watch`, a one-shot
        watch on the segment list. `known`: segments read before; the closed ones are returned as
        they are instead of read again (a closed segment's figures never change; only its
        state may turn truncated, on its way to deletion).

        Why one listing and pipelined reads: a segment node read in a round trip of its own
        made every listing S round trips, on every roll's retention pass and every reader's
        re-list; now it is two round trips, and S reads (fewer with `known`: a tailing reader
        reads the new segment and the one that was open). The version is the segments
        znode's pzxid (moved by every segment added or deleted, never repeated):
        segments_version() tells whether a listing is still current in one stat."""
        base = self._segments_base(ns, name)
        try:
            children, parent = self.zk.get_children(base, watch=watch, include_data=True)
        except NoNodeError:
            raise StreamNotFoundError(f"stream {name!r} does not exist in namespace {ns!r}") from None
        kept = {s.seq: s for s in known if s.state == "closed"}
        pending = [(child, None if int(child) in kept else self.zk.get_async(f"{base}/{child}"))
                   for child in sorted(children)]
        out = []
        for child, reply in pending:
            if reply is None:
                out.append(kept[int(child)])
                continue
            try:
                data, stat = reply.get()
            except NoNodeError:
                continue  # deleted by retention between the listing and the read
            except (NoAuthError, AuthFailedError) as e:  # the sync calls' mapping (GuardedKazooClient)
                raise metadata_auth_error(e, "read", f"{base}/{child}", self.zk.security) from None
            d = _load(data, f"segment {ns}/{name}/{child}")
            d["size_bytes"] = d.pop("bytes")
            out.append(Segment(version=stat.version, **d))
        return int(parent.pzxid), out

    def segments_version(self, ns: str, name: str) -> int | None:
        """The version list_segments returns, from one stat (None: the stream is gone)."""
        stat = self.zk.exists(self._segments_base(ns, name))
        return None if stat is None else int(stat.pzxid)

    def _segments_base(self, ns: str, name: str) -> str:
        return f"{self.stream_path(ns, name)}/segments"

    def add_segment(self, ns: str, stream: StreamMeta, segment: Segment) -> tuple[StreamMeta, Segment]:
        """Create segment `stream.next_seq` iff the stream node is still at stream.version."""
        if segment.seq != stream.next_seq:
            raise InvalidArgumentError(f"segment {segment.seq} is not the stream's next ({stream.next_seq})")
        bumped = dataclasses.replace(stream, next_seq=stream.next_seq + 1)
        t = self.zk.transaction()
        t.set_data(self.stream_path(ns, stream.name), bumped.to_json(), version=stream.version)
        t.create(self._segment_path(ns, stream.name, segment.seq), segment.to_json())
        _raise_first(t.commit(), f"add segment {segment.seq} to stream {stream.name!r}")
        return dataclasses.replace(bumped, version=stream.version + 1), dataclasses.replace(segment, version=0)

    def bump_epoch(self, ns: str, stream: StreamMeta) -> StreamMeta:
        """A new writer's claim: set the stream node (at its read version) with epoch + 1."""
        bumped = dataclasses.replace(stream, epoch=stream.epoch + 1)
        try:
            stat = self.zk.set(self.stream_path(ns, stream.name), bumped.to_json(), version=stream.version)
        except BadVersionError:
            raise MetadataVersionError(f"stream {stream.name!r} changed while a writer opened it") from None
        except NoNodeError:
            raise StreamNotFoundError(f"stream {stream.name!r} does not exist in namespace {ns!r}") from None
        return dataclasses.replace(bumped, version=stat.version)

    def update_segment(self, ns: str, name: str, segment: Segment) -> Segment:
        """Compare-and-set one segment at segment.version."""
        try:
            stat = self.zk.set(self._segment_path(ns, name, segment.seq), segment.to_json(), version=segment.version)
        except BadVersionError:
            raise MetadataVersionError(f"segment {segment.seq} of stream {name!r} changed meanwhile") from None
        except NoNodeError:
            raise StreamNotFoundError(f"segment {segment.seq} of stream {name!r} is gone") from None
        return dataclasses.replace(segment, version=stat.version)

    def mark_truncated(self, ns: str, name: str, segments: list[Segment]) -> list[Segment]:
        """Set state truncated on segments (each at its version) in one multi-op: from here on
        readers skip them, and a deletion that stops half-way is finished by the next one."""
        todo = [s for s in segments if s.state != "truncated"]
        if todo:
            t = self.zk.transaction()
            for s in todo:
                t.set_data(self._segment_path(ns, name, s.seq), dataclasses.replace(s, state="truncated").to_json(),
                           version=s.version)
            _raise_first(t.commit(), f"truncate segments of stream {name!r}")
        return [s if s.state == "truncated" else dataclasses.replace(s, state="truncated", version=s.version + 1)
                for s in segments]

    def delete_segments(self, ns: str, name: str, segments: list[Segment]) -> None:
        """Remove segment nodes (each at its version) in one multi-op. A node already gone was
        removed by a concurrent deletion of the same truncated segments (a retention pass and a
        writer retiring its empty segment): then the rest go one by one, the gone ones skipped."""
        if not segments:
            return
        t = self.zk.transaction()
        for s in segments:
            t.delete(self._segment_path(ns, name, s.seq), version=s.version)
        results = t.commit()
        if not any(isinstance(r, NoNodeError) for r in results):
            _raise_first(results, f"delete segments of stream {name!r}")
            return
        for s in segments:
            try:
                self.zk.delete(self._segment_path(ns, name, s.seq), version=s.version)
            except NoNodeError:
                continue
            except BadVersionError:
                raise MetadataVersionError(f"segment {s.seq} of stream {name!r} changed while it was deleted") from None

    def delete_stream(self, ns: str, name: str) -> None:
        """Remove the stream's nodes (its ledgers are the caller's to delete first)."""
        path = self.stream_path(ns, name)
        try:
            self.zk.delete(path, recursive=True)
        except NoNodeError:
            raise StreamNotFoundError(f"stream {name!r} does not exist in namespace {ns!r}") from None
        except NotEmptyError:
            raise MetadataVersionError(f"stream {name!r} changed while it was deleted; try again") from None

    # -- writer lock -----------------------------------------------------------------
    def lock_create(self, ns: str, name: str, owner: bytes) -> str:
        """This writer's ephemeral sequential node; its name orders it among writers."""
        try:
            return self.zk.create(f"{self.lock_path(ns, name)}/{LOCK_PREFIX}", owner, ephemeral=True, sequence=True)
        except NoNodeError:
            raise StreamNotFoundError(f"stream {name!r} does not exist in namespace {ns!r}") from None

    def lock_holders(self, ns: str, name: str) -> list[str]:
        """Writers' lock node names, oldest first (ZooKeeper's sequence order)."""
        try:
            kids = self.zk.get_children(self.lock_path(ns, name))
        except NoNodeError:
            return []
        return sorted(kids, key=lambda k: int(k[len(LOCK_PREFIX):]))

    def lock_delete(self, path: str) -> bool:
        try:
            self.zk.delete(path)
        except NoNodeError:
            return False
        return True

    def lock_watch(self, path: str, watch: Callable[[WatchedEvent], None]) -> bool:
        """Watch a lock node; False if it is already gone."""
        return self.zk.exists(path, watch=watch) is not None


def _check_room(parent: ZnodeStat | None, what: str, where: str, advice: str) -> None:
    """Refuse a child past MAX_CHILDREN (a namespace, or a stream in a namespace): see there."""
    if parent is not None and parent.numChildren >= MAX_CHILDREN:
        raise InvalidArgumentError(
            f"cannot create {what}: {where} has {parent.numChildren}, the most allowed is {MAX_CHILDREN} "
            f"(one ZooKeeper listing must hold them all, within jute.maxbuffer's 1 MiB); {advice}")


def _raise_first(results: list[Any], what: str) -> None:
    """A multi-op's first real failure as a BKError (the rest are RolledBackError)."""
    for r in results:
        if isinstance(r, Exception) and not isinstance(r, RolledBackError):
            if isinstance(r, BadVersionError):
                raise MetadataVersionError(f"{what}: the stream changed meanwhile (another writer?)") from r
            if isinstance(r, NoNodeError):
                raise StreamNotFoundError(f"{what}: the stream or segment is gone") from r
            if isinstance(r, NodeExistsError):
                raise MetadataVersionError(f"{what}: the stream changed meanwhile (another writer?)") from r
            raise InternalError(f"{what}: ZooKeeper failed the multi-op with {type(r).__name__}") from r
