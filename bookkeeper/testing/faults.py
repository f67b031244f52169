"""Seeded fault schedules against a LocalCluster, and the checker of docs/design.md's invariants.

A scenario streams pipelined adds into one ledger while a schedule, fixed by its seed,
hurts the cluster one step at a time: a bookie of the ledger's ensemble killed (-9) and
started again, hung (SIGSTOP/SIGCONT), restarted gracefully, frozen past its ZooKeeper
session timeout (its registration expires: it must register again), ZooKeeper itself
restarted, and, where the ensemble can be rebuilt around them, two bookies down at
overlapping times. Each step ends only once everything it hurt is back and registered.
The writer records its adds, acknowledgements and LACs, and the read-back after a recovery
open, as a `bk verify` history (in memory), judged by the same checker
(bookkeeper.verify.check_history): nothing acknowledged lost or altered, LAC never went back;
besides, ids contiguous and the writer never saw an error.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from bookkeeper.client import BookKeeper, WriteHandle
from bookkeeper.testing.cluster import LocalBookie, LocalCluster
from bookkeeper.verify.checker import Anomaly, check_history
from bookkeeper.verify.history import History, digest

T = TypeVar("T")

BOOKIE_FAULTS = ("kill", "hang", "restart", "session_expiry")
FAULTS = (*BOOKIE_FAULTS, "zk_restart")
OVERLAP = "overlap"  # a schedule step, not a fault kind: two bookie faults at overlapping times
STALL_S = 30.0  # an add not acknowledged in this long counts as a stalled writer
# What a step costs beyond its hold (bookie start and registration, ZooKeeper start and the
# sessions back): lays steps out so that, on an unloaded machine, one ends before the next.
RECOVERY_S = {"kill": 1.5, "hang": 0.3, "restart": 1.8, "session_expiry": 0.5, "zk_restart": 3.0}


@dataclass(frozen=True, slots=True)
class Fault:
    at_s: float        # seconds after the stream starts (later if the step before overran)
    kind: str          # kill | hang | restart | session_expiry | zk_restart
    slot: int          # position in the ledger's current ensemble: the fault always hits a bookie in use
                       # (-1: ZooKeeper)
    hold_s: float      # how long the bookie (or ZooKeeper) stays down, hung or frozen
    step: int = 0      # faults of one step overlap in time; a step starts once the one before ended


def overlap_survivable(*, bookies: int, ensemble: int) -> bool:
    """Whether a writer can ride through two bookies of its ensemble down at once.

    The writer replaces every bookie that fails on it (as Apache BookKeeper's does, rather
    than writing on with a smaller quorum), so two down at once take two writable bookies
    outside the ensemble. With fewer (5/3/2 on 6 bookies) no ensemble can be formed until
    one of them is back, and the writer fails with NotEnoughBookiesError, as Apache
    BookKeeper's does: not a fault a writer is expected to survive.
    """
    return bookies - ensemble >= 2


def schedule(seed: int, *, duration_s: float, ensemble: int, bookies: int = 6, faults: int = 5,
             session_timeout_s: float = 4.0) -> list[Fault]:
    """`faults` faults over duration_s (or longer: every step must fit); the same seed, the same list.

    The first five cover every kind of FAULTS: a hang, a session expiry, a ZooKeeper restart,
    and a kill and a restart, those two at overlapping times where overlap_survivable, one
    after the other otherwise; more faults are kill/hang/restart at random; the order is the
    seed's. A hang stays under 0.6 of the session timeout: a hang, not a session loss (the
    bookie's ZooKeeper client pings every third of it), shorter or longer than an add timeout
    of a couple of seconds. A session expiry freezes the bookie past the session timeout plus
    a tick, so ZooKeeper expires its session for sure.
    """
    rng = random.Random(seed)
    overlap = overlap_survivable(bookies=bookies, ensemble=ensemble)
    steps = ["hang", "session_expiry", "zk_restart", *((OVERLAP,) if overlap else ("kill", "restart"))]
    steps.extend(rng.choice(("kill", "hang", "restart")) for _ in range(faults - 5))
    rng.shuffle(steps)
    count = len(steps) + (OVERLAP in steps)
    while count > faults:
        count -= 1 + (steps.pop() == OVERLAP)
    planned = [_step(rng, kind, ensemble, session_timeout_s) for kind in steps]
    costs = [max(off + f.hold_s + RECOVERY_S[f.kind] for off, f in step) for step in planned]
    weights = [rng.uniform(0.5, 1.5) for _ in planned]
    spare_s = max(0.0, duration_s - sum(costs) - 0.3 * len(planned))
    out: list[Fault] = []
    cursor = 0.7  # the ledger has entries on every bookie of its ensemble before the first fault
    for n, (step, cost, weight) in enumerate(zip(planned, costs, weights)):
        at = cursor + 0.3 + spare_s * weight / sum(weights)
        out.extend(Fault(round(at + off, 2), f.kind, f.slot, f.hold_s, n) for off, f in step)
        cursor = at + cost
    return out


def _step(rng: random.Random, kind: str, ensemble: int, session_timeout_s: float) -> list[tuple[float, Fault]]:
    """One step's faults as (offset from the step's start, fault with at_s unset)."""
    slot = rng.randrange(ensemble)
    if kind == OVERLAP:  # a kill and a restart; the second goes down while the first is down
        kinds = rng.sample(("kill", "restart"), 2)
        first = Fault(0.0, kinds[0], slot, round(rng.uniform(1.5, 2.5), 2))
        second = Fault(0.0, kinds[1], (slot + rng.randrange(1, ensemble)) % ensemble, round(rng.uniform(0.5, 1.5), 2))
        return [(0.0, first), (round(rng.uniform(0.2, first.hold_s - 0.2), 2), second)]
    hold = {"kill": lambda: rng.uniform(0.5, 2.0),
            "hang": lambda: rng.uniform(0.5, session_timeout_s * 0.6),
            "restart": lambda: rng.uniform(0.0, 1.0),
            "session_expiry": lambda: session_timeout_s + rng.uniform(1.0, 1.5),
            "zk_restart": lambda: rng.uniform(0.2, 1.5)}[kind]()
    return [(0.0, Fault(0.0, kind, -1 if kind == "zk_restart" else slot, round(hold, 2)))]


def rolling_restarts(count: int, *, ensemble: int, gap_s: float = 0.5) -> list[Fault]:
    """`count` graceful restarts of the ensemble's bookies, slot after slot, each its own step:
    every bookie is back and registered before the next goes down."""
    return [Fault(round(gap_s * (i + 1), 2), "restart", i % ensemble, 0.0, i) for i in range(count)]


def payload(seed: int, entry_id: int) -> bytes:
    """Deterministic, distinct bytes per (seed, entry): altered data cannot go unnoticed."""
    digest = hashlib.sha256(b"%d:%d" % (seed, entry_id)).digest()
    return b"%d:%d:" % (seed, entry_id) + digest * (1 + entry_id % 4)


@dataclass(slots=True)
class Report:
    seed: int
    faults: list[Fault]
    acked: int = 0
    writer_errors: list[str] = field(default_factory=list)
    fault_errors: list[str] = field(default_factory=list)  # the harness could not inject or heal a fault
    lac_regressions: int = 0
    closed_last_entry: int = -1
    missing_or_altered: list[int] = field(default_factory=list)
    anomalies: list[Anomaly] = field(default_factory=list)  # the bk verify checker's, over the writer's history
    segments: int = 0
    ensemble_changes: int = 0
    quarantine_overridden: int = 0
    seconds: float = 0.0
    stream_s: float = 0.0  # of `seconds`, the writing; the rest is the recovery open and the read back
    # (kind, bookie id or "zookeeper", injected at, whole again at): seconds after the stream started
    timeline: list[tuple[str, str, float, float]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.writer_errors and not self.fault_errors and not self.anomalies

    def summary(self) -> str:
        return (f"seed={self.seed} faults={[(f.kind, f.slot, f.at_s, f.hold_s) for f in self.faults]} "
                f"acked={self.acked} closed_at={self.closed_last_entry} segments={self.segments} "
                f"ensemble_changes={self.ensemble_changes} quarantine_overridden={self.quarantine_overridden} "
                f"writer_errors={len(self.writer_errors)} fault_errors={len(self.fault_errors)} "
                f"lac_regressions={self.lac_regressions} lost_or_altered={len(self.missing_or_altered)} "
                f"anomalies={[(a.kind, a.entry_id, a.detail) for a in self.anomalies[:5]]} "
                f"time={self.seconds:.1f}s (stream {self.stream_s:.1f}s) ok={self.ok}")


async def _blocking(fn: Callable[..., T], *args: object) -> T:
    """A blocking cluster call (process start and stop, ZooKeeper reads) off the writer's loop."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _target(cluster: LocalCluster, lh: WriteHandle, slot: int, busy: set[str]) -> LocalBookie:
    """The bookie at `slot` of the current ensemble, or the next slot's if a fault of this step
    already holds that one (an ensemble change can move a bookie between slots)."""
    ensemble = lh.metadata.last_ensemble
    for i in range(len(ensemble)):
        bookie_id = ensemble[(slot + i) % len(ensemble)]
        if bookie_id not in busy:
            busy.add(bookie_id)
            return next(b for b in cluster.bookies if b.bookie_id == bookie_id)
    raise RuntimeError(f"every bookie of {ensemble} is already under a fault")


