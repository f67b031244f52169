"""The deterministic simulator (bookkeeper.testing.sim, `bk sim`): its parts behave as the
things they stand in for, CI's seeds hold on the production code, a seed replays byte for
byte, and the invariants catch the known-wrong rules (mutations) swapped in."""
from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from kazoo.exceptions import BadVersionError, ConnectionLoss, NodeExistsError, NoNodeError, RolledBackError

from bookkeeper.testing.sim import MUTATIONS, SimConfig, run
from bookkeeper.testing.sim.disk import SimSyncer
from bookkeeper.testing.sim.loop import SimLoop, Stuck
from bookkeeper.testing.sim.net import NODE, SimNetwork
from bookkeeper.testing.sim.zk import SimZooKeeper

CI_SEEDS = range(0, 24)
CI_OPS = 1500
MUTATION_SEEDS = range(0, 20)
# Mutations the simulator does not catch within 20 seeds yet (docs/simulation.md says why);
# the test below fails if one of them starts being caught, so the list stays true.
NOT_CAUGHT_YET = {"recovery-fences-one", "recovery-below-last-segment"}
# Mutations a seed of 0..19 catches on one interpreter and not on another (asyncio schedules
# differently between Python versions, and a seed's run with it): a catch must still be by
# one of their invariants. replaced-bookie-acks-count: caught at seed 0 on 3.13, not within
# 20 on 3.11 (its script, tests/data/writer/acks_during_change.txt, places it exactly).
SOMETIMES_CAUGHT = {"replaced-bookie-acks-count"}
# Which invariants may catch each mutation (docs/simulation.md's table).
CAUGHT_BY = {
    "ack-before-qa": {"ack-quorum"},
    "lac-from-unacked": {"lac-ahead"},
    "recovery-without-fence": {"lost-entry", "acked-after-close", "stream-lost"},
    "recovery-reads-without-fence": {"acked-after-close", "lost-entry"},
    "fenced-takes-add": {"fenced-add", "fence-lost"},
    "no-resend-to-replaced": {"stuck"},
    "fence-before-durable": {"fenced-add", "fence-lost"},
    "replay-past-corrupt-middle": {"lost-on-restart"},
    "no-replacement-on-late-failure": {"kept-failed-bookie"},
    "gc-stale-listing": {"gc-dropped-live"},
    "replaced-bookie-acks-count": {"under-replicated", "lost-entry", "acked-after-close"},
    "recovery-from-interrupted-segments": {"acked-after-close", "kept-failed-bookie", "lost-entry", "under-replicated",
                                           "stream-lost"},
    "ack-before-fsync": {"refused-start", "lost-on-restart"},
}
BK = [sys.executable, "-m", "bookkeeper.cli.main"]


# -- the parts -------------------------------------------------------------------------
def test_virtual_time_jumps_to_the_next_timer_and_keeps_order() -> None:
    loop = SimLoop()
    order: list[tuple[float, str]] = []

    async def main() -> None:
        loop.call_later(5.0, lambda: order.append((loop.time(), "b")))
        loop.call_later(1.0, lambda: order.append((loop.time(), "a")))
        await asyncio.sleep(3600.0)
        order.append((loop.time(), "slept"))
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert order == [(1.0, "a"), (5.0, "b"), (3600.0, "slept")]


def test_a_world_waiting_on_nothing_is_stuck_not_asleep() -> None:
    loop = SimLoop()
    try:
        with pytest.raises(Stuck):
            loop.run_until_complete(loop.create_future())
    finally:
        loop.close()


def test_executor_jobs_run_on_the_loop_after_their_virtual_duration() -> None:
    loop = SimLoop()
    loop.executor_delay = lambda _fn: 0.25

    async def main() -> tuple[float, int]:
        got = await loop.run_in_executor(None, lambda: 42)
        return loop.time(), got
    try:
        assert loop.run_until_complete(main()) == (0.25, 42)
    finally:
        loop.close()


class _Sink(asyncio.Protocol):
    def __init__(self) -> None:
        self.data = bytearray()
        self.lost: list[Exception | None] = []

    def data_received(self, data: bytes) -> None:
        self.data += data

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.append(exc)


