"""The simulated cluster: bookies, ZooKeeper, clients and their workload, faults, in one
thread on virtual time (see bookkeeper/testing/sim/__init__.py for what runs for real).

Bookies are the production shard parts (`ShardServer` with its C `AddPath`, `Journal`,
`LedgerStorage` on real files in a temporary directory) over a `SimSyncer`; their start
is the shard's (replay from the checkpoint mark, `apply_records`, a checkpoint, then
listen) and their checkpoints are `bookkeeper.bookie.shard.checkpoint`. Clients are
`BookKeeper` over `ZkMetadataStore` over the simulated ZooKeeper, with the loop's clock.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import os
import random
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bookkeeper.bookie.gc import GarbageCollector, GcSettings
from bookkeeper.bookie.journal.journal import Journal
from bookkeeper.bookie.server import BookieProtocol, ShardServer
from bookkeeper.bookie.shard import apply_records, checkpoint
from bookkeeper.bookie.storage.ledger_storage import LedgerStorage
from bookkeeper.client.client import BookKeeper
from bookkeeper.client.config import ClientConfig
from bookkeeper.client.core.quorum import write_set
from bookkeeper.errors import BKError, StreamExistsError
from bookkeeper.meta.ledger_metadata import LedgerMetadata, LedgerState
from bookkeeper.meta.zk import ZkMetadataStore, ledger_path
from bookkeeper.proto import shard_for_ledger
from bookkeeper.stream.namespace import Namespace
from bookkeeper.stream.reader import StreamReader
from bookkeeper.testing.sim.disk import SimSyncer
from bookkeeper.testing.sim.loop import SimLoop
from bookkeeper.testing.sim.net import NODE, SimNetwork, SimTransport
from bookkeeper.testing.sim.oracle import KEEP_LIMIT_ZK_TROUBLE_S, LedgerTruth, Oracle, Violation
from bookkeeper.testing.sim.zk import SimZooKeeper
from bookkeeper.testing.syncers import InlineExecutor

URI = "zk://sim:2181/ledgers"
ROOT = "/ledgers"
# Entry logs roll at 64 KiB so a run has rolled logs for compaction to work on; GC passes
# every 0.5-1.5 s, a minor compaction due each second, a major one every 5.
ENTRY_LOG_BYTES = 64 << 10
GC_SETTINGS = GcSettings(minor_threshold=0.2, minor_interval_s=1.0, major_threshold=0.8, major_interval_s=5.0)
PASSWORD = b"sim"
WALL_EPOCH = 1.8e9  # the wall clock's reading at virtual time 0 (token expiry reads wall time)
# How often each fault kind is drawn (kinds of _faults, in order): ZooKeeper's are rarer, as a
# writer cut from it cannot replace a failed bookie for seconds, which hides other faults.
KIND_WEIGHTS = (3, 3, 3, 3, 3, 3, 1, 1, 2, 2, 2)
ADD_TIMEOUT_S = 0.5  # the clients' add timeout: the network's delays are well under a millisecond
STREAM = "s"
STREAM_NODES = ("streamer0", "streamer1", "streamreader")  # two writers taking a stream from each other, a reader
STALL_S = 30.0  # no progress this long (virtual): faults stop; this long again after that: `stuck`
QUORUMS = [(3, 2, 2)] * 4 + [(3, 3, 2), (4, 3, 2), (3, 3, 3), (5, 3, 2), (2, 2, 1), (4, 2, 2)]


@dataclass(frozen=True)
class SimConfig:
    """One run's shape, all of it drawn from the seed (or the default profile)."""

    seed: int
    ops: int
    bookies: int = 5
    shards: int = 1
    ensemble: int = 3
    write_quorum: int = 2
    ack_quorum: int = 2
    writers: int = 2
    faults: bool = True
    fault_gap_s: float = 0.1  # mean virtual time between fault injections
    zk_loss_rate: float = 0.01
    zk_reply_loss_rate: float = 0.01
    max_down: int = 1  # bookies down at once, at most
    add_rate: float = 1000.0  # adds per (virtual) second, per writer, on average
    streams: bool = True  # two stream writers taking a stream from each other, and its reader

    @classmethod
    def default(cls, seed: int, ops: int, *, faults: bool = True) -> SimConfig:
        """The benchmark profile: 3/2/2 on 5 bookies of one shard, two ledger writers, faults on;
        no stream (its figure is CPU per ledger add, comparable from run to run)."""
        return cls(seed=seed, ops=ops, faults=faults, streams=False)

    @classmethod
    def from_seed(cls, seed: int, ops: int, *, faults: bool = True) -> SimConfig:
        rng = random.Random(f"config:{seed}")
        e, qw, qa = rng.choice(QUORUMS)
        return cls(seed=seed, ops=ops, bookies=e + rng.randint(1, 3), shards=rng.choice((1, 1, 2)),
                   ensemble=e, write_quorum=qw, ack_quorum=qa, writers=rng.randint(1, 3), faults=faults,
                   fault_gap_s=rng.choice((0.05, 0.1, 0.3)), zk_loss_rate=rng.choice((0.0, 0.01, 0.05)),
                   zk_reply_loss_rate=rng.choice((0.0, 0.01, 0.05)), max_down=rng.choice((1, 1, 2)),
                   add_rate=rng.choice((300.0, 1000.0, 3000.0)))

    def describe(self) -> str:
        return (f"E/Qw/Qa {self.ensemble}/{self.write_quorum}/{self.ack_quorum}, {self.bookies} bookies x "
                f"{self.shards} shard(s), {self.writers} writer(s){', a stream' if self.streams else ''}, "
                f"faults {'on' if self.faults else 'off'}"
                f"{f' (every ~{self.fault_gap_s} s, up to {self.max_down} bookie(s) down)' if self.faults else ''}")


class Trace:
    """The run's story, a line per event, stamped with virtual time: compared byte for byte
    between runs of one seed; the last lines are shown with a violation."""

    def __init__(self, loop: asyncio.AbstractEventLoop, keep_all: bool) -> None:
        self.loop = loop
        self.lines: list[str] | None = [] if keep_all else None
        self.tail: deque[str] = deque(maxlen=50)
        self.count = 0

    def __call__(self, line: str) -> None:
        text = f"{self.loop.time():12.6f} {NODE.get():9} {line}"
        self.count += 1
        self.tail.append(text)
        if self.lines is not None:
            self.lines.append(text)


