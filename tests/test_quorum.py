"""Striping and quorum rules of the sans-I/O client core (bookkeeper/client/core/quorum.py).

The brute-force oracles below restate docs/design.md's definitions directly (write set =
ensemble[(e + i) % E] for i < Qw; an entry is acknowledged by Qa bookies of its write
set) instead of reusing the product's helpers.
"""
from __future__ import annotations

import itertools
import random

import pytest

from bookkeeper.client.core import AddTracker, entry_missing, fence_covered, write_set

CONFIGS = [(3, 2, 2), (3, 3, 2), (5, 3, 2), (1, 1, 1)]


def oracle_write_set(e: int, E: int, Qw: int) -> list[int]:
    """docs/design.md: entry e goes to ensemble[(e + i) % E] for i in 0..Qw-1."""
    return [(e + i) % E for i in range(Qw)]


def oracle_fence_covered(responded: set[int], E: int, Qw: int, Qa: int) -> bool:
    """Fencing is covered iff no future entry id can find Qa unfenced bookies inside its write set."""
    for e in range(3 * E):  # every rotation, several times over
        ws = oracle_write_set(e, E, Qw)
        for quorum in itertools.combinations(ws, Qa):
            if not any(b in responded for b in quorum):
                return False  # the old writer could still get e acknowledged by this quorum
    return True


def oracle_entry_missing(deniers: set[int], ws: list[int], Qa: int) -> bool:
    """An entry is surely unacknowledged iff no Qa-subset of its write set avoids every bookie that denied it."""
    return not any(all(b not in deniers for b in q) for q in itertools.combinations(ws, Qa))


# -- write_set --------------------------------------------------------------------------


@pytest.mark.parametrize("E,Qw", [(1, 1), (3, 2), (3, 3), (5, 3), (5, 5), (7, 4)])
def test_write_set_is_round_robin_striping(E: int, Qw: int) -> None:
    """Entry e goes to ensemble indexes (e + i) % E for i in 0..Qw-1 (docs/design.md striping)."""
    for e in range(4 * E):
        ws = write_set(e, E, Qw)
        assert ws == oracle_write_set(e, E, Qw)
        assert len(set(ws)) == Qw  # distinct bookies
        assert ws[0] == e % E


def test_write_set_examples() -> None:
    """Concrete striping examples for E=5, Qw=3."""
    assert write_set(0, 5, 3) == [0, 1, 2]
    assert write_set(3, 5, 3) == [3, 4, 0]
    assert write_set(4, 5, 3) == [4, 0, 1]
    assert write_set(5, 5, 3) == [0, 1, 2]
    assert write_set(1_000_003, 5, 3) == [3, 4, 0]


@pytest.mark.parametrize("E,Qw", [(3, 2), (5, 3), (6, 2)])
def test_write_sets_spread_load_evenly(E: int, Qw: int) -> None:
    """Over E consecutive entries every bookie stores exactly Qw of them (striping balances load)."""
    counts = [0] * E
    for e in range(E):
        for b in write_set(e, E, Qw):
            counts[b] += 1
    assert counts == [Qw] * E


# -- AddTracker -----------------------------------------------------------------------


@pytest.mark.parametrize("E,Qw,Qa", [(0, 0, 0), (3, 2, 3), (2, 3, 2), (3, 3, 0)])
def test_add_tracker_rejects_invalid_quorums(E: int, Qw: int, Qa: int) -> None:
    """AddTracker needs 1 <= Qa <= Qw <= E."""
    with pytest.raises(ValueError):
        AddTracker(ensemble_size=E, write_quorum=Qw, ack_quorum=Qa)


def test_add_returns_write_set() -> None:
    """add() registers an entry and returns its striped write set."""
    t = AddTracker(ensemble_size=5, write_quorum=3, ack_quorum=2)
    assert t.add(0, 10) == (0, 1, 2)
    assert t.add(1, 10) == (1, 2, 3)
    assert t.outstanding == 2