def _pair(net: SimNetwork, loop: SimLoop) -> tuple[asyncio.Transport, _Sink, _Sink]:
    server = _Sink()
    net.listen("b", "b", 1, lambda: server)
    NODE.set("a")
    client = _Sink()
    transport, _ = loop.run_until_complete(net.connect(lambda: client, "b", 1))
    return transport, client, server


def test_the_network_delivers_split_packets_in_order_and_holds_them_across_a_partition() -> None:
    loop = SimLoop()
    net = SimNetwork(loop, random.Random(3), split=1.0)
    try:
        transport, _client, server = _pair(net, loop)
        payload = bytes(range(256)) * 40
        for i in range(0, len(payload), 1000):
            transport.write(payload[i:i + 1000])
        loop.run_until_complete(asyncio.sleep(1.0))
        assert bytes(server.data) == payload  # every write cut into packets, all in order
        assert net.stats["packets"] > len(payload) // 1000 + 1
        net.hold("a", "b")
        transport.write(b"held")
        loop.run_until_complete(asyncio.sleep(1.0))
        assert bytes(server.data) == payload
        net.release("a", "b")
        loop.run_until_complete(asyncio.sleep(1.0))
        assert bytes(server.data) == payload + b"held"
    finally:
        loop.close()


def test_a_reset_loses_what_is_in_flight_and_tells_both_ends() -> None:
    loop = SimLoop()
    net = SimNetwork(loop, random.Random(4))
    try:
        transport, client, server = _pair(net, loop)
        net.hold("a", "b")
        transport.write(b"lost")
        assert net.reset_between("a", "b") == 1
        net.release("a", "b")
        loop.run_until_complete(asyncio.sleep(1.0))
        assert server.data == b"" and client.lost == [None]
        assert len(server.lost) == 1 and isinstance(server.lost[0], ConnectionResetError)
    finally:
        loop.close()


def test_znodes_keep_versions_sequences_ephemerals_and_all_or_nothing_multis() -> None:
    loop = SimLoop()
    try:
        zk = SimZooKeeper(loop, random.Random(1))
        a = zk.client("a", lambda _n: False)
        b = zk.client("b", lambda _n: False)
        a.ensure_path("/r/ids")
        first = a.create("/r/ids/ID-", sequence=True)
        second = a.create("/r/ids/ID-", sequence=True)
        assert (first, second) == ("/r/ids/ID-0000000000", "/r/ids/ID-0000000001")
        a.create("/r/n", b"v0")
        stat = a.set("/r/n", b"v1", version=0)
        assert stat.version == 1
        with pytest.raises(BadVersionError):
            b.set("/r/n", b"late", version=0)
        b.create("/r/eph", b"", ephemeral=True)
        assert a.exists("/r/eph").ephemeralOwner == b.client_id[0]
        seen: list[str] = []
        a.get("/r/n", watch=lambda e: seen.append(e.type))
        t = a.transaction()
        t.set_data("/r/n", b"v2", version=1)
        t.create("/r/n", b"exists already")
        results = t.commit()
        assert isinstance(results[0], RolledBackError) and isinstance(results[1], NodeExistsError)
        assert a.get("/r/n")[0] == b"v1"
        loop.run_until_complete(asyncio.sleep(0))
        assert seen == []  # a rolled-back multi fires no watch
        b.expire()
        assert a.exists("/r/eph") is None
        with pytest.raises(NoNodeError):
            a.get("/r/eph")
        a.set("/r/n", b"v3")
        loop.run_until_complete(asyncio.sleep(0))
        assert seen == ["CHANGED"]
    finally:
        loop.close()


def test_a_lost_reply_still_applied_the_write() -> None:
    loop = SimLoop()
    try:
        zk = SimZooKeeper(loop, random.Random(1), reply_loss_rate=1.0)
        a = zk.client("a", lambda _n: False)
        with pytest.raises(ConnectionLoss):
            a.create("/x", b"1")
        zk.reply_loss_rate = 0.0
        assert a.get("/x")[0] == b"1"
    finally:
        loop.close()


