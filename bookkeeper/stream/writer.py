"""The single writer of a stream: record sets into the open segment's ledger, rolls, takeover.

Why a lock *and* fencing: the lock (an ephemeral sequential znode, the newest one owns)
tells an old writer it lost the stream as soon as ZooKeeper does; fencing the old
writer's open segment at the bookies (a recovery open) is what makes it unable to add
even if it never hears about the lock. Adding a segment is a compare-and-set on the
stream node, so a writer that lost can never roll into a segment of its own either.

Lives in: the caller's event loop; ZooKeeper calls go through `BookKeeper.metadata_call`.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kazoo.protocol.states import EventType, KazooState, KeeperState, WatchedEvent

from bookkeeper.client.ledger import WriteHandle
from bookkeeper.errors import (BKError, ConfigError, InternalError, LedgerFencedError, MetadataVersionError,
                               StreamLockLostError, WriterClosedError)
from bookkeeper.meta.streams import Segment, StreamMeta, now_ms
from bookkeeper.stream import recordset
from bookkeeper.stream.core import MAX_RECORD_BYTES, RecordSet, Room, Seal, StreamWriterCore, Waiter
from bookkeeper.stream.position import Position

if TYPE_CHECKING:
    from bookkeeper.stream.namespace import Namespace

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WriterSettings:
    """open_writer's keyword arguments, validated once."""

    segment_max_records: int | None = None
    segment_max_bytes: int | None = 128 * 1024 * 1024
    segment_max_age_s: float | None = 3600.0
    record_set_max_bytes: int = 64 * 1024
    record_set_max_delay_ms: float = 2.0
    compression: str = "none"            # "none" | "zstd"
    lac_idle_flush_ms: float = 5.0       # an idle writer's last set becomes visible to tailers this soon
    max_inflight_bytes: int = 32 * 1024 * 1024
    takeover: bool = True                # False: wait until older writers are gone (hot standby)

    def validate(self) -> WriterSettings:
        for name in ("segment_max_records", "segment_max_bytes", "segment_max_age_s"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"{name} must be > 0 or None (off), got {v}")
        if not 0 < self.record_set_max_bytes <= MAX_RECORD_BYTES:
            raise ConfigError(f"record_set_max_bytes must be in 1..{MAX_RECORD_BYTES}, got {self.record_set_max_bytes}")
        if self.record_set_max_delay_ms < 0 or self.lac_idle_flush_ms < 0:
            raise ConfigError("record_set_max_delay_ms and lac_idle_flush_ms must be >= 0")
        if self.compression not in recordset.CODECS:
            raise ConfigError(f"compression must be one of {sorted(recordset.CODECS)}, got {self.compression!r}")
        if self.max_inflight_bytes < self.record_set_max_bytes:
            raise ConfigError("max_inflight_bytes must be >= record_set_max_bytes")
        return self