def test_entry_acknowledged_exactly_at_ack_quorum() -> None:
    """An entry is acknowledged when the Qa-th bookie of its write set acks, not before."""
    t = AddTracker(ensemble_size=3, write_quorum=3, ack_quorum=2)
    t.add(0, 5)
    assert t.ack(0, 0) == []
    assert t.lac == -1
    assert t.ack(0, 2) == [(0, 5)]
    assert t.lac == 0 and t.length == 5
    assert t.ack(0, 1) == []  # late third ack changes nothing
    assert t.lac == 0 and t.length == 5 and t.outstanding == 0


def test_duplicate_ack_from_same_bookie_counts_once() -> None:
    """Qa counts distinct bookies: the same bookie acking twice is one ack."""
    t = AddTracker(ensemble_size=3, write_quorum=3, ack_quorum=2)
    t.add(0, 1)
    assert t.ack(0, 1) == []
    assert t.ack(0, 1) == []
    assert t.lac == -1
    assert t.ack(0, 2) == [(0, 1)]


def test_ack_from_bookie_outside_write_set_is_ignored() -> None:
    """Only bookies of the entry's write set count toward its ack quorum."""
    t = AddTracker(ensemble_size=5, write_quorum=3, ack_quorum=2)
    t.add(0, 1)  # write set [0, 1, 2]
    assert t.ack(0, 3) == [] and t.ack(0, 4) == []
    assert t.lac == -1
    assert t.ack(0, 0) == []
    assert t.ack(0, 2) == [(0, 1)]


def test_ack_of_unknown_entry_is_ignored() -> None:
    """An ack for an entry never added (or already acknowledged) returns nothing and moves nothing."""
    t = AddTracker(ensemble_size=3, write_quorum=2, ack_quorum=1)
    assert t.ack(5, 0) == []
    t.add(0, 1)
    assert t.ack(0, 0) == [(0, 1)]
    assert t.ack(0, 0) == [] and t.ack(0, 1) == []
    assert t.lac == 0


def test_out_of_order_acks_are_held_back_until_contiguous() -> None:
    """Entries are acknowledged in id order: a later entry at quorum waits for every earlier one (invariant 2)."""
    t = AddTracker(ensemble_size=3, write_quorum=2, ack_quorum=2)
    for e in range(4):
        t.add(e, 10 + e)
    # entries 1, 2 and 3 reach quorum first
    for e in (3, 2, 1):
        for b in write_set(e, 3, 2):
            assert t.ack(e, b) == []
    assert t.lac == -1 and t.length == 0 and t.outstanding == 4
    ws0 = write_set(0, 3, 2)
    assert t.ack(0, ws0[0]) == []
    done = t.ack(0, ws0[1])
    assert done == [(0, 10), (1, 21), (2, 33), (3, 46)]  # one contiguous run, in order, with running length
    assert t.lac == 3 and t.length == 46 and t.outstanding == 0


def test_run_stops_at_first_entry_below_quorum() -> None:
    """The acknowledged run stops at the first entry that has not reached Qa."""
    t = AddTracker(ensemble_size=3, write_quorum=3, ack_quorum=2)
    for e in range(5):
        t.add(e, 1)
    for e in (1, 3, 4):
        t.ack(e, 0)
        t.ack(e, 1)
    t.ack(0, 2)
    assert t.ack(0, 1) == [(0, 1), (1, 2)]  # entry 2 is short of quorum: 3 and 4 wait
    assert t.lac == 1
    t.ack(2, 0)
    assert t.ack(2, 2) == [(2, 3), (3, 4), (4, 5)]
    assert t.lac == 4


def test_tracker_resumes_from_given_lac_and_length() -> None:
    """A tracker built with lac/length (e.g. after an ensemble change) continues numbering from lac + 1."""
    t = AddTracker(ensemble_size=3, write_quorum=2, ack_quorum=1, lac=9, length=100)
    t.add(10, 5)
    assert t.ack(10, write_set(10, 3, 2)[1]) == [(10, 105)]
    assert t.lac == 10 and t.length == 105