class SimShard:
    """One shard of a simulated bookie: the production parts, a simulated journal device."""

    def __init__(self, bookie: SimBookie, index: int) -> None:
        self.bookie = bookie
        self.index = index
        self.dir = bookie.dir / f"shard{index}"
        self.port = 3181 + index
        self.storage: LedgerStorage | None = None
        self.server: ShardServer | None = None
        self.journal: Journal | None = None
        self.syncer: SimSyncer | None = None
        self.last_syncer: SimSyncer | None = None  # the device of the incarnation that crashed
        self.last_mark = (0, 0)  # its checkpoint mark: replay starts there
        self.gc: GarbageCollector | None = None
        self._checkpointing = asyncio.Lock()  # the periodic checkpoint and GC's never overlap

    async def start(self) -> None:
        w = self.bookie.world
        loop = w.loop
        self.storage = storage = LedgerStorage(self.dir / "ledgers", map_size=1 << 26,
                                               entry_log_max_bytes=ENTRY_LOG_BYTES)
        self.server = ShardServer(storage=self.storage, shard_index=self.index, shards=w.cfg.shards,
                                  max_frame_bytes=5 << 20, readonly=False, data_dir=str(self.dir / "ledgers"),
                                  clock=loop.time, wall_clock=lambda: WALL_EPOCH + loop.time())
        self.syncer = SimSyncer(loop, w.rng_for(f"disk:{self.bookie.name}:{self.index}:{self.bookie.starts}"),
                                ack_before_sync=w.mutation == "ack-before-fsync")
        self.journal = Journal(self.dir / "journal", syncer=self.syncer, loop=loop,
                               on_durable=self.server.on_durable, on_failed=self._failed,
                               preallocate_bytes=256 << 10, file_max_bytes=1 << 20, reuse_files=2,
                               clock=loop.time, spare_filler=InlineExecutor())
        self.server.journal = self.journal
        self.journal.replay(storage.checkpoint_mark(), lambda recs: apply_records(storage, recs))
        self.journal.start()
        await checkpoint(loop, self.storage, self.journal, self.server)
        self.gc = GarbageCollector(self.index, storage, loop, store=lambda: self.bookie.store,
                                   checkpoint=self.checkpoint, settings=GC_SETTINGS, clock=loop.time,
                                   wall_clock=lambda: WALL_EPOCH + loop.time(), should_stop=lambda: False, counters=collections.Counter(),
                                   observe_duration=lambda _s: None)
        server = self.server
        w.net.listen(self.bookie.name, self.bookie.name, self.port, lambda: BookieProtocol(server))

    def _failed(self, items: list[Any], err: OSError) -> None:
        """As the shard process: the items fail, and the shard takes no more adds."""
        assert self.server is not None
        self.server.on_failed(items, err)
        if not self.server.readonly:
            self.server.readonly = True
            self.server.readonly_reason = f"journal failed: {err}"
            self.bookie.world.trace(f"{self.bookie.id} shard {self.index}: journal failed ({err}), read-only")

    async def checkpoint(self) -> None:
        """A checkpoint started after this call, run to its commit (after one running now)."""
        async with self._checkpointing:
            if self.storage is not None and self.journal is not None and self.server is not None:
                await checkpoint(self.bookie.world.loop, self.storage, self.journal, self.server)

    def crash(self, torn: bool) -> int:
        n = 0
        if self.gc is not None and self.gc.compacting is not None:
            self.gc.compacting.cancel()  # a compaction not started yet dies with the process
        self.gc = None
        if self.syncer is not None:
            n = self.syncer.crash() if torn else 0
            self.syncer.close()
        if self.journal is not None:
            self.journal.close()
        if self.storage is not None:
            self.last_mark = self.storage.checkpoint_mark()
            self.storage.close()
        self.last_syncer = self.syncer
        self.storage = self.server = self.journal = self.syncer = None
        return n


class SimBookie:
    """A bookie: its shards, its ZooKeeper session and registration, its periodic checkpoint."""

    def __init__(self, world: World, i: int) -> None:
        self.world = world
        self.name = f"bookie{i}"
        self.id = f"{self.name}:3181"
        self.dir = world.dir / self.name
        self.shards = [SimShard(self, s) for s in range(world.cfg.shards)]
        self.up = False
        self.broken = False  # refused to start: stays down
        self.rotted = False  # a synced block of its journal was damaged (the loss budget)
        self.starts = 0
        self.store: ZkMetadataStore | None = None
        self.tasks: list[asyncio.Task[Any]] = []
        self._starting = asyncio.Lock()

    async def ensure_up(self) -> None:
        """Start unless up (a fault's restart and the final heal may both ask)."""
        async with self._starting:
            if self.up or self.broken:
                return
            try:
                await self.start()
            except (BKError, OSError) as e:
                self.broken = True
                why = str(e).replace(str(self.world.dir), "<sim>")
                if self.rotted:
                    # The budget spent: its journal was damaged on purpose; it stays down (an
                    # operator would replace its disks and decommission it).
                    self.world.trace(f"{self.id} refuses to start on its damaged journal: it stays down")
                    return
                # Synced bytes are damaged only by `rot` (disk.py), so a bookie that refuses to
                # start otherwise acknowledged what it had not made durable, or its replay is wrong.
                self.world.oracle.fail("refused-start", f"{self.id} does not start again: {why}")

    def info(self) -> dict[str, Any]:
        return {"bookie_id": self.id, "rack": "/default-rack", "readonly": False,
                "shards": [{"host": self.name, "port": s.port} for s in self.shards], "http_port": 0, "pid": 0}

    async def start(self) -> None:
        w = self.world
        self.starts += 1
        try:
            for shard in self.shards:
                await shard.start()
        except BaseException:
            self.world.net.crash(self.name)  # a shard that listened already stops
            for shard in self.shards:
                shard.crash(torn=False)  # what opened closes: the next start opens it again
            raise
        if self.starts > 1:
            # A deleted ledger's entries may be gone (garbage collection): not a loss.
            w.oracle.restarted(self.id, lambda lid, eid: self._holds(lid, eid) or not w.has_metadata(lid))
            for (bookie, ledger_id) in sorted(w.oracle.fenced):
                if bookie == self.id and w.has_metadata(ledger_id) and not self._fenced(ledger_id):
                    w.oracle.fail("fence-lost", f"{self.id} answered a fence for ledger {ledger_id} but holds it "
                                  f"unfenced after its restart")
        while self.store is None:
            client = w.zk.client(self.name, w.zk_partitioned)
            try:
                self.store = ZkMetadataStore(URI, client=client, create=True)
            except Exception as e:  # noqa: BLE001 - ZooKeeper trouble at start: the supervisor tries again
                client.stop()
                w.trace(f"{self.id} cannot reach ZooKeeper at start ({type(e).__name__}): retry")
                await asyncio.sleep(0.2)
        self.store.zk.add_listener(self._session)
        await self._register()
        self.up = True
        self.rotted = False  # started anyway: the damage was not where replay reads
        self.tasks = [w.spawn(self.name, self._checkpoints()), w.spawn(self.name, self._collect())]
        w.trace(f"{self.id} up (start {self.starts})")

    def _shard_of(self, ledger_id: int) -> SimShard:
        return self.shards[shard_for_ledger(ledger_id, len(self.shards))]

    def _holds(self, ledger_id: int, entry_id: int) -> bool:
        storage = self._shard_of(ledger_id).storage
        return storage is not None and storage.get_entry(ledger_id, entry_id) is not None

    def _fenced(self, ledger_id: int) -> bool:
        storage = self._shard_of(ledger_id).storage
        st = storage.ledger(ledger_id) if storage is not None else None
        return st is not None and bool(st.fenced)

    def _session(self, state: Any) -> None:
        if str(state) == "CONNECTED" and self.up:
            self.tasks.append(self.world.spawn(self.name, self._register()))

    async def _register(self) -> None:
        while self.store is not None:
            try:
                await self.world.loop.run_in_executor(None, self.store.register_bookie, self.id, self.info())
                return
            except Exception as e:  # noqa: BLE001 - ZooKeeper trouble: try again, as the supervisor does
                self.world.trace(f"{self.id} registration failed ({type(e).__name__}): retry")
                await asyncio.sleep(0.2)

    async def _checkpoints(self) -> None:
        rng = self.world.rng_for(f"checkpoint:{self.name}:{self.starts}")
        while True:
            await asyncio.sleep(rng.uniform(0.2, 0.8))
            for shard in self.shards:
                try:
                    await shard.checkpoint()
                except Exception as e:  # noqa: BLE001 - as the shard's: logged, retried next time
                    self.world.trace(f"{self.id} checkpoint failed: {e}")

    async def _collect(self) -> None:
        """Garbage collection passes, as a shard's (every 0.5-1.5 s here): ledgers deleted from
        the metadata are dropped, entry logs compacted. A ledger dropped while its metadata
        exists is the violation gc-dropped-live."""
        w = self.world
        rng = w.rng_for(f"gc:{self.name}:{self.starts}")
        while True:
            await asyncio.sleep(rng.uniform(0.5, 1.5))
            for shard in self.shards:
                if shard.gc is None:
                    continue
                gc = shard.gc
                try:
                    result = await gc.run()
                except Exception as e:  # noqa: BLE001 - as the shard's: logged, tried again next pass
                    w.trace(f"{self.id} gc pass failed: {type(e).__name__}")
                    result = None
                for lid in gc.last_dropped:  # dropped even if the pass failed after (its checkpoint)
                    w.oracle.checks += 1
                    if w.has_metadata(lid):
                        w.oracle.fail("gc-dropped-live", f"{self.id} garbage-collected ledger {lid}, whose metadata "
                                      f"exists")
                if result and (result["ledgers_deleted"] or result["logs_compacted"] or result["logs_deleted"]):
                    w.trace(f"{self.id} gc: {result['ledgers_deleted']} ledger(s) dropped, "
                            f"{result['logs_compacted']} log(s) compacted, {result['logs_deleted']} deleted")

    def rot(self) -> None:
        """Damage a synced block of one shard's journal (while down, after crash)."""
        for shard in self.shards:
            mark = shard.last_mark

            def replayed(path: str, offset: int, mark: tuple[int, int] = mark) -> bool:
                file_id = int(os.path.basename(path).split(".")[0], 16)
                return (file_id, offset) >= mark
            path = shard.last_syncer.rot(replayed) if shard.last_syncer is not None else None
            if path is not None:
                self.rotted = True
                self.world.trace(f"{self.id} journal block damaged in {os.path.basename(path)}")
                self.world.faults["rot"] = self.world.faults.get("rot", 0) + 1
                return

    def crash(self, torn: bool) -> None:
        w = self.world
        self.up = False
        for t in self.tasks:
            t.cancel()
        w.net.crash(self.name)
        torn_writes = sum(s.crash(torn) for s in self.shards)
        if self.store is not None:
            self.store.zk.stop()  # the session ends (at once: its timeout is not simulated)
            self.store = None
        w.trace(f"{self.id} crashed ({'power loss, ' + str(torn_writes) + ' unsynced write(s) torn' if torn else 'process'})")