async def _fault(cluster: LocalCluster, f: Fault, start: float, lh: WriteHandle, busy: set[str],
                 timeline: list[tuple[str, str, float, float]], t0: float) -> None:
    """Inject one fault at `start`, hold it, undo it, wait until the cluster is whole, and note
    when each happened in the timeline."""
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    began = time.monotonic() - t0
    target = "zookeeper"
    try:
        if f.kind == "zk_restart":
            await zookeeper_restart(cluster, f.hold_s)
            return
        b = _target(cluster, lh, f.slot, busy)
        target = b.bookie_id
        await _bookie_fault(cluster, f, b)
    finally:
        timeline.append((f.kind, target, round(began, 2), round(time.monotonic() - t0, 2)))


async def _bookie_fault(cluster: LocalCluster, f: Fault, b: LocalBookie) -> None:
    """Hurt one bookie as f says, undo it, and wait until it is registered again."""
    expired = await inject_bookie_fault(cluster, f.kind, b)
    await asyncio.sleep(f.hold_s)
    await heal_bookie_fault(cluster, f.kind, b, expired)


async def inject_bookie_fault(cluster: LocalCluster, kind: str, b: LocalBookie) -> dict[str, int]:
    """The first half of a bookie fault (kill -9, graceful stop, SIGSTOP, or SIGSTOP held past
    its session: a session expiry); returns what heal_bookie_fault needs (the session a
    session expiry must see replaced). Public: `bk verify local` runs the same faults."""
    if kind == "kill":
        await _blocking(b.kill)
    elif kind == "restart":
        await _blocking(b.stop)
    elif kind == "hang":
        b.hang()
    elif kind == "session_expiry":
        session = await _blocking(cluster.registration_sessions)
        b.hang()
        return {b.bookie_id: session.get(b.bookie_id, 0)}
    else:
        raise ValueError(f"unknown fault kind {kind!r}")
    return {}