def test_a_power_loss_keeps_synced_bytes_and_a_prefix_of_the_rest(tmp_path: Path) -> None:
    loop = SimLoop()
    try:
        syncer = SimSyncer(loop, random.Random(7), latency_s=(1e-3, 1e-3))
        fd = os.open(tmp_path / "j", os.O_RDWR | os.O_CREAT)
        done: list[object] = []
        syncer.submit(fd, b"A" * 100, 0, done.append)
        loop.run_until_complete(asyncio.sleep(0.01))
        syncer.submit(fd, b"B" * 100, 100, done.append)
        assert syncer.crash() <= 1
        data = os.pread(fd, 200, 0)
        os.close(fd)
        assert done == [None]  # the second sync never returned
        assert data[:100] == b"A" * 100
        kept = data[100:].rstrip(b"\0")
        assert kept == b"B" * len(kept)
    finally:
        loop.close()


# -- whole runs --------------------------------------------------------------------------
@pytest.mark.parametrize("seed", CI_SEEDS)
def test_ci_seeds_hold_every_invariant(seed: int) -> None:
    result = run(SimConfig.from_seed(seed, CI_OPS))
    assert result.violation is None, f"seed {seed}: {result.violation}\n" + "\n".join(result.trace_tail)
    assert result.acked > 0 and result.ledgers > 0, result


def test_without_faults_only_recovery_opens_fail_adds() -> None:
    """No fault injected: the adds that fail are those in flight when a recovery open fenced
    their ledger (the workload's racing recoveries), a window's worth per recovery at most."""
    result = run(SimConfig.default(11, 2000, faults=False))
    assert result.violation is None
    assert result.faults == {}
    assert result.adds - result.acked <= 64 * 50 * result.recoveries
    assert result.acked > 0.9 * result.adds


def _trace(tmp_path: Path, hash_seed: str) -> bytes:
    path = tmp_path / f"trace-{hash_seed}"
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    proc = subprocess.run([*BK, "sim", "--seed", "5", "--ops", "1200", "--trace", str(path), "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return path.read_bytes()


def test_a_seed_replays_byte_for_byte_under_two_hash_seeds(tmp_path: Path) -> None:
    one, two = _trace(tmp_path, "1"), _trace(tmp_path, "2")
    assert one == two
    assert b" acked " in one and b" created on " in one  # a trace of the writers' progress, not just a header


def test_every_mutation_has_a_verdict_here() -> None:
    assert set(MUTATIONS) == set(CAUGHT_BY) | NOT_CAUGHT_YET


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_mutation_is_caught_within_20_seeds(mutation: str) -> None:
    caught = None
    for seed in MUTATION_SEEDS:
        result = run(SimConfig.from_seed(seed, CI_OPS), mutation=mutation)
        if result.violation is not None:
            caught = (seed, result.violation.invariant)
            break
    if mutation in NOT_CAUGHT_YET:
        assert caught is None, f"{mutation} is caught now ({caught}): take it off NOT_CAUGHT_YET"
    elif mutation in SOMETIMES_CAUGHT:
        assert caught is None or caught[1] in CAUGHT_BY[mutation], caught
    else:
        assert caught is not None, f"{mutation}: no seed of {MUTATION_SEEDS} caught it"
        assert caught[1] in CAUGHT_BY[mutation], caught


# -- bk sim ------------------------------------------------------------------------------
def test_bk_sim_prints_a_summary_and_exits_0() -> None:
    proc = subprocess.run([*BK, "sim", "--seed", "2", "--ops", "600", "--json"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["seed"] == 2 and report["violation"] is None and report["acked"] > 0
    assert report["config"].startswith("E/Qw/Qa") and report["cpu_us_per_add"] > 0


def test_bk_sim_on_a_violation_exits_1_with_the_invariant_seed_commit_trace_and_replay() -> None:
    proc = subprocess.run([*BK, "sim", "--seed", "0", "--ops", "600", "--mutation", "ack-before-qa"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "VIOLATION ack-quorum" in out and "seed 0, ops 600, commit " in out
    assert "last trace lines:" in out and "L0 created" in out
    assert "reproduce: bk sim --seed 0 --ops 600 --mutation ack-before-qa" in out


def test_bk_sim_lists_mutations_and_refuses_an_unknown_one() -> None:
    listed = subprocess.run([*BK, "sim", "--list-mutations"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0
    assert [line.split()[0] for line in listed.stdout.splitlines()] == list(MUTATIONS)
    bad = subprocess.run([*BK, "sim", "--mutation", "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "bk sim --list-mutations" in bad.stderr
