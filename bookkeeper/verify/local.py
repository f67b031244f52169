"""`bk verify local`: a LocalCluster (ZooKeeper + N bookies on this host) under the workload,
hurt by the harness's own fault kinds on the seeded schedule.

Why it reuses bookkeeper.testing.faults: the suite's fault harness and this command inject the
same faults the same way (inject_bookie_fault / heal_bookie_fault, zookeeper_stop / zookeeper_start), so a
fix to how a fault is made or awaited serves both. `ensemble_kill` is this module's own: every
bookie of a live ledger's ensemble killed -9 at once and started again, the one fault that
loses what a bookie acknowledged before its journal synced (the ack_before_sync test switch).
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from bookkeeper.testing.cluster import LocalBookie, LocalCluster
from bookkeeper.testing.faults import heal_bookie_fault, inject_bookie_fault, zookeeper_start, zookeeper_stop
from bookkeeper.testing_switches import ACK_BEFORE_SYNC, ENV
from bookkeeper.verify.checker import VerifyReport
from bookkeeper.verify.nemesis import FaultError, FaultStep, fault_schedule
from bookkeeper.verify.workload import WorkloadOptions, WorkloadState, run_verify

SESSION_TIMEOUT_S = 4.0  # the local bookies' ZooKeeper session: a session expiry fits in a short run
BOOKIE_KINDS = ("kill", "hang", "restart", "session_expiry")
LOCAL_KINDS = (*BOOKIE_KINDS, "zk_restart", "ensemble_kill")
DEFAULT_KINDS = (*BOOKIE_KINDS, "zk_restart")
# Holds per kind: a hang stays under 0.6 of the session timeout (a hang, not a session loss);
# a session expiry outlasts it by more than a tick (ZooKeeper expires the session for sure).
HOLD_S = {"kill": (0.5, 2.0), "hang": (0.5, SESSION_TIMEOUT_S * 0.6), "restart": (0.0, 1.0),
          "session_expiry": (SESSION_TIMEOUT_S + 1.0, SESSION_TIMEOUT_S + 1.5), "zk_restart": (0.2, 1.5),
          "ensemble_kill": (0.5, 1.5)}
# Between steps: short, since each local step already takes seconds beyond its hold (a bookie's
# start and registration, ZooKeeper's JVM start), and a short run should still see every kind.
GAP_S = (1.0, 2.5)
ACK_BEFORE_SYNC_ENV = {ENV: ACK_BEFORE_SYNC}


class LocalFaults:
    """The fault executor of `bk verify local`: targets are bookies (target % N), or for
    ensemble_kill a writer's current ledger (target % writers)."""

    def __init__(self, cluster: LocalCluster, state: WorkloadState) -> None:
        self.cluster = cluster
        self.state = state
        self._held: dict[int, tuple[list[LocalBookie], dict[str, int]]] = {}

    async def apply(self, step: FaultStep, phase: str) -> None:
        if step.kind == "zk_restart":
            await (zookeeper_stop if phase == "inject" else zookeeper_start)(self.cluster)
            return
        if phase == "inject":
            bookies = self._targets(step)
            expired: dict[str, int] = {}
            for b in bookies:
                expired.update(await inject_bookie_fault(self.cluster, _bookie_kind(step.kind), b))
            self._held[step.step] = (bookies, expired)
            return
        bookies, expired = self._held.pop(step.step, ([], {}))
        for b in bookies:
            await heal_bookie_fault(self.cluster, _bookie_kind(step.kind), b, expired)

    def _targets(self, step: FaultStep) -> list[LocalBookie]:
        bookies = self.cluster.bookies
        if step.kind != "ensemble_kill":
            return [bookies[step.target % len(bookies)]]
        live = [lh for _, lh in sorted(self.state.current.items())]
        if not live:
            raise FaultError("ensemble_kill: no writer has a ledger open")
        ensemble = set(live[step.target % len(live)].metadata.last_ensemble)
        return [b for b in bookies if b.bookie_id in ensemble]


def _bookie_kind(kind: str) -> str:
    return "kill" if kind == "ensemble_kill" else kind


async def run_local(options: WorkloadOptions, *, bookies: int, directory: Path | None = None,
                    kinds: list[str] | None = None, ack_before_sync: bool = False, shards: int = 1) -> VerifyReport:
    """Start ZooKeeper and `bookies` bookies under `directory` (a temporary one, removed after,
    if None), run the workload under the seeded local faults, stop the cluster, and return the
    checked report; the history is `directory`/history.jsonl, the cluster `directory`/cluster
    (kept only after an anomaly or a failed fault step, removed at the next run's start)."""
    kinds = list(kinds or (*DEFAULT_KINDS, *(("ensemble_kill",) if ack_before_sync else ())))
    unknown = [k for k in kinds if k not in LOCAL_KINDS]
    if unknown:
        raise ValueError(f"unknown local fault kind(s) {', '.join(unknown)}: choose from {', '.join(LOCAL_KINDS)}")
    if bookies < max(e for e, _, _ in options.ensembles):
        raise ValueError(f"{bookies} bookies cannot hold an ensemble of {max(e for e, _, _ in options.ensembles)}")
    temp = directory is None
    root = Path(tempfile.mkdtemp(prefix="bk-verify-")) if directory is None else directory
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(root / "cluster", ignore_errors=True)  # an earlier run's: its data would be taken for ours
    cluster = LocalCluster(root / "cluster", bookies=bookies, shards=shards,
                           bookie_conf={"zk_session_timeout_ms": int(SESSION_TIMEOUT_S * 1000)},
                           bookie_env=ACK_BEFORE_SYNC_ENV if ack_before_sync else None)
    keep_cluster = True
    try:
        cluster.start()
        state = WorkloadState()
        steps = fault_schedule(options.seed, kinds, seconds=options.seconds, hold_s=HOLD_S, gap_s=GAP_S)
        report = await run_verify(cluster.metadata_uri, options, history_path=root / "history.jsonl",
                                  faults=LocalFaults(cluster, state), fault_steps=steps, state=state)
        # The bookies' data and logs (hundreds of MB after three minutes) only help explain a failure.
        keep_cluster = bool(report.anomalies or report.fault_errors)
        if temp:
            report.history = None  # removed with the directory below
        return report
    finally:
        cluster.stop()
        if temp:
            shutil.rmtree(root, ignore_errors=True)
        elif not keep_cluster:
            shutil.rmtree(root / "cluster", ignore_errors=True)