async def heal_bookie_fault(cluster: LocalCluster, kind: str, b: LocalBookie, expired: dict[str, int]) -> None:
    """Undo inject_bookie_fault and wait until the bookie is registered again."""
    if kind in ("kill", "restart"):
        await _blocking(b.start)
    else:
        b.resume()
    if kind == "session_expiry":
        # The old session must be gone and the bookie registered again under a new one: a
        # supervisor that misses its session loss stays unregistered and fails here.
        await _blocking(functools.partial(cluster.wait_sessions_live, [b], expired=expired))
        return
    await _blocking(cluster.wait_registered, [b])


async def zookeeper_restart(cluster: LocalCluster, down_s: float) -> None:
    """Stop ZooKeeper, start it again after down_s, and wait until every bookie holds a live
    session again (resumed, or registered anew if it expired meanwhile)."""
    await zookeeper_stop(cluster)
    await asyncio.sleep(down_s)
    await zookeeper_start(cluster)


async def zookeeper_stop(cluster: LocalCluster) -> None:
    """zookeeper_restart's first half (`bk verify local` holds the fault between the halves)."""
    await _blocking(cluster.zk.stop)


async def zookeeper_start(cluster: LocalCluster) -> None:
    """zookeeper_restart's second half: started on the same port and data, sessions live again."""
    await _blocking(cluster.zk.start)
    await _blocking(cluster.wait_sessions_live)