@dataclass
class Writer:
    name: str
    bk: BookKeeper | None = None
    adds: int = 0
    handle: Any = None  # the write handle it adds to now


@dataclass
class LateAdds:
    """A recovery racing a writer's late adds (apache/bookkeeper#2614's order, `_late_adds`)."""

    writer: str
    victim: str  # the bookie whose fence is lost (the writer's adds to it are held)
    until: float  # when those adds arrive
    sent: asyncio.Event = field(default_factory=asyncio.Event)  # an add of it reached another bookie of the ensemble


@dataclass
class Result:
    """What a run did."""

    config: SimConfig
    violation: Violation | None
    acked: int
    adds: int
    ledgers: int
    closed: int
    recoveries: int
    reads: int
    tails: int
    deleted: int
    stream_acked: int
    faults: dict[str, int]
    sim_seconds: float
    trace_lines: int
    trace_tail: list[str]
    stats: dict[str, Any] = field(default_factory=dict)


class World:
    """One seeded run."""

    def __init__(self, cfg: SimConfig, loop: SimLoop, directory: Path, *, mutation: str | None = None,
                 keep_trace: bool = False) -> None:
        self.cfg = cfg
        self.loop = loop
        self.dir = directory
        self.mutation = mutation
        self.rng = random.Random(f"world:{cfg.seed}")
        self.trace = Trace(loop, keep_trace)
        self.oracle = Oracle()
        self.oracle.on_violation = self._snapshot
        self._violation_tail: list[str] = []
        self.net = SimNetwork(loop, self.rng_for("net"))
        loop.node_var = NODE  # what a paused node is (loop.pause)
        self.zk = SimZooKeeper(loop, self.rng_for("zk"))
        self.zk.on_write = self._metadata_written
        self.oracle.on_recovery_add = self._recovery_add
        self.oracle.on_fence = self._fence_arrives
        self.oracle.on_read = self._read_arrives
        self.oracle.on_add = self._add_arrives
        self.zk_cut: set[str] = set()
        self.bookies = [SimBookie(self, i) for i in range(cfg.bookies)]
        self.writers = [Writer(f"writer{i}") for i in range(cfg.writers)]
        self.open_ledgers: dict[int, str] = {}  # ledger -> its writer, while it writes
        self._ensembles: dict[int, list[str]] = {}  # ledger -> its first ensemble
        self._segments: dict[int, dict[int, list[str]]] = {}  # ledger -> its writer's segments, as last written
        self._chaos = self.rng_for("recovery-chaos")
        self._dying: Any = None  # the running recovery's asyncio.timeout: its client may die early
        self._recoverer_died = False
        self._interrupted: int | None = None  # the ledger whose recovery died last
        self._left_segment = False  # that recovery died just after writing an ensemble change of its own
        self._fences_to_lose: dict[int, set[str]] = {}  # ledger -> bookies its recovery's fences will not reach
        self._late: dict[int, LateAdds] = {}  # ledger -> the race its recovery runs against late adds (#2614)
        # ledger -> (the entry, or None: the first read) and the bookies whose answers to its
        # recovery's read of it come late
        self._slow_reads: dict[int, tuple[int | None, set[str]]] = {}
        self.faults: dict[str, int] = {}
        self.done = False
        self.healed = False
        self._fault_tasks: list[asyncio.Task[Any]] = []
        self.counts = {"adds": 0, "acked": 0, "ledgers": 0, "closed": 0, "recoveries": 0, "reads": 0, "tails": 0,
                       "deleted": 0, "stream_records": 0, "stream_acked": 0}
        self._tasks: list[asyncio.Task[Any]] = []
        self.clients: list[BookKeeper] = []
        exec_rng = self.rng_for("executor")
        loop.executor_delay = lambda _fn: exec_rng.uniform(200e-6, 2e-3)
        loop.set_exception_handler(self._unhandled)

    def _snapshot(self) -> None:
        """The trace's last lines as the violation happens (the run goes on a little while it
        stops: what follows is not the story)."""
        self._violation_tail = list(self.trace.tail)

    def rng_for(self, what: str) -> random.Random:
        """An independent stream per part, so that a change in one part's draws does not
        reshuffle every other part's (a seed stays comparable across small changes)."""
        return random.Random(f"{what}:{self.cfg.seed}")

    def _keep_limit(self, since: float, node: str) -> float:
        """How long `node` may keep sending a ledger's adds to a bookie that has answered none
        since `since`: longer when one of its ZooKeeper calls failed meanwhile (its ensemble
        change then waits and retries)."""
        troubled = self.zk.last_trouble.get(node, -1.0) >= since or node in self.zk_cut
        return KEEP_LIMIT_ZK_TROUBLE_S if troubled else ADD_TIMEOUT_S + 0.5

    def zk_partitioned(self, node: str) -> bool:
        return node in self.zk_cut

    def spawn(self, node: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """A task of node (the network and ZooKeeper see its calls as node's)."""
        ctx = contextvars.copy_context()
        ctx.run(NODE.set, node)
        task: asyncio.Task[Any] = self.loop.create_task(coro, context=ctx)
        self._tasks.append(task)
        return task

    def _check_tasks(self, tasks: Any) -> None:
        """A task of the simulation that ended by an exception is a finding, not noise."""
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                self.oracle.fail("unhandled-exception", f"a {t.get_coro().__qualname__} task failed: "
                                 f"{t.exception()!r}")

    def _unhandled(self, loop: Any, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if exc is None or isinstance(exc, (BKError, ConnectionError, asyncio.CancelledError)):
            return
        self.oracle.fail("unhandled-exception", f"{context.get('message')}: {exc!r}")

    # -- the run ---------------------------------------------------------------------
    async def main(self) -> None:
        self.trace(f"seed {self.cfg.seed}: {self.cfg.describe()}" + (f", mutation {self.mutation}" if self.mutation else ""))
        self._tap_bookies()
        for b in self.bookies:
            await self._in(b.name, b.start())
        for w in self.writers:
            w.bk = await self._in(w.name, self._client(w.name))
        recovering = await self._in("recoverer", self._client("recoverer"))
        reading = await self._in("reader", self._client("reader"))
        tailing = await self._in("tailer", self._client("tailer"))
        streaming = [await self._in(n, self._client(n)) for n in STREAM_NODES] if self.cfg.streams else []
        self._calm_zk()  # ZooKeeper's background losses start once every client is connected
        work = [self.spawn(w.name, self._write(w)) for w in self.writers]
        side = [self.spawn("recoverer", self._recoverer(recovering)), self.spawn("reader", self._reader(reading)),
                self.spawn("tailer", self._tailer(tailing))]
        if streaming:
            side += [self.spawn(n, self._stream_writer(bk, n)) for n, bk in zip(STREAM_NODES[:2], streaming)]
            side.append(self.spawn(STREAM_NODES[2], self._stream_reader(streaming[2])))
        if self.cfg.faults:
            self._fault_tasks.append(self.spawn("faults", self._faults()))
        pending = set(work)
        progress, since = -1, self.loop.time()
        while pending and self.oracle.violation is None:
            done, pending = await asyncio.wait(pending, timeout=1.0)
            self._check_tasks(done)
            if self.counts["acked"] + self.counts["ledgers"] != progress:
                progress, since = self.counts["acked"] + self.counts["ledgers"], self.loop.time()
            elif self.loop.time() - since > STALL_S:
                if self.healed:
                    self.oracle.fail("stuck", f"no add acknowledged and no ledger created for {STALL_S:.0f} s "
                                     f"after every fault healed ({self.counts['acked']} acknowledged so far)")
                    break
                self.trace(f"no progress for {STALL_S:.0f} s: faults stop and heal")
                await self.heal()
                since = self.loop.time()
        self.done = True
        for t in side + self._fault_tasks[:1]:
            t.cancel()  # the injector; a restart under way finishes
        await asyncio.wait([*side, *self._fault_tasks])
        self._check_tasks([*side, *self._fault_tasks])
        for t in pending:
            t.cancel()
        if self.oracle.violation is None:
            await self._in("checker", self._final())

    async def _in(self, node: str, coro: Coroutine[Any, Any, Any]) -> Any:
        return await self.spawn(node, coro)

    async def _new_client(self, node: str) -> BookKeeper:
        """A client made while ZooKeeper may lose calls: tried again until it connects."""
        while True:
            try:
                return await self._client(node)
            except Exception as e:  # noqa: BLE001 - ZooKeeper trouble (kazoo's or ours): as a process would
                self.trace(f"{node} cannot connect ({type(e).__name__}): retry")
                await asyncio.sleep(0.2)

    async def _client(self, node: str) -> BookKeeper:
        store = ZkMetadataStore(URI, client=self.zk.client(node, self.zk_partitioned), create=False)
        cfg = ClientConfig(add_timeout_s=ADD_TIMEOUT_S, read_timeout_s=1.0, bookie_quarantine_s=5.0,
                           slow_bookie_penalty_s=2.0)
        bk = BookKeeper(store, cfg, seed=self.rng.randrange(1 << 32), clock=self.loop.time)
        await bk.refresh_bookies()
        self.clients.append(bk)
        return bk

    def _tap_bookies(self) -> None:
        """Every connection a bookie accepts gets the oracle's taps on both directions."""
        net = self.net
        oracle = self.oracle
        original = net.connect

        async def connect(factory: Any, host: str, port: int) -> Any:
            transport, proto = await original(factory, host, port)
            server = transport.peer
            assert server is not None
            tap = oracle.tap(f"{host}:3181", net.link(server.node, server.peer_node), self.loop.time,
                             functools.partial(self._keep_limit, node=server.peer_node), client=server.peer_node)
            _tap(server, tap, oracle)
            return transport, proto
        self.loop.connect = connect

    # -- workload ----------------------------------------------------------------------
    async def _write(self, w: Writer) -> None:
        """Ledger after ledger: create, add (one at a time, pipelined, or in batches), close."""
        rng = self.rng_for(f"writer:{w.name}")
        bk = w.bk
        assert bk is not None
        cfg = self.cfg
        share = cfg.ops // cfg.writers
        while w.adds < share and self.oracle.violation is None:
            try:
                lh = await bk.create_ledger(ensemble=cfg.ensemble, write_quorum=cfg.write_quorum,
                                            ack_quorum=cfg.ack_quorum, password=PASSWORD)
            except BKError as e:
                self.trace(f"create failed: {type(e).__name__}")
                await asyncio.sleep(0.2)
                continue
            lid = lh.ledger_id
            w.handle = lh
            truth = self.oracle.ledger(lid, cfg.ack_quorum)
            self.counts["ledgers"] += 1
            self.open_ledgers[lid] = w.name
            n = min(rng.randint(5, 400) if rng.random() < 0.8 else rng.randint(1000, 10000), share - w.adds)
            mode = rng.choice(("one", "window", "batch"))
            if cfg.faults and cfg.ack_quorum < cfg.write_quorum and self._chaos.random() < 0.3:
                n = max(share - w.adds, 1000)  # a long ledger (past the ops budget if need be), one bookie hangs
                self.loop.call_later(0.05, self._hang_one_of, w, lh)
            self._ensembles[lid] = list(lh.metadata.last_ensemble)
            self._segments[lid] = dict(lh.metadata.ensembles)
            self.oracle.ensemble_written(lid, self._ensembles[lid], self.loop.time())
            self.trace(f"L{lid} created on {lh.metadata.last_ensemble}: {n} adds, {mode}")
            failed = await self._adds(lh, truth, n, mode, rng, w)
            self.open_ledgers.pop(lid, None)
            w.handle = None
            if failed is not None:
                self.trace(f"L{lid} writer failed: {failed}")
                continue
            try:
                await lh.close()
                self.oracle.closed(truth, lh.last_add_confirmed, "its writer")
                self.counts["closed"] += 1
                self.trace(f"L{lid} closed at {lh.last_add_confirmed}")
            except BKError as e:
                self.trace(f"L{lid} close failed: {type(e).__name__}")

    async def _adds(self, lh: Any, truth: LedgerTruth, n: int, mode: str, rng: random.Random,
                    w: Writer) -> str | None:
        window = 1 if mode == "one" else rng.randint(2, 64)
        inflight: set[asyncio.Future[Any]] = set()
        failure: list[str] = []

        def settled(f: asyncio.Future[Any], first: int, last: int) -> None:
            if f.cancelled():
                return
            if f.exception() is not None:
                failure.append(type(f.exception()).__name__)
                return
            self.oracle.acked(truth, first, last)
            self.counts["acked"] += last - first + 1
            self.trace(f"L{truth.ledger_id} acked {first}..{last}")

        sent = 0
        while sent < n and not failure and self.oracle.violation is None:
            k = min(n - sent, rng.randint(1, 50)) if mode == "batch" else 1
            datas = [rng.randbytes(rng.randint(1, 120)) for _ in range(k)]
            first = len(truth.data)
            truth.data.extend(datas)
            try:
                fut = lh.add_entries_async(datas) if mode == "batch" else lh.add_entry_async(datas[0])
            except BKError as e:
                failure.append(type(e).__name__)
                break
            fut.add_done_callback(lambda f, a=first, b=first + k - 1: settled(f, a, b))
            inflight.add(fut)
            sent += k
            w.adds += k
            self.counts["adds"] += k
            await asyncio.sleep(rng.expovariate(self.cfg.add_rate / k))  # the writer's pace, on average
            if len(inflight) >= window:
                _done, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
        if inflight:
            await asyncio.wait(inflight)
        return failure[0] if failure else None

    async def _recoverer(self, bk: BookKeeper) -> None:
        """Recovery opens racing the writers: fence a ledger being written, close it. A
        recovering client that dies is replaced by a new one (a new process)."""
        rng = self.rng_for("recoverer")
        while not self.done:
            if self._recoverer_died:
                self._recoverer_died = False
                bk = await self._new_client("recoverer")
            await asyncio.sleep(rng.expovariate(1 / 0.3))
            candidates = sorted(lid for lid in self.open_ledgers if self.oracle.ledgers[lid].closed_at is None)
            retry, self._interrupted = self._interrupted, None
            if retry is not None and (self._left_segment or rng.random() < 0.5):
                lid = retry  # the new process takes up the job its predecessor died in (always, if it left a segment)
            elif candidates:
                lid = rng.choice(candidates)
            else:
                continue
            # A third of recoveries die part way (the recovering client crashes): what they
            # left (IN_RECOVERY, rewrites, ensemble changes) is the next recovery's to finish.
            await self._recover(bk, lid, 10 ** rng.uniform(-3, 0.5) if rng.random() < 0.5 else None)

    async def _recover(self, bk: BookKeeper, lid: int, dies_after: float | None = None) -> bool:
        truth = self.oracle.ledgers[lid]
        chaos = self._chaos.random() if self.cfg.faults else 1.0
        if chaos < 0.25:
            self.loop.call_later(self._chaos.uniform(0.0, 0.02), self._crash_one_of, lid)
        elif chaos < 0.45:
            self._lose_fences(lid)
        elif chaos < 0.95 and self._late_adds(lid):
            dies_after = None  # the race needs the recovery to finish
            with contextlib.suppress(TimeoutError):  # an add in flight first (0.3 s at most)
                async with asyncio.timeout(0.3):
                    await self._late[lid].sent.wait()
        if self.cfg.faults and lid not in self._late and self._chaos.random() < 0.5:
            bookies = sorted({b for segment in self._segments.get(lid, {}).values() for b in segment})
            self._slow_reads[lid] = (None, set(self._chaos.sample(bookies, self._chaos.randint(0, len(bookies)))))
        started = self.loop.time()
        self._left_segment = False
        try:
            async with asyncio.timeout(dies_after) as self._dying:
                rh = await bk.open_ledger(lid, password=PASSWORD, recovery=True)
        except TimeoutError:
            # The recovering client dies: its connections are reset and its requests fail, so
            # what it had under way stops (a metadata write already sent may still land).
            self.trace(f"L{lid} recovering client dies after {self.loop.time() - started:.3f} s")
            bk.pool.drop_connections()
            self.net.crash("recoverer")
            self._recoverer_died = True
            self._interrupted = lid
            return False
        except BKError as e:
            self.trace(f"L{lid} recovery failed: {type(e).__name__}")
            return False
        finally:
            self._dying = None
            self._fences_to_lose.pop(lid, None)
            self._late.pop(lid, None)
            self._slow_reads.pop(lid, None)
            self.oracle.watched.discard(lid)
        self.counts["recoveries"] += 1
        self.oracle.closed(truth, rh.last_add_confirmed, "a recovery")
        self.trace(f"L{lid} recovered, closed at {rh.last_add_confirmed}")
        return True

    async def _reader(self, bk: BookKeeper) -> None:
        """Reads of acknowledged entries (open without recovery, read up to the LAC); one time
        in five, a closed ledger checked whole and deleted instead."""
        rng = self.rng_for("reader")
        while not self.done:
            await asyncio.sleep(rng.expovariate(1 / 0.3))
            if rng.random() < 0.2:
                await self._delete(bk, rng)
                continue
            candidates = sorted(lid for lid, t in self.oracle.ledgers.items() if t.acked >= 0)
            if not candidates:
                continue
            lid = rng.choice(candidates)
            truth = self.oracle.ledgers[lid]
            try:
                rh = await bk.open_ledger(lid, password=PASSWORD, recovery=False)
                lac = rh.last_add_confirmed
                if lac < 0:
                    continue
                first = rng.randint(0, lac)
                last = min(lac, first + rng.randint(0, 20))
                entries = await rh.read(first, last)
            except BKError as e:
                self.trace(f"L{lid} read failed: {type(e).__name__}")
                continue
            self.counts["reads"] += 1
            for entry in entries:
                self.oracle.read(truth, entry.entry_id, bytes(entry.data), lac)

    async def _delete(self, bk: BookKeeper, rng: random.Random) -> None:
        """A closed ledger read back whole and checked (as the final check does), then deleted:
        the bookies' garbage collection drops it and compaction reclaims its logs."""
        closed = sorted(lid for lid, t in self.oracle.ledgers.items()
                        if t.closed_at is not None and not t.deleted and lid not in self.open_ledgers)
        if not closed:
            return
        lid = rng.choice(closed)
        truth = self.oracle.ledgers[lid]
        try:
            rh = await bk.open_ledger(lid, password=PASSWORD, recovery=False)
            last = rh.last_add_confirmed
            entries = await rh.read(0, last) if last >= 0 else []
        except BKError as e:
            self.trace(f"L{lid} not deleted: its read failed ({type(e).__name__})")
            return
        self._check_whole(truth, rh, entries, "a read before its deletion")
        truth.deleted = True  # from now on its entries may go (a lost reply hides whether the delete happened)
        try:
            await bk.delete_ledger(lid)
        except BKError as e:
            self.trace(f"L{lid} delete failed: {type(e).__name__}")
            return
        self.counts["deleted"] += 1
        self.trace(f"L{lid} deleted")

    def _check_whole(self, truth: LedgerTruth, rh: Any, entries: list[Any], by: str) -> None:
        """A closed ledger read back whole (entries 0 to its end): where it ends, its copies in
        the closed metadata, each entry's bytes."""
        last = rh.last_add_confirmed
        self.oracle.closed(truth, last, by)
        self.oracle.replicated(truth, rh.metadata)
        for entry in entries:
            self.oracle.read(truth, entry.entry_id, bytes(entry.data), last)

    def has_metadata(self, ledger_id: int) -> bool:
        """Whether the ledger's metadata exists now (the simulated ZooKeeper's tree, read directly)."""
        return ledger_path(ROOT, ledger_id) in self.zk.nodes

    async def _tailer(self, bk: BookKeeper) -> None:
        """Tails of open ledgers as they are written (long polls at the head, the metadata
        watch: ReadHandle.tail), from entry 0 to the close: each entry what the writer added,
        in order, the tailer's LAC never past what Qa bookies hold, and the end where the
        ledger was closed (readers agree on it)."""
        rng = self.rng_for("tailer")
        while not self.done:
            await asyncio.sleep(rng.expovariate(1 / 0.5))
            candidates = sorted(lid for lid, t in self.oracle.ledgers.items() if t.closed_at is None)
            if not candidates:
                continue
            lid = rng.choice(candidates)
            truth = self.oracle.ledgers[lid]
            patience = rng.uniform(1.0, 20.0)  # a writer that died leaves its ledger open until a recovery
            self.trace(f"L{lid} tail starts (for {patience:.1f} s at most)")
            nxt = 0
            try:
                async with asyncio.timeout(patience):
                    rh = await bk.open_ledger(lid, password=PASSWORD, recovery=False)
                    async for entry in rh.tail(0):
                        if entry.entry_id != nxt:
                            self.oracle.fail("dirty-read", f"ledger {lid}: a tail gave entry {entry.entry_id} after "
                                             f"{nxt - 1}")
                            return
                        self.oracle.read(truth, entry.entry_id, bytes(entry.data), rh.last_add_confirmed)
                        nxt += 1
            except TimeoutError:
                self.trace(f"L{lid} tail given up at entry {nxt}: not closed yet")
                continue
            except BKError as e:  # opening, or the ledger gone: tailing retries everything else
                self.trace(f"L{lid} tail failed at entry {nxt}: {type(e).__name__}")
                continue
            self.counts["tails"] += 1
            self.oracle.closed(truth, nxt - 1, "a tailer")
            self.trace(f"L{lid} tail ended at its close, entry {nxt - 1}")

    async def _namespace(self, bk: BookKeeper) -> Namespace:
        """The run's stream namespace on bk's client, with its stream made (retried through
        ZooKeeper's faults: the stream's quorums are the run's)."""
        ns = Namespace(bk, "sim", password=PASSWORD, owns_client=False)
        while True:
            try:
                await bk.metadata_call(ns.store.ensure_namespace, "sim")
                if STREAM not in await ns.list_streams():
                    await ns.create_stream(STREAM, ensemble=self.cfg.ensemble, write_quorum=self.cfg.write_quorum,
                                           ack_quorum=self.cfg.ack_quorum)
                return ns
            except StreamExistsError:
                return ns  # the other writer made it first
            except BKError:
                await asyncio.sleep(0.1)

    async def _stream_writer(self, bk: BookKeeper, node: str) -> None:
        """A stream writer that takes the stream over from the other one (its open segment
        fenced and closed), writes records in pipelined bursts with automatic txids, rolling
        every few records, until it is taken over in turn or a write fails; then again."""
        rng = self.rng_for(f"stream:{node}")
        ns = await self._namespace(bk)
        while not self.done:
            await asyncio.sleep(rng.expovariate(1 / 0.5))
            try:
                w = await ns.open_writer(STREAM, segment_max_records=rng.choice((20, 60, 300)),
                                         segment_max_age_s=None, record_set_max_delay_ms=rng.choice((0.0, 1.0, 5.0)))
            except BKError as e:
                self.trace(f"stream writer {node} does not open: {type(e).__name__}")
                continue
            self.trace(f"stream writer {node} opens (after txid {w.last_txid})")
            try:
                for _ in range(rng.randint(1, 20)):
                    burst = [f"{node}:{self.counts['stream_records'] + i}".encode() for i in range(rng.randint(1, 8))]
                    self.counts["stream_records"] += len(burst)
                    self.oracle.stream_written(burst)
                    if rng.random() < 0.5:
                        await w.write_batch(burst)
                    else:
                        await asyncio.gather(*(w.write(d) for d in burst))
                    self.oracle.stream_acked(burst)
                    self.counts["stream_acked"] += len(burst)
                    await asyncio.sleep(rng.expovariate(1 / 0.02))
                await w.close()
                self.trace(f"stream writer {node} closes at txid {w.last_txid}")
            except BKError as e:  # taken over (StreamLockLostError), or a fault it cannot ride out
                self.trace(f"stream writer {node} stops: {type(e).__name__}")
                try:
                    await w.close()
                except BKError:
                    pass

    async def _stream_reader(self, bk: BookKeeper) -> None:
        """A reader tailing the stream from its start: each record once, txids rising; it
        opens again from the start after an error."""
        ns = await self._namespace(bk)
        rng = self.rng_for("streamreader")
        while not self.done and self.oracle.violation is None:
            read: list[tuple[int, bytes]] = []
            try:
                await self._read_stream(await ns.open_reader(STREAM, "earliest"), "the stream's tailing reader",
                                        read)
            except BKError as e:
                self.trace(f"stream reader stops after txid {read[-1][0] if read else -1}: {type(e).__name__}")
            await asyncio.sleep(rng.expovariate(1 / 0.5))

    async def _read_stream(self, reader: StreamReader, by: str, out: list[tuple[int, bytes]]) -> None:
        """Read reader to its end (or a violation), each record checked and appended to out;
        the reader closed after."""
        try:
            async for rec in reader:
                self.oracle.stream_read(rec.txid, rec.data, out[-1][0] if out else -1, by)
                out.append((rec.txid, rec.data))
                if self.oracle.violation is not None:
                    return
        finally:
            await reader.close()

    # -- faults ----------------------------------------------------------------------
    async def _faults(self) -> None:
        rng = self.rng_for("faults")
        kinds = ["crash", "power-loss", "partition", "reply-drop", "isolate", "reset", "zk-partition", "zk-loss",
                 "eio", "session-expiry", "pause"]
        while not self.done:
            await asyncio.sleep(rng.expovariate(1 / self.cfg.fault_gap_s))
            if self.done:
                return
            kind = rng.choices(kinds, weights=KIND_WEIGHTS)[0]
            up = [b for b in self.bookies if b.up]
            down = self._down()
            client = "recoverer" if kind == "isolate" and rng.random() < 0.5 else \
                rng.choice([w.name for w in self.writers] + ["recoverer", "reader", "tailer",
                            *(STREAM_NODES if self.cfg.streams else ())])
            bookie = rng.choice(up) if up else None
            if bookie is None:
                continue
            handle = next((w.handle for w in self.writers if w.name == client), None)
            if handle is not None and kind in ("reply-drop", "partition", "crash", "power-loss", "eio") \
                    and rng.random() < 0.5:
                # at one of the bookies this writer writes to now
                mine = [b for b in up if b.id in handle.metadata.last_ensemble]
                bookie = rng.choice(mine) if mine else bookie
            span = rng.uniform(0.1, 3.0) if rng.random() < 0.8 else rng.uniform(5.0, 20.0)
            if kind in ("crash", "power-loss", "eio"):
                if down >= self.cfg.max_down:
                    continue
                if kind == "eio":
                    for s in bookie.shards:
                        if s.syncer is not None:
                            s.syncer.eio_rate = 0.5
                    self.trace(f"{bookie.id} journal device fails syncs (EIO) for {span:.3f} s, then restarts")
                    self._fault_tasks.append(self.spawn("faults", self._restart(bookie, 0.05, crash_after=span)))
                else:
                    bookie.crash(torn=kind == "power-loss")
                    if kind == "crash" and self._may_rot() and rng.random() < 0.5:
                        bookie.rot()
                    self._fault_tasks.append(self.spawn("faults", self._restart(bookie, rng.uniform(0.05, 2.0))))
            elif kind in ("partition", "reply-drop", "isolate"):
                # isolate: a client cut from several bookies at once (a recovery that reaches
                # too few of them must not go on)
                cut = rng.sample(up, rng.randint(1, max(1, len(up) - 1))) if kind == "isolate" else [bookie]
                lossy = rng.random() < 0.5  # healed by a reset: what it held is lost (TCP gave up)
                for b in cut:
                    self.net.hold(b.name, client)
                    if kind != "reply-drop":
                        self.net.hold(client, b.name)
                    self.loop.call_later(span, self._heal_link, client, b.name, lossy)
                self.trace(f"{kind} {client} / {','.join(b.name for b in cut)} for {span:.3f} s")
            elif kind == "reset":
                n = self.net.reset_between(client, bookie.name)
                self.trace(f"reset {n} connection(s) {client} / {bookie.name}")
            elif kind == "zk-partition":
                self.zk_cut.add(client)
                self.trace(f"{client} cut from ZooKeeper for {span:.3f} s")
                self.loop.call_later(span, self.zk_cut.discard, client)
            elif kind == "zk-loss":
                self.zk.loss_rate, self.zk.reply_loss_rate = self.cfg.zk_loss_rate * 10, self.cfg.zk_reply_loss_rate * 10
                self.trace(f"ZooKeeper loses requests and replies for {span:.3f} s")
                self.loop.call_later(span, self._calm_zk)
            elif kind == "pause":
                if client in self.loop.paused:
                    continue
                # A stopped process (SIGSTOP, a long GC pause): its timers, arrivals and tasks
                # wait, then run at once; the others go on (a recovery may take its ledger).
                self.loop.pause(client)
                self.trace(f"{client} paused for {span:.3f} s")
                self.loop.call_later(span, self._resume, client)
            elif kind == "session-expiry":
                if bookie.store is not None:
                    self.trace(f"{bookie.id} ZooKeeper session expires")
                    bookie.store.zk.expire()
            self.faults[kind] = self.faults.get(kind, 0) + 1

    def _recovery_add(self, bookie: str, ledger_id: int) -> bool:
        """A recovery's first rewrite of a ledger reached a bookie: sometimes that bookie
        crashes now, or (no crash left in the budget) the rewrite is lost with its connection,
        so that the recovery changes its ensemble (FoundationDB's "buggify": a fault placed
        where it tests a rule, not left to chance). True: lose the request."""
        if (not self.cfg.faults or self.healed or self.done or ledger_id in self._late
                or self._chaos.random() >= 0.5):
            return False
        victim = next(b for b in self.bookies if b.id == bookie)
        if self._may_crash(victim):
            self.loop.call_soon(self._crash, victim, f"during a rewrite of L{ledger_id}")
            return False
        self.trace(f"a rewrite of L{ledger_id} to {bookie} is lost with its connection")
        self.faults["lost-rewrite"] = self.faults.get("lost-rewrite", 0) + 1
        return True

    def _metadata_written(self, path: str, data: bytes, node: str) -> None:
        """Each ledger metadata write: the oracle learns which bookies left the last segment
        (kept-failed-bookie). A recovery's write with a segment of its own (an ensemble change
        of its rewrites): sometimes the recovering client dies then, at once or a moment later,
        leaving the ledger IN_RECOVERY with that segment for the next recovery."""
        try:
            md = LedgerMetadata.deserialize(data)
        except Exception:  # noqa: BLE001 - not a ledger's metadata
            return
        self.oracle.ensemble_written(md.ledger_id, md.last_ensemble, self.loop.time())
        if node != "recoverer":
            self._segments[md.ledger_id] = md.ensembles  # the writer's (what it wrote last)
            return
        if self._dying is None or not self.cfg.faults or self._dying.expired() or md.ledger_id in self._late:
            return
        # Its own segment: not what the writer wrote (told apart here, not by the metadata's
        # writer_ensembles, which a mutation of recovery may leave out).
        if md.state is LedgerState.IN_RECOVERY and md.ensembles != self._segments.get(md.ledger_id, md.ensembles) \
                and self._chaos.random() < 0.5:
            delay = 0.0 if self._chaos.random() < 0.5 else self._chaos.uniform(0.0, 0.005)
            self._dying.reschedule(self.loop.time() + delay)
            self._left_segment = True

    def _lose_fences(self, lid: int) -> None:
        """This recovery's fences to some of the ledger's bookies (all but one, at most) will be
        lost: the connection each arrives on is reset instead (a bookie restarting, a NAT
        forgetting it). The recovery's later requests reach those bookies on new connections."""
        ensemble = self._ensembles.get(lid, [])
        if len(ensemble) < 2 or self.healed:
            return
        self._fences_to_lose[lid] = set(self._chaos.sample(ensemble, self._chaos.randint(1, len(ensemble) - 1)))

    def _late_adds(self, lid: int) -> bool:
        """apache/bookkeeper#2614's order, placed. The writer's adds to Qw - Qa + 1 bookies of
        its first unacknowledged entry's write set are held until after the recovery has read
        there (the others answer that first read late: `_read_arrives`), so the entry reads
        as denied by enough bookies and the ledger closes before it. One of them, the victim,
        loses the recovery's fence: only the read can fence it. If the read does not, the
        victim takes the late add, which with the Qa - 1 copies made before the fence is Qa:
        the writer sees the entry acknowledged past the close. The fenced bookies' answers to
        the writer are held until just after the late adds land (`_fence_arrives`), so the
        writer hears of the fence (which fails all its adds) only then. Coverage holds (one
        unfenced bookie per write set, Qa >= 2). False (nothing armed) with Qa = 1 (an add is
        acknowledged at once), or if the ledger has no writer now, the recovering client is
        cut from a bookie of the ensemble, or too few of the write set are up and reachable."""
        writer = next((w for w in self.writers if w.handle is not None and w.handle.ledger_id == lid), None)
        if writer is None or self.healed or self.cfg.ack_quorum < 2:
            return False
        md = writer.handle.metadata
        ensemble = [b for b in self.bookies if b.id in md.last_ensemble]
        if any(self.net.link("recoverer", b.name).held or self.net.link(b.name, "recoverer").held for b in ensemble):
            return False
        first = writer.handle.last_add_confirmed + 1  # in flight, or the next it sends: recovery reads it first
        members = {md.last_ensemble[i] for i in write_set(first, md.ensemble_size, md.write_quorum)}
        candidates = [b for b in ensemble if b.id in members and b.up and not self.net.link(writer.name, b.name).held]
        if len(candidates) < md.write_quorum - md.ack_quorum + 1:
            return False
        late = self._chaos.sample(candidates, md.write_quorum - md.ack_quorum + 1)
        victim = late[0]
        span = self._chaos.uniform(0.1, 0.45)  # under the add timeout (0.5 s): the writer keeps the bookies
        self._fences_to_lose[lid] = {victim.id}
        race = self._late[lid] = LateAdds(writer.name, victim.id, self.loop.time() + span)
        self._slow_reads[lid] = (first, {b.id for b in ensemble if b not in late})  # so the late ones answer first
        for b in late:
            self.net.hold(writer.name, b.name)
            self.loop.call_later(span, self.net.release, writer.name, b.name)
        if writer.handle.outstanding:
            race.sent.set()
        else:
            self.oracle.watched.add(lid)  # the recovery starts once the writer's next add is out
        self.trace(f"{writer.name}'s adds to {','.join(b.id for b in late)} held for {span:.3f} s "
                   f"(L{lid}'s recovery; {victim.id} loses its fence)")
        self.faults["late-adds"] = self.faults.get("late-adds", 0) + 1
        return True

    def _add_arrives(self, bookie: str, ledger_id: int) -> None:
        """A watched ledger's add reaches a bookie: in #2614's race, the recovery may start."""
        race = self._late.get(ledger_id)
        if race is not None:
            race.sent.set()

    def _read_arrives(self, bookie: str, ledger_id: int, entry_id: int, client: str) -> None:
        """An entry read reaches a bookie. In half of the recoveries that run no #2614 race,
        some bookies (maybe none) answer the recovery's first entry read 5 ms late, so that a
        denial from one bookie can come before a copy from another (what recovery decides on
        a denial is then tested); in #2614's race the bookies that have the contested entry
        answer the recovery's read of it late, so the late ones' denials come first."""
        slow = self._slow_reads.get(ledger_id)
        if client != "recoverer" or slow is None or bookie not in slow[1] or slow[0] not in (None, entry_id):
            return
        slow[1].discard(bookie)
        self._hold_for(bookie.split(":")[0], "recoverer", 0.005)

    def _fence_arrives(self, bookie: str, ledger_id: int) -> bool:
        """A fence reaches a bookie: True to lose it (and reset its connection). In #2614's
        race, a bookie fenced now answers the writer only once the late adds have landed."""
        race = self._late.get(ledger_id)
        if race is not None and bookie != race.victim:
            self._hold_for(bookie.split(":")[0], race.writer, race.until + 0.01 - self.loop.time())
        lose = self._fences_to_lose.get(ledger_id)
        if lose is None or bookie not in lose:
            return False
        lose.discard(bookie)
        self.trace(f"the recovery's fence of L{ledger_id} to {bookie} is lost with its connection")
        self.faults["lost-fence"] = self.faults.get("lost-fence", 0) + 1
        return True

    def _hold_for(self, src: str, dst: str, span: float) -> None:
        """Packets from src to dst are held for span seconds, then arrive (unless already held)."""
        if span > 0 and not self.net.link(src, dst).held:
            self.net.hold(src, dst)
            self.loop.call_later(span, self.net.release, src, dst)

    def _hang_one_of(self, w: Writer, lh: Any) -> None:
        """A bookie of a writer's new ledger stops answering it (its answers held for
        seconds) while the ledger is written: with Qa < Qw its adds still reach Qa, and the
        late failures must replace it."""
        if self.healed or self.done:
            return
        ensemble = lh.metadata.last_ensemble
        victim = self._chaos.choice([b for b in self.bookies if b.id in ensemble])
        span = self._chaos.uniform(3.0, 10.0)
        self.net.hold(victim.name, w.name)
        self.loop.call_later(span, self._heal_link, w.name, victim.name)
        self.trace(f"{victim.id} stops answering {w.name} for {span:.3f} s (L{lh.ledger_id})")
        self.faults["hung-bookie"] = self.faults.get("hung-bookie", 0) + 1

    def _crash_one_of(self, lid: int) -> None:
        """A bookie of the ledger's first ensemble crashes while its recovery runs."""
        ensemble = self._ensembles.get(lid, [])
        up = [b for b in self.bookies if b.up and b.id in ensemble]
        if up:
            self._crash(self._chaos.choice(up), f"during the recovery of L{lid}")

    def _may_crash(self, victim: SimBookie) -> bool:
        """Whether a placed crash of victim is in the budget (a bookie gone for good on its
        damaged journal does not count: the fault injector's rule)."""
        return victim.up and not self.healed and not self.done and self._down() < self.cfg.max_down

    def _down(self) -> int:
        """Bookies down for a while: a bookie that refused to start on its damaged journal is
        gone for good, as if decommissioned, and does not hold the budget of crashes."""
        return sum(1 for b in self.bookies if not b.up and not b.broken)

    def _crash(self, victim: SimBookie, why: str) -> None:
        if not self._may_crash(victim):
            return
        self.trace(f"{victim.id} crashes {why}")
        victim.crash(torn=False)
        self._fault_tasks.append(self.spawn("faults", self._restart(victim, self._chaos.uniform(0.05, 1.0))))
        self.faults["recovery-crash"] = self.faults.get("recovery-crash", 0) + 1

    def _may_rot(self) -> bool:
        """Damaging a synced journal block is in the budget: a bookie may lose what it
        acknowledged only when fewer than Qa bookies of any write set do, so one bookie at a
        time, and never with Qa = 1. Only after a process crash: after a power loss the last
        write may be torn too, and a damaged block before a torn one is a torn end to any
        journal (its records lost without a refusal: the budget spent, but not a bug)."""
        return self.cfg.ack_quorum >= 2 and not any(b.rotted for b in self.bookies)

    def _heal_link(self, a: str, b: str, lossy: bool = False) -> None:
        if lossy:
            self.net.reset_between(a, b)
        self.net.release(a, b)
        self.net.release(b, a)

    def _resume(self, node: str) -> None:
        if node in self.loop.paused:
            self.loop.resume(node)
            self.trace(f"{node} resumes")

    def _calm_zk(self) -> None:
        """ZooKeeper's background loss rates (none when faults are off)."""
        if self.cfg.faults and not self.healed:
            self.zk.loss_rate, self.zk.reply_loss_rate = self.cfg.zk_loss_rate, self.cfg.zk_reply_loss_rate

    async def _restart(self, bookie: SimBookie, after: float, crash_after: float | None = None) -> None:
        """Restart bookie `after` seconds from now (crashing it first, `crash_after` seconds from
        now, if given: a failed journal device is replaced by an operator's restart)."""
        if crash_after is not None:
            starts = bookie.starts
            await asyncio.sleep(crash_after)
            if not bookie.up or bookie.starts != starts:
                return  # crashed and restarted meanwhile: that restart took the failed device away
            bookie.crash(torn=False)
        await asyncio.sleep(after)
        await bookie.ensure_up()

    async def heal(self) -> None:
        """Every fault ends for good: links flow, ZooKeeper answers, every bookie is up."""
        self.healed = True
        for node in sorted(self.loop.paused):
            self._resume(node)
        if self._fault_tasks:
            self._fault_tasks[0].cancel()  # the injector; restarts under way finish (ensure_up)
        for (src, dst), link in sorted(self.net.links.items()):
            if link.held:
                self.net.release(src, dst)
        self.zk_cut.clear()
        self.zk.loss_rate = self.zk.reply_loss_rate = 0.0
        for b in self.bookies:
            for shard in b.shards:
                if shard.syncer is not None:
                    shard.syncer.eio_rate = 0.0
            if b.up and any(s.server is not None and s.server.readonly for s in b.shards):
                b.crash(torn=False)  # a failed journal device: replaced, the bookie restarted
            await self._in(b.name, b.ensure_up())

    # -- the end -----------------------------------------------------------------------
    async def _final(self) -> None:
        """Faults healed, every bookie up: every ledger closes (by its writer or a recovery)
        and reads back whole, with the writer's bytes."""
        await self.heal()
        await asyncio.sleep(3.0)  # quarantines and penalties of the fault phase run out
        bk = await self._client("checker")
        for lid in sorted(self.oracle.ledgers):
            truth = self.oracle.ledgers[lid]
            if truth.deleted:
                continue  # checked whole before its deletion
            try:
                async with asyncio.timeout(60.0):
                    rh = await bk.open_ledger(lid, password=PASSWORD, recovery=True)
                    last = rh.last_add_confirmed
                    entries = await rh.read(0, last) if last >= 0 else []
            except (BKError, TimeoutError) as e:
                self.oracle.fail("stuck" if isinstance(e, TimeoutError) else "lost-entry",
                                 f"ledger {lid}: after faults healed, its recovery and read failed: {e!r}")
                return
            self._check_whole(truth, rh, entries, "the final recovery")
            if self.oracle.violation is not None:
                return
        self.trace(f"final check: {sum(1 for t in self.oracle.ledgers.values() if not t.deleted)} ledgers closed and "
                   f"read back")
        if not self.cfg.streams:
            return
        ns = await self._namespace(bk)
        records: list[tuple[int, bytes]] = []
        try:
            async with asyncio.timeout(60.0):
                async with await ns.open_writer(STREAM, segment_max_age_s=None):
                    pass  # takes the stream over: its last writer's open segment fenced and closed
                await self._read_stream(await ns.open_reader(STREAM, "earliest", follow=False),
                                        "the final stream read", records)
        except (BKError, TimeoutError) as e:
            self.oracle.fail("stuck" if isinstance(e, TimeoutError) else "stream-lost",
                             f"after faults healed, the stream could not be read back: {e!r}")
            return
        self.oracle.stream_final(records)
        self.trace(f"final check: the stream reads back {len(records)} records")

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for bk in self.clients:
            bk.pool.close()
        for b in self.bookies:
            if b.up:
                b.crash(torn=False)
            for shard in b.shards:
                if shard.storage is not None:  # a start cut short: still close what it opened
                    shard.crash(torn=False)

    def result(self) -> Result:
        return Result(config=self.cfg, violation=self.oracle.violation, acked=self.counts["acked"],
                      adds=self.counts["adds"], ledgers=self.counts["ledgers"], closed=self.counts["closed"],
                      recoveries=self.counts["recoveries"], reads=self.counts["reads"], tails=self.counts["tails"],
                      deleted=self.counts["deleted"], stream_acked=self.counts["stream_acked"],
                      faults=dict(self.faults),
                      sim_seconds=self.loop.time(), trace_lines=self.trace.count,
                      trace_tail=self._violation_tail if self.oracle.violation else list(self.trace.tail),
                      stats={"net": dict(self.net.stats), "zk": dict(self.zk.stats), "checks": self.oracle.checks})


def _tap(server: SimTransport, tap: Any, oracle: Oracle) -> None:
    """The oracle sees what the bookie end of a connection receives and sends."""
    deliver, write = server.deliver, server.write

    def delivered(data: bytes) -> None:
        if oracle.requests_in(tap, data):
            server.net.reset(server)  # a fault placed on a request: lost, with its connection
            return
        deliver(data)

    def written(data: bytes | bytearray | memoryview) -> None:
        if not (server.closing or server.dead):
            oracle.responses_out(tap, bytes(data))
        write(data)
    server.deliver = delivered  # type: ignore[method-assign]
    server.write = written  # type: ignore[method-assign]

