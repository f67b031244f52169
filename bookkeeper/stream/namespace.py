"""A namespace of streams: creation, listing, the writer and readers, truncation and retention.

Why the segment bookkeeping lives here and not in the writer: recovery of an open segment,
retention and truncation are done by whoever gets there first (a new writer, a reader's
owner calling truncate, the CLI), and each is a compare-and-set sequence that must leave
ZooKeeper consistent if it stops half-way. A deletion marks segments `truncated` first,
then deletes their ledgers, then their nodes: a reader skips truncated segments, and the
next retention pass finishes what an interrupted one left.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from bookkeeper.client import BookKeeper
from bookkeeper.errors import ConfigError, MetadataVersionError, NoSuchLedgerError
from bookkeeper.meta.streams import Segment, StreamMeta, StreamStore, check_name, now_ms
from bookkeeper.stream import policy, recordset
from bookkeeper.stream.position import Position
from bookkeeper.stream.reader import StreamReader
from bookkeeper.stream.writer import StreamWriter, WriterSettings

log = logging.getLogger(__name__)
_CAS_ATTEMPTS = 5


class Namespace:
    """Streams under `<root>/streams/<name>`; `await Namespace.connect(uri, name)`."""

    def __init__(self, bk: BookKeeper, name: str, *, password: bytes = b"", owns_client: bool = True) -> None:
        self.bk = bk
        self.name = check_name("namespace", name)
        self.password = password
        self.store = StreamStore(bk.store.zk, bk.store.root)
        self._owns_client = owns_client

    @classmethod
    async def connect(cls, metadata_uri: str, name: str = "default", *, password: bytes = b"",
                      **client_config: Any) -> Namespace:
        """Connect (a BookKeeper client of its own) and create the namespace if it is missing.

        `password` protects the segments' ledgers (recovery opens need it); keyword
        arguments are the client's settings (BookKeeper.connect).
        """
        check_name("namespace", name)
        bk = await BookKeeper.connect(metadata_uri, **client_config)
        ns = cls(bk, name, password=password)
        try:
            await bk.metadata_call(ns.store.ensure_namespace, name)
        except BaseException:
            await bk.close()
            raise
        return ns

    async def close(self) -> None:
        if self._owns_client:
            await self.bk.close()

    async def __aenter__(self) -> Namespace:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- streams ---------------------------------------------------------------------
    async def create_stream(self, name: str, *, retention_max_age_s: float | None = None,
                            retention_max_bytes: int | None = None, ensemble: int = 3, write_quorum: int = 2,
                            ack_quorum: int = 2) -> None:
        """Create an empty stream (StreamExistsError if the name is taken)."""
        check_name("stream", name)
        if not 1 <= ack_quorum <= write_quorum <= ensemble:
            raise ConfigError(f"need 1 <= ack_quorum <= write_quorum <= ensemble, got "
                              f"{ensemble}/{write_quorum}/{ack_quorum}")
        for key, v in (("retention_max_age_s", retention_max_age_s), ("retention_max_bytes", retention_max_bytes)):
            if v is not None and v <= 0:
                raise ConfigError(f"{key} must be > 0 or None (keep everything), got {v}")
        meta = StreamMeta(name=name, ensemble=ensemble, write_quorum=write_quorum, ack_quorum=ack_quorum,
                          retention_max_age_s=retention_max_age_s, retention_max_bytes=retention_max_bytes,
                          next_seq=1, ctime_ms=now_ms())
        await self.bk.metadata_call(self.store.create_stream, self.name, meta)

    async def list_streams(self) -> list[str]:
        return await self.bk.metadata_call(self.store.list_streams, self.name)

    async def stream_meta(self, name: str) -> StreamMeta:
        return await self.bk.metadata_call(self.store.read_stream, self.name, name)

    async def segments(self, name: str) -> list[Segment]:
        """The stream's segments, oldest first (truncated ones included)."""
        return await self.bk.metadata_call(self.store.segments, self.name, name)

    async def describe(self, name: str) -> dict[str, Any]:
        """Settings, writer and segments; an open segment's figures are read from its LAC entry."""
        meta = await self.stream_meta(name)
        segs = [await self._live_figures(s) if s.state == "open" else s for s in await self.segments(name)]
        writers = await self.bk.metadata_call(self.store.lock_holders, self.name, name)
        return {"name": name, "namespace": self.name, "ensemble": meta.ensemble, "write_quorum": meta.write_quorum,
                "ack_quorum": meta.ack_quorum, "retention_max_age_s": meta.retention_max_age_s,
                "retention_max_bytes": meta.retention_max_bytes, "writer": writers[-1] if writers else None,
                "segments": [s.describe() for s in segs]}

    async def _live_figures(self, seg: Segment) -> Segment:
        try:
            rh = await self.bk.open_ledger(seg.ledger_id, password=self.password, recovery=False)
            lac = rh.last_add_confirmed
            if lac < 0:
                return seg
            first, last = (await rh.read(0, 0))[0], (await rh.read(lac, lac))[0]
        except NoSuchLedgerError:
            return seg
        count, before, last_txid, _ = recordset.decode_header(last.data)
        return dataclasses.replace(seg, first_txid=recordset.decode(first.data).records[0][0], last_txid=last_txid,
                                   last_entry=lac, records=before + count, size_bytes=last.length)

    async def delete_stream(self, name: str) -> None:
        """Delete every segment's ledger, then the stream's nodes. A live writer fails at its next roll."""
        segs = await self.segments(name)
        for s in segs:
            await self._delete_ledger(s.ledger_id)
        await self.bk.metadata_call(self.store.delete_stream, self.name, name)

    # -- writer and readers -------------------------------------------------------------
    async def open_writer(self, name: str, **settings: Any) -> StreamWriter:
        """The stream's single writer (keyword arguments: WriterSettings). Takes over from an
        older writer: its open segment is fenced and closed before this one starts a new one."""
        check_name("stream", name)
        try:
            s = WriterSettings(**settings).validate()
        except TypeError as e:
            raise ConfigError(f"open_writer: {e}") from None
        writer = StreamWriter(self, name, s)
        await writer._open()
        return writer

    async def open_reader(self, name: str, start: str | Position = "earliest", *, txid: int | None = None,
                          follow: bool = True) -> StreamReader:
        """A reader from `start` ("earliest", "latest", a Position) or the first record with
        txid >= `txid`; it tails the stream (follow=False: stops at the current end)."""
        check_name("stream", name)
        reader = StreamReader(self, name, follow=follow)
        await reader._seek(start, txid)
        return reader

    # -- segments: used by the writer ---------------------------------------------------
    async def recover_segment(self, name: str, seg: Segment) -> Segment:
        """Fence and close an open segment's ledger (a recovery open), then close the segment
        with its figures read from the ledger's first and last entries. Empty: retired."""
        rh = await self.bk.open_ledger(seg.ledger_id, password=self.password, recovery=True)
        lac = rh.last_add_confirmed
        if lac < 0:
            await self.retire_segment(name, seg)
            return dataclasses.replace(seg, state="truncated")
        first, last = (await rh.read(0, 0))[0], (await rh.read(lac, lac))[0]
        count, before, last_txid, _ = recordset.decode_header(last.data)
        closed = dataclasses.replace(seg, state="closed", first_txid=recordset.decode(first.data).records[0][0],
                                     last_txid=last_txid, last_entry=lac, records=before + count,
                                     size_bytes=rh.length, closed_ms=now_ms())
        try:
            return await self.bk.metadata_call(self.store.update_segment, self.name, name, closed)
        except MetadataVersionError:
            for s in await self.segments(name):
                if s.seq == seg.seq and s.state != "open":
                    return s  # another writer closed it first, with the same figures
            raise

    async def retire_segment(self, name: str, seg: Segment) -> None:
        """Remove a segment that holds no record (a writer that wrote nothing)."""
        await self._drop(name, [seg])

    # -- retention ---------------------------------------------------------------------
    async def truncate(self, name: str, *, before: Position) -> list[int]:
        """Delete every whole segment that ends before `before` (its segment stays); returns
        their sequence numbers once their ledgers are deleted."""
        if not isinstance(before, Position):
            raise TypeError(f"before must be a Position, not {type(before).__name__}")
        return await self._expire(name, lambda segs, _meta: policy.before(segs, before.segment))

    async def apply_retention(self, name: str) -> list[int]:
        """Delete the segments the stream's retention_max_age_s / retention_max_bytes expire
        (the writer calls this when it opens and after every roll)."""
        return await self._expire(name, lambda segs, meta: policy.expired(
            segs, now_ms=now_ms(), max_age_s=meta.retention_max_age_s, max_bytes=meta.retention_max_bytes))

    async def _expire(self, name: str, choose: Any) -> list[int]:
        for attempt in range(_CAS_ATTEMPTS):
            meta = await self.stream_meta(name)
            segs = await self.segments(name)
            seqs = set(choose(segs, meta))
            try:
                await self._drop(name, [s for s in segs if s.seq in seqs])
                return sorted(seqs)
            except MetadataVersionError:
                if attempt == _CAS_ATTEMPTS - 1:
                    raise
        return []

    async def _drop(self, name: str, segs: list[Segment]) -> None:
        """Mark truncated (one multi-op), delete the ledgers, delete the nodes (one multi-op)."""
        if not segs:
            return
        marked = await self.bk.metadata_call(self.store.mark_truncated, self.name, name, segs)
        for s in marked:
            await self._delete_ledger(s.ledger_id)
        await self.bk.metadata_call(self.store.delete_segments, self.name, name, marked)
        log.info("stream %s/%s: deleted segments %s", self.name, name, [s.seq for s in marked])

    async def _delete_ledger(self, ledger_id: int) -> None:
        try:
            await self.bk.delete_ledger(ledger_id)
        except NoSuchLedgerError:
            pass