@pytest.mark.parametrize("E,Qw,Qa", CONFIGS)
def test_random_ack_order_acknowledges_in_order_and_lac_never_goes_back(E: int, Qw: int, Qa: int) -> None:
    """Under any ack order the acknowledged ids are 0,1,2,... exactly once and the LAC never decreases."""
    rng = random.Random(E * 100 + Qw * 10 + Qa)
    for _ in range(30):
        n = 25
        t = AddTracker(ensemble_size=E, write_quorum=Qw, ack_quorum=Qa)
        events = []
        for e in range(n):
            for b in t.add(e, e + 1):
                events.append((e, b))
        rng.shuffle(events)
        acked: list[int] = []
        lac = -1
        for e, b in events:
            done = t.ack(e, b)
            assert t.lac >= lac
            lac = t.lac
            for eid, length in done:
                acked.append(eid)
                assert length == sum(range(1, eid + 2))
            if done:
                assert t.lac == done[-1][0]
        assert acked == list(range(n))
        assert t.lac == n - 1 and t.outstanding == 0


def test_fail_reports_when_ack_quorum_is_unreachable() -> None:
    """fail() returns True once fewer than Qa bookies of the write set remain able to ack."""
    t = AddTracker(ensemble_size=5, write_quorum=3, ack_quorum=2)
    t.add(0, 1)  # write set [0, 1, 2]
    assert t.fail(0, 1) is False  # 2 left, Qa = 2 still reachable
    assert t.fail(0, 1) is False  # same bookie again: still 2 left
    assert t.fail(0, 2) is True   # 1 left < Qa


def test_fail_with_qw_equal_qa_is_immediately_unreachable() -> None:
    """With Qw == Qa any single failure in the write set makes the quorum unreachable."""
    t = AddTracker(ensemble_size=3, write_quorum=2, ack_quorum=2)
    t.add(0, 1)
    assert t.fail(0, 0) is True


def test_fail_after_partial_acks_counts_acked_bookies_as_reachable() -> None:
    """Bookies that already acked still count toward Qa; only failed ones are subtracted."""
    t = AddTracker(ensemble_size=3, write_quorum=3, ack_quorum=2)
    t.add(0, 1)
    t.ack(0, 0)
    assert t.fail(0, 1) is False  # bookie 0 acked, bookie 2 may still ack
    assert t.ack(0, 2) == [(0, 1)]


def test_fail_of_unknown_entry_returns_false() -> None:
    """fail() for an entry that is not outstanding (never added, or already acknowledged) returns False."""
    t = AddTracker(ensemble_size=3, write_quorum=2, ack_quorum=1)
    assert t.fail(3, 0) is False
    t.add(0, 1)
    t.ack(0, 0)
    assert t.fail(0, 1) is False


def test_fail_from_bookie_outside_write_set_does_not_count() -> None:
    """Only bookies of the entry's write set can make its quorum unreachable (as ack() ignores outsiders)."""
    t = AddTracker(ensemble_size=5, write_quorum=3, ack_quorum=2)
    t.add(0, 1)  # write set [0, 1, 2]; bookies 3 and 4 do not store entry 0
    assert t.fail(0, 3) is False
    assert t.fail(0, 4) is False  # all of 0, 1, 2 can still ack: Qa = 2 is reachable
    t.ack(0, 0)
    assert t.ack(0, 1) == [(0, 1)]


@pytest.mark.parametrize("E,Qw,Qa", CONFIGS)
def test_fail_matches_brute_force_over_all_failure_sets(E: int, Qw: int, Qa: int) -> None:
    """fail() is True iff the write-set bookies not failed are fewer than Qa (checked for every failure set)."""
    ws = oracle_write_set(0, E, Qw)
    for k in range(Qw + 1):
        for failed in itertools.permutations(ws, k):
            t = AddTracker(ensemble_size=E, write_quorum=Qw, ack_quorum=Qa)
            t.add(0, 1)
            seen: set[int] = set()
            for b in failed:
                seen.add(b)
                unreachable = not any(all(x not in seen for x in q) for q in itertools.combinations(ws, Qa))
                assert t.fail(0, b) is unreachable, (failed, b)


