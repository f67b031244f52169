"""Seeded fault schedules against a LocalCluster, and the checker of DESIGN.md's invariants.

A scenario streams pipelined adds into one ledger while a schedule, fixed by its seed,
kills (-9), hangs (SIGSTOP/SIGCONT) and restarts bookies one at a time. The checker
then compares the writer's own record of acknowledged entries with what a recovery
open reads back: nothing acknowledged lost or altered, ids contiguous, LAC never
went back, and the writer never saw an error.
"""
from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections import deque
from dataclasses import dataclass, field

from bookkeeper.client import BookKeeper, WriteHandle
from bookkeeper.testing.cluster import LocalCluster

FAULTS = ("kill", "hang", "restart")
STALL_S = 30.0  # an add not acknowledged in this long counts as a stalled writer


@dataclass(frozen=True, slots=True)
class Fault:
    at_s: float        # seconds after the stream starts
    kind: str          # kill | hang | restart
    slot: int          # position in the ledger's current ensemble: the fault always hits a bookie in use
    hold_s: float      # how long the bookie stays down or hung


def schedule(seed: int, *, duration_s: float, ensemble: int, faults: int = 3,
             kinds: tuple[str, ...] = FAULTS) -> list[Fault]:
    """`faults` faults, one bookie at a time, spread over duration_s; the same seed, the same list."""
    rng = random.Random(seed)
    slot = duration_s / faults
    out = []
    for i in range(faults):
        hold = round(rng.uniform(0.5, min(3.0, slot * 0.6)), 2)
        at = round(i * slot + rng.uniform(0.1, max(0.2, slot - hold - 0.1)), 2)
        out.append(Fault(at, kinds[i % len(kinds)] if i < len(kinds) else rng.choice(kinds),
                         rng.randrange(ensemble), hold))
    return out


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
    lac_regressions: int = 0
    closed_last_entry: int = -1
    missing_or_altered: list[int] = field(default_factory=list)
    segments: int = 0
    ensemble_changes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (not self.writer_errors and not self.lac_regressions and not self.missing_or_altered
                and self.closed_last_entry >= self.acked - 1)

    def summary(self) -> str:
        return (f"seed={self.seed} faults={[(f.kind, f.slot, f.at_s, f.hold_s) for f in self.faults]} "
                f"acked={self.acked} closed_at={self.closed_last_entry} segments={self.segments} "
                f"ensemble_changes={self.ensemble_changes} writer_errors={len(self.writer_errors)} "
                f"lac_regressions={self.lac_regressions} lost_or_altered={len(self.missing_or_altered)} "
                f"time={self.seconds:.1f}s ok={self.ok}")


async def _inject(cluster: LocalCluster, faults: list[Fault], t0: float, lh: WriteHandle) -> None:
    loop = asyncio.get_running_loop()
    for f in faults:
        await asyncio.sleep(max(0.0, t0 + f.at_s - time.monotonic()))
        target = lh.metadata.last_ensemble[f.slot]
        b = next(b for b in cluster.bookies if b.bookie_id == target)
        if f.kind == "kill":
            await loop.run_in_executor(None, b.kill)
            await asyncio.sleep(f.hold_s)
            await loop.run_in_executor(None, b.start)
        elif f.kind == "hang":
            b.hang()
            await asyncio.sleep(f.hold_s)
            b.resume()
        else:
            await loop.run_in_executor(None, cluster.restart_bookie, b)
        await loop.run_in_executor(None, cluster.wait_registered, [b])


async def run_scenario(cluster: LocalCluster, seed: int, *, duration_s: float = 8.0, window: int = 200,
                       ensemble: int = 3, write_quorum: int = 2, ack_quorum: int = 2, faults: int = 3,
                       add_timeout_s: float = 2.0) -> Report:
    """Stream adds for duration_s under the seed's fault schedule, then check every invariant."""
    plan = schedule(seed, duration_s=duration_s, ensemble=ensemble, faults=faults)
    report = Report(seed, plan)
    t_start = time.monotonic()
    async with await BookKeeper.connect(cluster.metadata_uri, seed=seed, add_timeout_s=add_timeout_s,
                                        read_timeout_s=add_timeout_s) as bk:
        lh = await bk.create_ledger(ensemble=ensemble, write_quorum=write_quorum, ack_quorum=ack_quorum,
                                    password=b"faults")
        injector = asyncio.create_task(_inject(cluster, plan, time.monotonic(), lh))
        acked: list[int] = []
        last_lac = -1
        pending: deque[asyncio.Future[int]] = deque()
        next_id = 0
        deadline = time.monotonic() + duration_s
        try:
            while time.monotonic() < deadline or not injector.done():
                while len(pending) < window:
                    pending.append(lh.add_entry_async(payload(seed, next_id)))
                    next_id += 1
                # Bounded: a stalled writer is a failure to report, not a hang of the harness.
                acked.append(await asyncio.wait_for(pending.popleft(), STALL_S))
                lac = lh.last_add_confirmed
                if lac < last_lac:
                    report.lac_regressions += 1
                last_lac = lac
            for fut in pending:
                acked.append(await asyncio.wait_for(fut, STALL_S))
        except Exception as e:  # the writer must never see an error: record it for the checker
            report.writer_errors.append(f"{type(e).__name__}: {e}")
        await injector
        report.ensemble_changes = bk.stats["ensemble_changes"]
        report.acked = len(acked)
        if acked != list(range(len(acked))):
            report.writer_errors.append("acknowledged ids are not contiguous and in order")
    # Check with a fresh client, as any reader would: recovery open, then read everything back.
    async with await BookKeeper.connect(cluster.metadata_uri, seed=seed + 1) as reader:
        rh = await reader.open_ledger(lh.ledger_id, password=b"faults")
        report.closed_last_entry = rh.last_add_confirmed
        report.segments = len(rh.metadata.ensembles)
        got = await rh.read(0, rh.last_add_confirmed) if rh.last_add_confirmed >= 0 else []
        by_id = {e.entry_id: e.data for e in got}
        report.missing_or_altered = [i for i in acked if by_id.get(i) != payload(seed, i)]
        await reader.delete_ledger(lh.ledger_id)
    report.seconds = time.monotonic() - t_start
    return report
