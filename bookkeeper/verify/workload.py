"""The `bk verify run` workload: writers, tailing readers, takeovers and a stream, recorded.

Why this shape (Jepsen's): every operation is written to the history as an invocation before
it starts and a completion when it ends, and nothing is judged here; checker.py judges the
history afterwards. Roles, each a task on one uvloop loop, each with its own client where a
real deployment would have separate processes:

- writers `w<n>` on ledgers of their own (quorums from `ensembles`, taking turns): pipelined
  adds, at most `window` outstanding, rolling to a new ledger every `roll_entries` entries or
  `roll_s` seconds; a writer whose ledger fails (fenced by a takeover, or broken) moves on to
  a new ledger; metadata calls that fail retriably (ZooKeeper away) are retried;
- tailing readers `r<n>.<session>`: open a writer's current ledger without recovery and
  follow it (long-poll reads) for a few seconds, recording what they read and the LAC;
- takeovers: another client recovery-opens a writer's ledger mid-write (fencing it);
- stream writers `s<n>` (txids given, one stream each) and readers `sr<n>` following them;
- at the end, `final`: every ledger recovery-opened (closed ones just opened) and read back
  whole, retried while the cluster heals; every stream read from its start.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bookkeeper.client import BookKeeper, ReadHandle, WriteHandle
from bookkeeper.errors import BKError, NoSuchLedgerError
from bookkeeper.stream import Namespace
from bookkeeper.verify.checker import VerifyReport, check_history
from bookkeeper.verify.history import History, digest, payload, read_history, stream_payload
from bookkeeper.verify.nemesis import FaultExecutor, FaultStep, run_nemesis

PASSWORD = b"bk-verify"
NAMESPACE = "verify"
STALL_LIMIT_S = 120.0   # an add outstanding this long: the writer gives the ledger up (the stall is in the history)
READ_CHUNK = 500        # entries per read record of the final read-back
TAIL_FLUSH = 200        # entries per read record of a tailer
BACKOFF_S = (0.1, 2.0)  # retry pauses: the first, the most
NON_RETRIABLE_TRIES = 3  # of the read-back, for an error that says trying again will not help


def parse_ensembles(text: str) -> list[tuple[int, int, int]]:
    """`3/2/2,3/3/2` as [(3, 2, 2), (3, 3, 2)]; ValueError for anything else."""
    out: list[tuple[int, int, int]] = []
    for part in text.split(","):
        try:
            e, w, a = (int(x) for x in part.strip().split("/"))
        except ValueError:
            raise ValueError(f"ensemble {part.strip()!r} is not E/Qw/Qa (e.g. 3/2/2)") from None
        if not 1 <= a <= w <= e:
            raise ValueError(f"ensemble {part.strip()}: need 1 <= Qa <= Qw <= E")
        out.append((e, w, a))
    return out


@dataclass(frozen=True, slots=True)
class WorkloadOptions:
    seconds: float
    writers: int = 4
    ensembles: tuple[tuple[int, int, int], ...] = ((3, 2, 2), (3, 3, 2))
    tailers: int = 1
    streams: int = 1
    takeovers: bool = False
    takeover_every_s: float = 8.0
    window: int = 100
    rate: float | None = None  # adds per second over all writers (None: as fast as acknowledged)
    roll_entries: int = 10_000
    roll_s: float = 8.0
    tail_session_s: float = 4.0
    stream_batch: int = 20
    stream_pause_s: float = 0.05
    final_timeout_s: float = 180.0
    keep: bool = False  # leave the ledgers and streams behind (default: deleted once checked)
    seed: int = 0

    def validate(self) -> WorkloadOptions:
        if self.seconds <= 0:
            raise ValueError(f"seconds must be > 0, got {self.seconds}")
        if self.writers < 1 or self.tailers < 0 or self.streams < 0 or self.window < 1:
            raise ValueError("need writers >= 1, tailers >= 0, streams >= 0, window >= 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if not self.ensembles:
            raise ValueError("no ensembles given")
        return self


@dataclass(slots=True)
class WorkloadState:
    """What the roles share: the writers' current ledgers (tailers, takeovers and the local
    faults pick from them) and every ledger made."""

    current: dict[str, WriteHandle] = field(default_factory=dict)
    ledgers: list[int] = field(default_factory=list)
    streams: list[str] = field(default_factory=list)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)


class _Run:
    def __init__(self, uri: str, opts: WorkloadOptions, history: History, state: WorkloadState,
                 client: dict[str, Any]) -> None:
        self.uri = uri
        self.o = opts
        self.h = history
        self.s = state
        self.client = client
        self.nonce = secrets.token_hex(4)
        self.rng = random.Random(opts.seed)

    async def connect(self, seed: int) -> BookKeeper:
        return await BookKeeper.connect(self.uri, seed=seed, **self.client)

    # -- writers ---------------------------------------------------------------------
    async def writer(self, bk: BookKeeper, n: int) -> None:
        proc = f"w{n}"
        e, w, a = self.o.ensembles[n % len(self.o.ensembles)]
        while not self.s.stopping.is_set():
            lh = await self.retrying(proc, "create", None, lambda: bk.create_ledger(
                ensemble=e, write_quorum=w, ack_quorum=a, password=PASSWORD))
            if lh is None:  # failed for good (recorded): try again with a new ledger after a pause
                await _wait(self.s.stopping, BACKOFF_S[1])
                continue
            self.s.ledgers.append(lh.ledger_id)
            self.s.current[proc] = lh
            try:
                healthy = await self.fill(proc, lh)
            finally:
                self.s.current.pop(proc, None)
            if healthy:
                await self.retrying(proc, "close", lh.ledger_id, lh.close, end=lambda: lh.last_add_confirmed)

    async def retrying(self, proc: str, f: str, ledger_id: int | None, call: Any, *, end: Any = None) -> Any:
        """A metadata operation, retried while it fails retriably and the run goes on; None if it
        failed for good (or the run ended first)."""
        pause = BACKOFF_S[0]
        give_up = time.monotonic() + STALL_LIMIT_S
        while True:
            self.h.record(proc, "invoke", f, ledger_id=ledger_id)
            try:
                result = await call()
            except BKError as err:
                # A close goes on after the run's end (the writer ends its ledger while the last
                # fault heals); a create does not.
                again = (err.retriable and time.monotonic() < give_up
                         and (f == "close" or not self.s.stopping.is_set()))
                self.h.record(proc, "fail", f, ledger_id=ledger_id, error=_err(err), retry=again or None)
                if not again:
                    return None
                await asyncio.sleep(pause)
                pause = min(BACKOFF_S[1], pause * 2)
                continue
            lid = ledger_id if ledger_id is not None else getattr(result, "ledger_id", None)
            self.h.record(proc, "ok", f, ledger_id=lid, end=end() if end else None)
            return result if result is not None else True

    async def fill(self, proc: str, lh: WriteHandle) -> bool:
        """Pipelined adds until the roll, the end of the run, or a failure; whether the ledger is
        still writable (then the caller closes it)."""
        pending: list[tuple[int, asyncio.Future[int]]] = []
        head = 0
        nxt = 0
        started = time.monotonic()
        roll_at = started + self.o.roll_s
        lid = lh.ledger_id
        record = self.h.record
        per_s = self.o.rate / self.o.writers if self.o.rate else None
        while True:
            now = time.monotonic()
            writing = not self.s.stopping.is_set() and nxt < self.o.roll_entries and now < roll_at
            if writing and per_s is not None and head == len(pending) and nxt > per_s * (now - started):
                await asyncio.sleep(nxt / per_s - (now - started))  # paced, nothing in flight: until the next is due
                continue
            while writing and len(pending) - head < self.o.window and (per_s is None or nxt <= per_s * (now - started)):
                data = payload(self.nonce, lid, nxt, proc)
                record(proc, "invoke", "add", ledger_id=lid, entry_id=nxt, value=digest(data))
                try:
                    fut = lh.add_entry_async(data)
                except BKError as err:
                    record(proc, "fail", "add", ledger_id=lid, entry_id=nxt, error=_err(err))
                    return await self.drain(proc, lh, pending[head:], err)
                pending.append((nxt, fut))
                nxt += 1
            if head == len(pending):
                return True
            eid, fut = pending[head]
            try:
                async with asyncio.timeout(STALL_LIMIT_S):
                    await asyncio.shield(fut)
            except TimeoutError:
                return await self.drain(proc, lh, pending[head:], None)
            except BKError as err:
                return await self.drain(proc, lh, pending[head:], err)
            # The id the client gave (its payload was made for eid: a different one reads back as
            # `unexpected`), not the one this writer expected.
            record(proc, "ok", "add", ledger_id=lid, entry_id=fut.result())
            head += 1
            if head > 4 * self.o.window:  # keep the list short
                del pending[:head]
                head = 0

    async def drain(self, proc: str, lh: WriteHandle, rest: list[tuple[int, asyncio.Future[int]]],
                    err: BKError | None) -> bool:
        """The ledger failed (or stalled past STALL_LIMIT_S): settle what is outstanding in the
        history, each add as it ended, and give the ledger up."""
        for eid, fut in rest:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.h.record(proc, "ok", "add", ledger_id=lh.ledger_id, entry_id=fut.result())
            elif fut.done() and not fut.cancelled():
                self.h.record(proc, "fail", "add", ledger_id=lh.ledger_id, entry_id=eid, error=_err(fut.exception()))
            else:
                fut.add_done_callback(_consume)
                why = _err(err) if err is not None else f"stalled: no acknowledgement in {STALL_LIMIT_S:.0f}s"
                self.h.record(proc, "info", "add", ledger_id=lh.ledger_id, entry_id=eid, error=why)
        return False

    # -- takeovers -------------------------------------------------------------------
    async def takeovers(self, bk: BookKeeper) -> None:
        """Every takeover_every_s, recovery-open a writer's ledger that has entries. One that
        failed for a reason that may pass (ZooKeeper away, its session expired, a bookie down)
        is tried again after BACKOFF_S[1], not a whole period later: under a fault schedule a
        run would otherwise see few takeovers finish."""
        pause = self.o.takeover_every_s
        while not await _wait(self.s.stopping, pause):
            pause = self.o.takeover_every_s
            live = [lh for lh in self.s.current.values() if lh.last_add_confirmed >= 0]
            if not live:
                continue
            lid = self.rng.choice(live).ledger_id
            self.h.record("takeover", "invoke", "recover", ledger_id=lid)
            try:
                rh = await bk.open_ledger(lid, password=PASSWORD, recovery=True)
            except BKError as err:
                self.h.record("takeover", "fail", "recover", ledger_id=lid, error=_err(err))
                if err.retriable:
                    pause = BACKOFF_S[1]
                continue
            self.h.record("takeover", "ok", "recover", ledger_id=lid, end=rh.last_add_confirmed)

    # -- tailing readers -------------------------------------------------------------
    async def tailer(self, bk: BookKeeper, n: int) -> None:
        session = 0
        while not self.s.stopping.is_set():
            live = list(self.s.current.values())
            if not live:
                await _wait(self.s.stopping, 0.2)
                continue
            session += 1
            await self.tail_one(bk, f"r{n}.{session}", self.rng.choice(live).ledger_id)

    async def tail_one(self, bk: BookKeeper, proc: str, lid: int) -> None:
        """Follow one ledger for tail_session_s (or until it closes), recording reads and LACs."""
        try:
            rh = await bk.open_ledger(lid, password=PASSWORD, recovery=False)
        except BKError:
            return  # deleted or unreachable: another ledger next time (a tailer's open is no check)
        first = max(0, rh.last_add_confirmed - TAIL_FLUSH)
        values: list[str] = []

        def flush() -> None:
            nonlocal first, values
            if values:
                self.h.record(proc, "ok", "read", ledger_id=lid, entry_id=first, values=values)
                self.h.record(proc, "ok", "lac", ledger_id=lid, value=rh.last_add_confirmed)
                first += len(values)
                values = []
            self.h.record(proc, "invoke", "read", ledger_id=lid, entry_id=first)

        self.h.record(proc, "invoke", "read", ledger_id=lid, entry_id=first)
        try:
            with contextlib.suppress(TimeoutError, BKError):
                async with asyncio.timeout(self.o.tail_session_s):
                    async for entry in rh.tail(first):
                        values.append(digest(entry.data))
                        if len(values) >= TAIL_FLUSH:
                            flush()
        finally:  # also when the run cancels the tailer: what it read is in the history
            if values:
                flush()
            self.h.record(proc, "info", "read", ledger_id=lid, entry_id=first, error="session over")

    # -- streams ---------------------------------------------------------------------
    async def stream_writer(self, ns: Namespace, n: int, name: str) -> None:
        proc = f"s{n}"
        txid = 0
        while not self.s.stopping.is_set():
            try:
                writer = await ns.open_writer(name, segment_max_records=5000)
            except BKError as err:
                self.h.record(proc, "fail", "append", error=_err(err), retry=True)
                await _wait(self.s.stopping, 1.0)
                continue
            async with writer:
                while not self.s.stopping.is_set():
                    txids = list(range(txid, txid + self.o.stream_batch))
                    txid += len(txids)
                    datas = [stream_payload(self.nonce, name, t) for t in txids]
                    for t, d in zip(txids, datas):
                        self.h.record(proc, "invoke", "append", stream=name, txid=t, value=digest(d))
                    try:
                        positions = await writer.write_batch(datas, txids)
                    except BKError as err:
                        for t in txids:
                            self.h.record(proc, "fail", "append", stream=name, txid=t, error=_err(err))
                        break
                    for t, pos in zip(txids, positions):
                        self.h.record(proc, "ok", "append", stream=name, txid=t, position=str(pos))
                    await asyncio.sleep(self.o.stream_pause_s)

    async def stream_reader(self, ns: Namespace, proc: str, name: str, *, follow: bool,
                            deadline: float | None = None) -> None:
        """Read the stream from its start (following the writer, or to the current end). With a
        deadline (the read-back), errors are tried again as a ledger's read-back tries them
        (try_again), then given up on: what was not read is then reported lost, not waited for."""
        self.h.record(proc, "invoke", "stream_read", stream=name)
        start: Any = "earliest"
        tries = 0
        while True:
            reader = None
            try:
                reader = await ns.open_reader(name, start, follow=follow)
                async with reader:
                    async for rec in reader:
                        self.h.record(proc, "ok", "stream_read", stream=name, txid=rec.txid,
                                      value=digest(rec.data), position=str(rec.position))
                return
            except BKError as err:  # go on from where this reader was
                self.h.record(proc, "fail", "stream_read", stream=name, error=_err(err))
                tries += 1
                if deadline is not None and not try_again(err, tries, deadline):
                    return
                if reader is not None:
                    start = reader.position
                await asyncio.sleep(0.5)

    async def seal_stream(self, ns: Namespace, name: str) -> None:
        """Before a stream's read-back: take it over and close, which recovers (fences) an open
        last segment, so the read-back reads to what was acknowledged, not to a LAC the
        bookies were told earlier."""
        try:
            writer = await ns.open_writer(name)
            await writer.close()
        except BKError as err:  # the read-back then reads what it can, and says what it missed
            self.h.record("final", "info", "stream_seal", stream=name, error=_err(err))

    # -- the end ---------------------------------------------------------------------
    async def read_back(self, bk: BookKeeper, lid: int, deadline: float) -> None:
        """Recovery-open one ledger and read it all, trying again while the cluster heals."""
        rh = None
        tries = 0
        while rh is None:
            self.h.record("final", "invoke", "recover", ledger_id=lid)
            try:
                rh = await bk.open_ledger(lid, password=PASSWORD, recovery=True)
            except BKError as err:
                tries += 1
                self.h.record("final", "fail", "recover", ledger_id=lid, error=_err(err))
                if isinstance(err, NoSuchLedgerError) or not try_again(err, tries, deadline):
                    return
                await _healing(bk)
        end = rh.last_add_confirmed
        self.h.record("final", "ok", "recover", ledger_id=lid, end=end)
        for first in range(0, end + 1, READ_CHUNK):
            await self.read_chunk(bk, rh, first, min(end, first + READ_CHUNK - 1), deadline)

    async def read_chunk(self, bk: BookKeeper, rh: ReadHandle, first: int, last: int, deadline: float) -> None:
        """Entries first..last, tried again while the cluster heals; a chunk that still fails is
        read entry by entry, so the history says exactly which entries could not be read."""
        tries = 0
        while True:
            self.h.record("final", "invoke", "read", ledger_id=rh.ledger_id, entry_id=first)
            try:
                entries = await rh.read(first, last)
            except BKError as err:
                tries += 1
                self.h.record("final", "fail", "read", ledger_id=rh.ledger_id, entry_id=first, error=_err(err))
                if not try_again(err, tries, deadline):
                    break
                await _healing(bk)
                continue
            self.h.record("final", "ok", "read", ledger_id=rh.ledger_id, entry_id=first,
                          values=[digest(e.data) for e in entries])
            return
        for entry_id in range(first, last + 1):
            self.h.record("final", "invoke", "read", ledger_id=rh.ledger_id, entry_id=entry_id)
            try:
                entry = (await rh.read(entry_id, entry_id))[0]
            except BKError as err:
                self.h.record("final", "fail", "read", ledger_id=rh.ledger_id, entry_id=entry_id, error=_err(err))
                continue
            self.h.record("final", "ok", "read", ledger_id=rh.ledger_id, entry_id=entry_id, value=digest(entry.data))

    async def cleanup(self, bk: BookKeeper, ns: Namespace | None) -> None:
        """Delete what the run made (best effort: a user's cluster keeps no test data)."""
        for lid in self.s.ledgers:
            with contextlib.suppress(BKError):
                await bk.delete_ledger(lid)
        if ns is not None:
            for name in self.s.streams:
                with contextlib.suppress(BKError):
                    await ns.delete_stream(name)


def try_again(err: BKError, tries: int, deadline: float, *, now: float | None = None) -> bool:
    """Whether the read-back tries once more after `tries` failures ending with `err`.

    | err | until |
    |---|---|
    | retriable (a bookie or ZooKeeper away: the cluster may heal) | the deadline |
    | not retriable (an entry missing from its whole write set, ...) | NON_RETRIABLE_TRIES tries, or the deadline |
    """
    now = time.monotonic() if now is None else now
    return now < deadline and (err.retriable or tries < NON_RETRIABLE_TRIES)


async def _healing(bk: BookKeeper) -> None:
    """Between two tries of the read-back: a pause, then the registered bookies read again.

    Why read them again: a client reads its registrations only when it opens an open ledger or
    creates one, so a reader of closed ledgers keeps a view from before a bookie registered
    again (its session expired, say) and keeps failing with "not registered"; an operator's
    reader would reconnect. The failed tries stay in the history."""
    await asyncio.sleep(1.0)
    with contextlib.suppress(BKError):
        await bk.refresh_bookies()


def _err(err: BaseException | None) -> str:
    return f"{type(err).__name__}: {err}"


def _consume(fut: asyncio.Future[Any]) -> None:
    """An add given up on: its eventual error is not logged at garbage collection."""
    if not fut.cancelled():
        fut.exception()


async def _wait(event: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds` or until `event` is set; whether it was set."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def run_verify(metadata_uri: str, options: WorkloadOptions, *, history_path: Path | None = None,
                     faults: FaultExecutor | None = None, fault_steps: list[FaultStep] | None = None,
                     state: WorkloadState | None = None, client: dict[str, Any] | None = None) -> VerifyReport:
    """Run the workload for options.seconds under the fault steps, read everything back, and
    check the history (written to history_path, else to a temporary file removed after)."""
    opts = options.validate()
    state = state or WorkloadState()
    if history_path is None:  # a file all the same: a long run's history does not fit in memory
        with tempfile.TemporaryDirectory(prefix="bk-verify-") as tmp:
            report = await run_verify(metadata_uri, opts, history_path=Path(tmp) / "history.jsonl", faults=faults,
                                      fault_steps=fault_steps, state=state, client=client)
        report.history = None
        return report
    t0 = time.monotonic()
    with History(history_path) as hist:
        run = _Run(metadata_uri, opts, hist, state, dict(client or {}))
        hist.record("run", "info", "start", schema=1, nonce=run.nonce, seed=opts.seed)
        try:
            await _run_all(run, faults, fault_steps or [])
        finally:
            state.stopping.set()
            hist.record("run", "info", "end")
    started = time.monotonic()
    report = check_history(read_history(history_path))
    report.check_seconds = time.monotonic() - started
    report.seconds = time.monotonic() - t0
    report.history = str(history_path)
    return report


async def _run_all(run: _Run, faults: FaultExecutor | None, steps: list[FaultStep]) -> None:
    o, s = run.o, run.s
    writers_bk = await run.connect(o.seed * 4 + 1)
    others_bk = await run.connect(o.seed * 4 + 2)
    ns = await Namespace.connect(run.uri, NAMESPACE, password=PASSWORD, **run.client) if o.streams else None
    try:
        if ns is not None:
            for n in range(o.streams):
                name = f"verify-{run.nonce}-{n}"
                await ns.create_stream(name)
                s.streams.append(name)
        writers = [asyncio.create_task(run.writer(writers_bk, n)) for n in range(o.writers)]
        readers = [asyncio.create_task(run.tailer(others_bk, n)) for n in range(o.tailers)]
        if o.takeovers:
            writers.append(asyncio.create_task(run.takeovers(others_bk)))
        if ns is not None:
            for n, name in enumerate(s.streams):
                writers.append(asyncio.create_task(run.stream_writer(ns, n, name)))
                readers.append(asyncio.create_task(run.stream_reader(ns, f"sr{n}", name, follow=True)))
        nemesis = asyncio.create_task(run_nemesis(run.h, steps, faults, s.stopping)) if faults and steps else None
        try:
            await _wait(s.stopping, o.seconds)
        finally:
            s.stopping.set()
            if nemesis is not None:
                await _heal_even_if_cancelled(nemesis)  # the step under way heals before the read-back
            for t in readers:  # readers follow forever: they stop now; writers end their ledgers
                t.cancel()
            await _settle(writers + readers)
        deadline = time.monotonic() + o.final_timeout_s
        for lid in list(s.ledgers):
            await run.read_back(others_bk, lid, deadline)
        if ns is not None:
            for name in s.streams:
                await run.seal_stream(ns, name)
                await run.stream_reader(ns, "final", name, follow=False, deadline=deadline)
        if not o.keep:
            await run.cleanup(others_bk, ns)
    finally:
        if ns is not None:
            await ns.close()
        await others_bk.close()
        await writers_bk.close()


async def _heal_even_if_cancelled(nemesis: asyncio.Task[None]) -> None:
    """Wait for the fault schedule to end (it heals the step under way), also when this run is
    being cancelled (bk verify's second signal): an aborted run must not leave the cluster
    faulted. The cancellation is raised again once the schedule has ended."""
    cancelled = False
    while not nemesis.done():
        try:
            await asyncio.shield(nemesis)
        except asyncio.CancelledError:
            if nemesis.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    nemesis.result()


async def _settle(tasks: list[asyncio.Task[None]]) -> None:
    """Let the roles finish their current operation (writers close their ledgers); a role that
    does not finish within a minute is cancelled (its open operations end as info records)."""
    _, rest = await asyncio.wait(tasks, timeout=60.0)
    for t in rest:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