def test_drop_all_returns_outstanding_ids_in_order() -> None:
    """drop_all() forgets every outstanding entry and returns their ids in order."""
    t = AddTracker(ensemble_size=3, write_quorum=2, ack_quorum=2)
    for e in range(4):
        t.add(e, 1)
    for b in write_set(0, 3, 2):
        t.ack(0, b)
    assert t.drop_all() == [(1, None), (2, None), (3, None)]
    assert t.outstanding == 0 and t.lac == 0


# -- fence_covered / entry_missing ----------------------------------------------------


@pytest.mark.parametrize("E,Qw,Qa", CONFIGS)
def test_fence_covered_matches_brute_force_for_every_responder_set(E: int, Qw: int, Qa: int) -> None:
    """fence_covered is True iff no write set still has Qa unfenced bookies (DESIGN: old writer can't reach Qa)."""
    for k in range(E + 1):
        for responded in itertools.combinations(range(E), k):
            r = set(responded)
            assert fence_covered(r, ensemble_size=E, write_quorum=Qw, ack_quorum=Qa) \
                is oracle_fence_covered(r, E, Qw, Qa), r


@pytest.mark.parametrize("E,Qw,Qa", CONFIGS)
def test_fence_covered_is_monotone(E: int, Qw: int, Qa: int) -> None:
    """More fence responses never un-cover: covered(S) implies covered(S + {b})."""
    for k in range(E + 1):
        for responded in itertools.combinations(range(E), k):
            r = set(responded)
            if fence_covered(r, ensemble_size=E, write_quorum=Qw, ack_quorum=Qa):
                for b in range(E):
                    assert fence_covered(r | {b}, ensemble_size=E, write_quorum=Qw, ack_quorum=Qa)


def test_fence_covered_concrete_cases() -> None:
    """Concrete cases: all responded covers; none responded does not; E=3,Qw=Qa=2 needs 2 of 3."""
    assert fence_covered({0, 1, 2}, ensemble_size=3, write_quorum=2, ack_quorum=2)
    assert not fence_covered(set(), ensemble_size=3, write_quorum=2, ack_quorum=2)
    assert not fence_covered({0}, ensemble_size=3, write_quorum=2, ack_quorum=2)  # {1,2} is write set of e=1
    assert fence_covered({0, 1}, ensemble_size=3, write_quorum=2, ack_quorum=2)
    assert fence_covered({0}, ensemble_size=1, write_quorum=1, ack_quorum=1)
    assert not fence_covered(set(), ensemble_size=1, write_quorum=1, ack_quorum=1)


@pytest.mark.parametrize("E,Qw,Qa", CONFIGS)
def test_entry_missing_matches_brute_force(E: int, Qw: int, Qa: int) -> None:
    """entry_missing(n) is True iff n denying bookies of the write set leave no Qa-quorum that could hold the entry."""
    for e in range(E):
        ws = oracle_write_set(e, E, Qw)
        for n in range(Qw + 1):
            for deniers in itertools.combinations(ws, n):
                assert entry_missing(n, write_quorum=Qw, ack_quorum=Qa) \
                    is oracle_entry_missing(set(deniers), ws, Qa), (e, deniers)


def test_entry_missing_concrete_thresholds() -> None:
    """Qw - Qa + 1 denials prove an entry was never acknowledged; fewer do not."""
    assert not entry_missing(1, write_quorum=3, ack_quorum=2)
    assert entry_missing(2, write_quorum=3, ack_quorum=2)
    assert not entry_missing(0, write_quorum=2, ack_quorum=2)
    assert entry_missing(1, write_quorum=2, ack_quorum=2)
    assert entry_missing(1, write_quorum=1, ack_quorum=1)
    assert not entry_missing(0, write_quorum=1, ack_quorum=1)