class StreamWriter:
    """Appends records to one stream; `await ns.open_writer(name)` makes one."""

    def __init__(self, ns: Namespace, name: str, settings: WriterSettings, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ns = ns
        self.name = name
        self._s = settings
        self._clock = clock
        self._loop = asyncio.get_running_loop()
        self._core = StreamWriterCore(name, settings)  # the decisions (bookkeeper/stream/core.py)
        self._lock_node = ""
        # Set by open() before any record is accepted: the stream node as this writer last
        # wrote it, and the current segment's ledger.
        self._meta: StreamMeta
        self._lh: WriteHandle
        self._timer: asyncio.TimerHandle | None = None
        self._control_timer: asyncio.TimerHandle | None = None
        self._inflight: set[asyncio.Future[int]] = set()
        self._room = asyncio.Event()
        self._waiting_room = False
        self._rolling: asyncio.Task[None] | None = None
        self._rewatch = False  # the lock watch was dropped with a connection: set it again when connected
        self._background: set[asyncio.Task[Any]] = set()

    # -- opening -----------------------------------------------------------------------
    async def _open(self) -> None:
        """Lock, recover the previous writer's open segment, start a new one."""
        ns, store = self._ns, self._ns.store
        self._ns.bk.store.zk.add_listener(self._on_zk_state)
        owner = f"{socket.gethostname()}:{os.getpid()}".encode()
        self._lock_node = await ns.bk.metadata_call(store.lock_create, ns.name, self.name, owner)
        try:
            await self._acquire()
            meta = await ns.stream_meta(self.name)
            self._meta = await ns.bk.metadata_call(store.bump_epoch, ns.name, meta)
            segments = await ns.segments(self.name)
            if segments and segments[-1].state == "open":
                segments[-1] = await ns.recover_segment(self.name, segments[-1])
            self._core.last_txid = next((s.last_txid for s in reversed(segments) if s.records > 0), -1)
            await self._start_segment()
        except BaseException:
            await self._release()
            raise
        self._spawn(ns.apply_retention(self.name))

    async def _acquire(self) -> None:
        """Own the lock: delete older writers' nodes (takeover) or wait for them to go."""
        ns, store = self._ns, self._ns.store
        mine = self._lock_node.rsplit("/", 1)[1]
        while True:
            holders = await ns.bk.metadata_call(store.lock_holders, ns.name, self.name)
            if mine not in holders:
                raise StreamLockLostError(f"stream {self.name!r}: a newer writer took the lock while this one opened")
            older = holders[:holders.index(mine)]
            if not older:
                break
            base = self._lock_node.rsplit("/", 1)[0]
            if self._s.takeover:
                for node in older:
                    if await ns.bk.metadata_call(store.lock_delete, f"{base}/{node}"):
                        log.info("stream %s: took over from writer %s", self.name, node)
                continue
            gone = asyncio.Event()
            watch = self._threadsafe(gone.set)
            if await ns.bk.metadata_call(store.lock_watch, f"{base}/{older[-1]}", watch):
                await gone.wait()
        watching = await ns.bk.metadata_call(store.lock_watch, self._lock_node, self._on_lock_event)
        if not watching:
            raise StreamLockLostError(f"stream {self.name!r}: this writer's lock node vanished")

    def _threadsafe(self, fn: Callable[[], None]) -> Callable[[WatchedEvent], None]:
        def call(_event: WatchedEvent) -> None:
            self._loop.call_soon_threadsafe(fn)
        return call

    def _on_lock_event(self, event: WatchedEvent) -> None:
        """kazoo thread: the lock node was deleted (a takeover), the session ended, or the
        connection dropped. On a dropped connection kazoo drops every watch, firing each with
        EventType.NONE in state CONNECTING; the session (and so the lock) may live on at
        another server: the watch is set again once connected, not taken for a lost lock."""
        if event.type == EventType.DELETED:
            why = "another writer took over (this writer's lock node is gone)"
        elif event.type == EventType.NONE and event.state == KeeperState.CONNECTING:
            self._loop.call_soon_threadsafe(self._lock_watch_dropped)
            return
        elif event.state in (KeeperState.EXPIRED_SESSION, KeeperState.AUTH_FAILED) or event.type == EventType.NONE:
            why = "the ZooKeeper session expired, so the lock is gone and another writer may own the stream"
        else:
            return  # a change of the node's data: not ours to act on
        err = StreamLockLostError(f"stream {self.name!r}: {why}; this writer writes no more")
        self._loop.call_soon_threadsafe(self._lock_lost, err)

    def _lock_watch_dropped(self) -> None:
        self._rewatch = True
        if not self._core.suspended:  # connected again before this ran
            self._spawn(self._watch_lock_again())

    async def _watch_lock_again(self) -> None:
        """The lock watch again after a reconnect: a lock node gone meanwhile (the session
        expired, or another writer took over) ends this writer, as the watch would have."""
        if not self._rewatch or self._core.closed or self._core.error is not None:
            return
        self._rewatch = False
        try:
            watching = await self._ns.bk.metadata_call(self._ns.store.lock_watch, self._lock_node, self._on_lock_event)
        except BKError:
            self._rewatch = True  # disconnected again: the next reconnect tries again
            if not self._core.suspended:  # or connected already (that reconnect has passed): try again soon
                self._loop.call_later(0.5, lambda: self._spawn(self._watch_lock_again()))
            return
        if not watching:
            self._lock_lost(StreamLockLostError(f"stream {self.name!r}: this writer's lock node vanished while "
                                                f"ZooKeeper was unreachable; this writer writes no more"))

    def _lock_lost(self, err: StreamLockLostError) -> None:
        if not self._core.closed:
            self._fail(err)

    def _on_zk_state(self, state: KazooState) -> None:
        """kazoo thread: pause on a lost connection, fail on an expired session, resume on reconnect."""
        if state == KazooState.LOST:
            err = StreamLockLostError(f"stream {self.name!r}: the ZooKeeper session expired, so the lock is gone "
                                      f"and another writer may own the stream; this writer writes no more")
            self._loop.call_soon_threadsafe(self._fail, err)
        else:
            self._loop.call_soon_threadsafe(self._set_suspended, state == KazooState.SUSPENDED)

    def _set_suspended(self, suspended: bool) -> None:
        """While ZooKeeper is unreachable no set is sent: the session may be expiring."""
        self._core.suspended = suspended
        if not suspended:
            if self._rewatch:
                self._spawn(self._watch_lock_again())
            self._maybe_seal()

    async def _start_segment(self) -> None:
        """A new ledger, and its segment added at the stream version this writer last wrote:
        fails (StreamLockLostError) if any other writer opened or rolled the stream since."""
        ns = self._ns
        lh = await ns.bk.create_ledger(ensemble=self._meta.ensemble, write_quorum=self._meta.write_quorum,
                                       ack_quorum=self._meta.ack_quorum, password=ns.password,
                                       custom_metadata={"stream": f"{ns.name}/{self.name}".encode()})
        try:
            seg = Segment(seq=self._meta.next_seq, ledger_id=lh.ledger_id, ctime_ms=now_ms())
            self._meta, seg = await ns.bk.metadata_call(ns.store.add_segment, ns.name, self._meta, seg)
        except MetadataVersionError as e:
            await self._drop_unused_ledger(lh.ledger_id)  # the add did not happen: the ledger is nobody's
            raise StreamLockLostError(f"stream {self.name!r} changed under this writer: another writer "
                                      f"owns it") from e
        except BaseException:
            # An unknown outcome (ZooKeeper lost the reply, or this task was cancelled): the
            # segment may be in the stream. The ledger goes only once a read says it is not:
            # a segment naming a deleted ledger stops every later writer and reader of the
            # stream (the simulator, seed 18 at 792fd97: a lost reply, then every open failed
            # NoSuchLedgerError). A segment that did land is the next writer's to close.
            if not await self._segment_names(lh.ledger_id):
                await self._drop_unused_ledger(lh.ledger_id)
            raise
        self._lh = lh
        self._core.segment_started(seg, self._clock())

    async def _segment_names(self, ledger_id: int) -> bool:
        """Whether a segment of the stream names ledger_id; True too when that cannot be read
        now (keeping an unused ledger costs little, deleting a used one breaks the stream)."""
        try:
            return any(s.ledger_id == ledger_id for s in await self._ns.segments(self.name))
        except BKError:
            return True

    async def _drop_unused_ledger(self, ledger_id: int) -> None:
        try:
            await self._ns.bk.delete_ledger(ledger_id)
        except BKError as e:  # ZooKeeper unreachable: the empty ledger stays (GC-able by an operator)
            log.info("stream %s: unused ledger %d not deleted: %s", self.name, ledger_id, e)

    # -- writing -------------------------------------------------------------------------
    async def write(self, data: bytes, txid: int | None = None) -> Position:
        """Append one record; returns its position once its entry is acknowledged."""
        return (await self._enqueue([data], None if txid is None else [txid]).fut)[0]

    async def write_batch(self, records: Sequence[bytes], txids: Sequence[int] | None = None) -> list[Position]:
        """Append records in order (sealed at once, no delay); their positions once all are acknowledged."""
        if not records:
            self._core.check_usable()
            return []
        waiter = self._enqueue(records, txids)
        self._seal_now()
        return await waiter.fut

    def _enqueue(self, records: Sequence[bytes], txids: Sequence[int] | None) -> Waiter:
        waiter = Waiter(self._loop.create_future(), len(records))
        if self._core.accept(records, txids, waiter) is Seal.NOW:
            self._seal_now()
        elif self._timer is None:
            self._timer = self._loop.call_later(self._s.record_set_max_delay_ms / 1000.0, self._seal_now)
        return waiter

    def _seal_now(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._maybe_seal()

    def _maybe_seal(self) -> None:
        """Send the sets the core seals, until it holds the rest (a roll, a ZooKeeper pause, a
        failure, the in-flight bound: they stay pending, in order)."""
        while True:
            step = self._core.next_set(self._lh.length)
            if step is None:
                return
            if step is Room.WAIT:
                if not self._waiting_room:
                    self._waiting_room = True
                    self._spawn(self._seal_when_room())
                return
            self._send_set(*step)

    def _send_set(self, batch: RecordSet, payload: bytes) -> None:
        try:
            fut = self._lh.add_entry_async(payload)
        except BKError as e:
            self._fail(e)
            batch.fail(e)
            return
        core = self._core
        assert core.segment is not None
        seq = core.segment.seq
        reason = core.sent(batch, len(payload), now=self._clock(), ledger_length=self._lh.length)
        self._track(fut, len(payload))
        fut.add_done_callback(lambda f: self._on_set_done(f, seq, batch))
        if reason is not None:
            log.debug("stream %s: rolling segment %d (%s)", self.name, seq, reason.value)
            core.rolling = True
            self._rolling = self._loop.create_task(self._roll())
            self._rolling.add_done_callback(self._roll_done)

    async def _seal_when_room(self) -> None:
        try:
            while self._core.full and self._core.error is None:
                self._room.clear()
                await self._room.wait()
        finally:
            self._waiting_room = False
        self._maybe_seal()

    def _track(self, fut: asyncio.Future[int], size: int) -> None:
        """An entry sent (a set or a control entry): the core settles it once answered."""
        self._inflight.add(fut)

        def done(f: asyncio.Future[int]) -> None:
            self._inflight.discard(f)
            self._room.set()
            exc = (WriterClosedError("the add was cancelled: the writer closed") if f.cancelled()
                   else f.exception())
            err = self._core.settled(size, exc)
            if err is not None:
                self._fail(err)
            elif self._core.idle:
                self._arm_control()
        fut.add_done_callback(done)

    def _on_set_done(self, fut: asyncio.Future[int], seq: int, batch: RecordSet) -> None:
        if fut.cancelled() or fut.exception() is not None:
            batch.fail(self._core.set_failed(None if fut.cancelled() else fut.exception()))
            return
        batch.acked(seq, fut.result())

    # -- LAC for tailing readers ----------------------------------------------------------
    def _arm_control(self) -> None:
        if self._control_timer is None:
            self._control_timer = self._loop.call_later(self._s.lac_idle_flush_ms / 1000.0, self._send_control)

    def _send_control(self) -> None:
        """The writer went idle: one control entry carries the LAC of the last set to the bookies.

        Apache BookKeeper's LAC travels on the next add; without one, tailing readers would
        not see an idle writer's last records until it wrote again.
        """
        self._control_timer = None
        payload = self._core.control()
        if payload is None:
            return
        try:
            fut = self._lh.add_entry_async(payload)
        except BKError as e:
            self._fail(e)
            return
        self._core.control_sent(len(payload))
        self._track(fut, len(payload))

    # -- rolling -------------------------------------------------------------------------
    async def _roll(self) -> None:
        """Close the current segment, then add the next: no gap a reader could see as loss."""
        await self._close_segment()
        await self._start_segment()
        self._spawn(self._ns.apply_retention(self.name))

    def _roll_done(self, task: asyncio.Task[None]) -> None:
        self._rolling = None
        self._core.rolling = False
        if not task.cancelled() and task.exception() is not None:
            err = task.exception()
            self._fail(err if isinstance(err, BKError) else InternalError(f"segment roll failed: {err!r}"))
            return
        self._maybe_seal()

    async def _close_segment(self) -> None:
        """Wait for the sets in flight, close the ledger, then close the segment (CAS)."""
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
        if self._control_timer is not None:
            self._control_timer.cancel()
            self._control_timer = None
        core = self._core
        if core.error is not None:
            raise core.error
        lh, seg = self._lh, core.segment
        assert seg is not None
        await lh.close()
        closed = core.segment_closed(lh.last_add_confirmed, lh.length, now_ms())
        if closed is None:
            await self._ns.retire_segment(self.name, seg)
            return
        core.segment = await self._ns.bk.metadata_call(self._ns.store.update_segment, self._ns.name, self.name,
                                                       closed)

    # -- failing and closing ---------------------------------------------------------------
    def _fail(self, err: BKError) -> None:
        """The writer is done: pending and future writes fail with err (in-flight sets settle as
        the bookies answer: an acknowledged one is durable and reported so)."""
        if self._core.error is None:
            log.info("stream %s: writer stopped: %s", self.name, err)
        self._core.fail(err).fail(err)
        self._room.set()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = self._loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("stream %s: background task failed: %s", self.name, task.exception())

    async def flush(self) -> None:
        """Send what is pending now and wait for everything sent to be acknowledged."""
        self._seal_now()
        while self._rolling is not None or self._inflight or self._core.pending.records:
            if self._rolling is not None:
                await asyncio.gather(self._rolling, return_exceptions=True)
            if self._inflight:
                await asyncio.gather(*self._inflight, return_exceptions=True)
            self._seal_now()
            if self._core.error is not None:
                break
        self._core.check_usable()

    async def close(self) -> None:
        """Flush, close the segment and release the lock. A fenced writer closes quietly."""
        core = self._core
        if core.closed:
            return
        try:
            if core.error is None:
                await self.flush()
                await self._close_segment()
        except LedgerFencedError:
            pass
        finally:
            core.closed = True
            for t in (self._timer, self._control_timer):
                if t is not None:
                    t.cancel()
            await self._release()
            if core.error is None:
                core.error = WriterClosedError(f"the writer of stream {self.name!r} is closed")

    async def _release(self) -> None:
        self._ns.bk.store.zk.remove_listener(self._on_zk_state)
        if self._background:  # a retention pass finishes rather than leave segments half-deleted
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._lock_node:
            try:
                await self._ns.bk.metadata_call(self._ns.store.lock_delete, self._lock_node)
            except BKError as e:
                log.info("stream %s: could not delete lock node (%s); it goes with the session", self.name, e)

    async def __aenter__(self) -> StreamWriter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def last_txid(self) -> int:
        """The txid of the last record accepted (written or pending)."""
        return self._core.last_txid

    @property
    def segment(self) -> Segment | None:
        return self._core.segment

    @property
    def error(self) -> BKError | None:
        """Why the writer stopped (None while it writes): every later call raises it."""
        return self._core.error
