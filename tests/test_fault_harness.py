"""The fault harness: seeded schedules of kill -9, SIGSTOP/SIGCONT, graceful restarts, bookie
ZooKeeper sessions expiring, ZooKeeper restarts and overlapping bookie restarts, during pipelined
adds on a real cluster (ZooKeeper + 6 bookies), checked against the writer's record of
acknowledged entries.

Reference: docs/design.md invariants 1 (no acknowledged entry lost or altered), 2 (in-order acks,
LAC never backwards), 3 (recovery closes at a point every reader agrees on); issue 10 item 5
(writers ride through every survivable fault, for as long as they live; Apache BookKeeper's
bookie quarantine). Each scenario has a fixed seed; its report line is printed. The writer's
history is judged by bk verify's checker (bookkeeper.verify), the one implementation of it.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from bookkeeper.testing.cluster import LocalCluster
from bookkeeper.testing.faults import (
    FAULTS,
    OVERLAP,
    Report,
    overlap_survivable,
    payload,
    rolling_restarts,
    run_scenario,
    schedule,
)
from tests.conftest import run

pytestmark = pytest.mark.runtime(350)

BOOKIES = 6
SESSION_TIMEOUT_MS = 4000
SEEDS = [101, 202]  # the seeds of issue 10 that ran writers out of replacement bookies
QUORUMS = [(3, 2, 2), (3, 3, 2), (5, 3, 2)]
DURATION_S = 15.0
FAULTS_PER_RUN = 7  # every kind once (the kill and the restart overlapping where survivable), 2 more
RATE_PER_S = 1500  # paced: a 2-core machine keeps CPU for the restarts the stream rides through


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("harness"), bookies=BOOKIES, shards=2,
                     bookie_conf={"zk_session_timeout_ms": SESSION_TIMEOUT_MS})
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _assert_rode_through(report: Report) -> None:
    print(report.summary())
    assert report.acked > 0, report.summary()
    assert not report.fault_errors, report.fault_errors
    assert not report.writer_errors, report.writer_errors
    assert report.lac_regressions == 0, report.summary()
    assert report.missing_or_altered == [], report.summary()
    assert report.anomalies == [], report.summary()  # bk verify's checker over the writer's history
    assert report.closed_last_entry >= report.acked - 1, report.summary()


def test_schedule_is_fixed_by_its_seed() -> None:
    """Same seed, same faults; a different seed, a different plan. Every kind comes once, the
    overlapping pair only where two spare bookies can replace both, a hang stays a hang and a
    session expiry outlasts the session; steps never overlap each other."""
    a = schedule(101, duration_s=15, ensemble=3, bookies=6, faults=5, session_timeout_s=4.0)
    assert a == schedule(101, duration_s=15, ensemble=3, bookies=6, faults=5, session_timeout_s=4.0)
    assert a != schedule(202, duration_s=15, ensemble=3, bookies=6, faults=5, session_timeout_s=4.0)
    assert payload(1, 2) != payload(1, 3) and payload(1, 2) != payload(2, 2)
    for ensemble in (3, 5):
        for seed in SEEDS:
            plan = schedule(seed, duration_s=15, ensemble=ensemble, bookies=6, faults=7, session_timeout_s=4.0)
            assert len(plan) == 7
            assert set(FAULTS) <= {f.kind for f in plan}
            steps = [[f for f in plan if f.step == n] for n in sorted({f.step for f in plan})]
            pairs = [s for s in steps if len(s) == 2]
            assert len(pairs) == (1 if overlap_survivable(bookies=6, ensemble=ensemble) else 0)
            for first, second in pairs:
                assert first.slot != second.slot and first.at_s < second.at_s < first.at_s + first.hold_s
            for f in plan:
                assert (f.slot == -1) == (f.kind == "zk_restart") and f.slot < ensemble and f.hold_s >= 0
                assert f.kind != "hang" or f.hold_s < 4.0 * 0.6 + 1e-9
                assert f.kind != "session_expiry" or f.hold_s > 4.0 + 0.5
            assert [f.at_s for f in plan] == sorted(f.at_s for f in plan)
    assert not overlap_survivable(bookies=6, ensemble=5) and overlap_survivable(bookies=6, ensemble=3)
    assert OVERLAP not in FAULTS
    assert [len(schedule(7, duration_s=5, ensemble=3, bookies=6, faults=n)) for n in (3, 5, 8)] == [3, 5, 8]
    assert [(f.kind, f.slot, f.step) for f in rolling_restarts(4, ensemble=3)] == [
        ("restart", 0, 0), ("restart", 1, 1), ("restart", 2, 2), ("restart", 0, 3)]


@pytest.mark.parametrize("quorums", QUORUMS, ids=lambda q: "%d-%d-%d" % q)
@pytest.mark.parametrize("seed", SEEDS)
def test_writer_rides_through_a_seeded_schedule(cluster: LocalCluster, seed: int,
                                                quorums: tuple[int, int, int]) -> None:
    """kill -9, SIGSTOP/SIGCONT, a graceful restart, a bookie's ZooKeeper session expiring, a
    ZooKeeper restart and (where two spares exist) two bookies down at overlapping times, during
    the stream: the writer never errs, every acknowledged entry reads back identical after
    recovery, ids contiguous, LAC monotonic."""
    ensemble, write_quorum, ack_quorum = quorums
    report = run(run_scenario(cluster, seed, duration_s=DURATION_S, ensemble=ensemble,
                              write_quorum=write_quorum, ack_quorum=ack_quorum, faults=FAULTS_PER_RUN,
                              rate_per_s=RATE_PER_S))
    _assert_rode_through(report)
    cluster.wait_registered()


def test_writer_lives_through_twenty_restarts_of_its_ensemble(cluster: LocalCluster) -> None:
    """20 graceful restarts of the bookies in a 3/2/2 writer's ensemble, one at a time, each back
    and registered before the next: far more failures than spare bookies, so the writer must
    take back bookies that failed on it (quarantined ones, when nothing else is left). It
    never errs and nothing acknowledged is lost."""
    plan = rolling_restarts(20, ensemble=3)
    report = run(run_scenario(cluster, 20, duration_s=0.0, plan=plan, rate_per_s=RATE_PER_S))
    _assert_rode_through(report)
    # More replacements than spare bookies: the writer did take back bookies that failed on it.
    assert report.ensemble_changes > BOOKIES - 3, report.summary()
    cluster.wait_registered()