async def _inject(cluster: LocalCluster, plan: list[Fault], t0: float, lh: WriteHandle,
                  timeline: list[tuple[str, str, float, float]]) -> None:
    """Run the plan step by step; a step that starts late (the one before overran) keeps its
    faults' offsets from each other, so an overlapping pair still overlaps."""
    late_s = 0.0
    for _, group in itertools.groupby(plan, key=lambda f: f.step):
        faults = list(group)
        first_at = t0 + faults[0].at_s + late_s
        late_s += max(0.0, time.monotonic() - first_at)
        busy: set[str] = set()
        # Every fault of the step runs to its end (it undoes what it did) before a failure is raised.
        results = await asyncio.gather(*(_fault(cluster, f, t0 + f.at_s + late_s, lh, busy, timeline, t0)
                                         for f in faults),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r


async def run_scenario(cluster: LocalCluster, seed: int, *, duration_s: float = 15.0, window: int = 200,
                       ensemble: int = 3, write_quorum: int = 2, ack_quorum: int = 2, faults: int = 5,
                       add_timeout_s: float = 2.0, plan: list[Fault] | None = None,
                       rate_per_s: float | None = None) -> Report:
    """Stream adds for duration_s (and until the last fault is healed) under the seed's fault
    schedule, or under `plan` if given, then check every invariant.

    At most `window` adds are outstanding; rate_per_s (None: as fast as they are acknowledged)
    paces the stream, so that on a small machine the writer does not starve the bookies and
    ZooKeeper it is hurting of CPU: their restarts then take as long as they would in service.
    """
    if plan is None:
        session_timeout_s = cluster.bookies[0].conf["zk_session_timeout_ms"] / 1000.0
        plan = schedule(seed, duration_s=duration_s, ensemble=ensemble, bookies=len(cluster.bookies),
                        faults=faults, session_timeout_s=session_timeout_s)
    report = Report(seed, plan)
    hist = History(None)
    t_start = time.monotonic()
    async with await BookKeeper.connect(cluster.metadata_uri, seed=seed, add_timeout_s=add_timeout_s,
                                        read_timeout_s=add_timeout_s) as bk:
        lh = await bk.create_ledger(ensemble=ensemble, write_quorum=write_quorum, ack_quorum=ack_quorum,
                                    password=b"faults")
        injector = asyncio.create_task(_inject(cluster, plan, time.monotonic(), lh, report.timeline))
        acked: list[int] = []
        lid = lh.ledger_id
        pending: deque[asyncio.Future[int]] = deque()
        next_id = 0
        t_stream = time.monotonic()
        deadline = t_stream + duration_s
        try:
            while time.monotonic() < deadline or not injector.done():
                while len(pending) < window and (rate_per_s is None
                                                 or next_id <= rate_per_s * (time.monotonic() - t_stream)):
                    data = payload(seed, next_id)
                    hist.record("w0", "invoke", "add", ledger_id=lid, entry_id=next_id, value=digest(data))
                    pending.append(lh.add_entry_async(data))
                    next_id += 1
                if not pending and rate_per_s is not None:  # paced, nothing in flight: until the next is due
                    await asyncio.sleep(next_id / rate_per_s - (time.monotonic() - t_stream))
                    continue
                # Bounded: a stalled writer is a failure to report, not a hang of the harness.
                acked.append(await asyncio.wait_for(pending.popleft(), STALL_S))
                hist.record("w0", "ok", "add", ledger_id=lid, entry_id=acked[-1])
                hist.record("w0", "ok", "lac", ledger_id=lid, value=lh.last_add_confirmed)
            for fut in pending:
                acked.append(await asyncio.wait_for(fut, STALL_S))
                hist.record("w0", "ok", "add", ledger_id=lid, entry_id=acked[-1])
        except Exception as e:  # the writer must never see an error: record it for the checker
            report.writer_errors.append(f"{type(e).__name__}: {e}")
            for fut in pending:  # the same error, once per add: reported above, not at garbage collection
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        report.stream_s = time.monotonic() - t_start
        try:
            await injector
        except Exception as e:
            report.fault_errors.append(f"{type(e).__name__}: {e}")
        report.ensemble_changes = bk.stats["ensemble_changes"]
        report.quarantine_overridden = bk.stats["quarantine_overridden"]
        report.acked = len(acked)
        if acked != list(range(len(acked))):
            report.writer_errors.append("acknowledged ids are not contiguous and in order")
    # Check with a fresh client, as any reader would: recovery open, then read everything back.
    async with await BookKeeper.connect(cluster.metadata_uri, seed=seed + 1) as reader:
        rh = await reader.open_ledger(lh.ledger_id, password=b"faults")
        report.closed_last_entry = rh.last_add_confirmed
        report.segments = len(rh.metadata.ensembles)
        hist.record("final", "ok", "recover", ledger_id=lid, end=rh.last_add_confirmed)
        got = await rh.read(0, rh.last_add_confirmed) if rh.last_add_confirmed >= 0 else []
        hist.record("final", "ok", "read", ledger_id=lid, entry_id=0, values=[digest(e.data) for e in got])
        await reader.delete_ledger(lh.ledger_id)
    report.anomalies = check_history(hist.records).anomalies
    report.lac_regressions = sum(a.kind == "lac_regression" for a in report.anomalies)
    report.missing_or_altered = sorted({a.entry_id for a in report.anomalies
                                        if a.kind != "lac_regression" and a.entry_id is not None})
    report.seconds = time.monotonic() - t_start
    return report
