"""Rack-aware placement (Reference: Apache BookKeeper RackawareEnsemblePlacementPolicy):
every write set spans distinct racks when the racks allow it, ensemble changes keep the rule,
and too few racks degrade (said) or refuse (strict)."""
from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from bookkeeper import BookKeeper, errors
from bookkeeper.client.core.placement import (choose_ensemble, choose_replacement, stop_refusal,
                                              write_sets_rack_distinct)
from tests.conftest import run


def racks_of(n_racks: int, per_rack: int) -> dict[str, str]:
    return {f"b{r}-{i}": f"/rack{r}" for r in range(n_racks) for i in range(per_rack)}


@pytest.mark.parametrize("n_racks,per_rack,e,qw", [(3, 2, 3, 2), (3, 2, 3, 3), (3, 3, 6, 3), (4, 2, 5, 2),
                                                    (2, 3, 4, 2), (5, 1, 5, 5)])
def test_every_write_set_spans_distinct_racks_when_possible(n_racks, per_rack, e, qw) -> None:
    """Over many seeds, the chosen ensemble's cyclic write sets never repeat a rack."""
    cands = racks_of(n_racks, per_rack)
    for seed in range(200):
        p = choose_ensemble(cands, ensemble_size=e, write_quorum=qw, rng=random.Random(seed))
        assert p.rack_aware, (seed, p)
        assert len(set(p.ensemble)) == e
        assert write_sets_rack_distinct(p.ensemble, cands, qw)


def test_too_few_racks_degrade_and_say_why() -> None:
    """Two racks cannot host write sets of three: placement degrades with a reason."""
    p = choose_ensemble(racks_of(2, 3), ensemble_size=3, write_quorum=3, rng=random.Random(1))
    assert not p.rack_aware and "2 rack(s)" in p.reason
    assert len(set(p.ensemble)) == 3


def test_random_policy_ignores_racks() -> None:
    p = choose_ensemble(racks_of(1, 5), ensemble_size=3, write_quorum=2, rng=random.Random(0), rack_aware=False)
    assert len(set(p.ensemble)) == 3 and not p.rack_aware


def test_replacement_keeps_the_rack_rule() -> None:
    """The replacement of slot s avoids the racks of the slots sharing a write set with s."""
    cands = racks_of(3, 2)
    for seed in range(100):
        rng = random.Random(seed)
        ens = choose_ensemble(cands, ensemble_size=3, write_quorum=2, rng=rng).ensemble
        for slot in range(3):
            new, kept = choose_replacement(ens, slot, cands, write_quorum=2, exclude={ens[slot]}, rng=rng)
            assert kept and new not in ens
            trial = list(ens)
            trial[slot] = new
            assert write_sets_rack_distinct(trial, cands, 2)


def test_no_replacement_left() -> None:
    cands = racks_of(1, 3)
    ens = ["b0-0", "b0-1", "b0-2"]
    assert choose_replacement(ens, 0, cands, write_quorum=2, exclude=set(), rng=random.Random(0)) == (None, False)


def test_rack_aware_placement_on_a_real_cluster(make_cluster) -> None:
    """Bookies register their rack; ledgers spread write sets over racks; strict mode refuses
    what cannot be spread; an ensemble change replaces a killed bookie within the rule."""
    cluster = make_cluster(bookies=0, shards=1)
    for r, _ in itertools.product(range(3), range(2)):
        cluster.add_bookie(wait=False, rack=f"/rack{r}")
    cluster.wait_registered()

    async def main() -> None:
        async with await BookKeeper.connect(cluster.metadata_uri, seed=5, add_timeout_s=3.0) as bk:
            racks = {bid: info["rack"] for bid, info in (await bk.refresh_bookies()).items()}
            assert sorted(set(racks.values())) == ["/rack0", "/rack1", "/rack2"]
            for _ in range(5):
                lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
                assert write_sets_rack_distinct(lh.metadata.ensembles[0], racks, 2)
                await lh.close()
            assert bk.stats["placement_degraded"] == 0

            lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
            await asyncio.gather(*(lh.add_entry_async(b"r%d" % i) for i in range(100)))
            victim_id = lh.metadata.ensembles[0][1]
            victim = next(b for b in cluster.bookies if b.bookie_id == victim_id)
            victim.kill()
            await asyncio.gather(*(lh.add_entry_async(b"r%d" % i) for i in range(100, 300)))
            new = lh.metadata.last_ensemble
            assert victim_id not in new and len(lh.metadata.ensembles) == 2
            assert write_sets_rack_distinct(new, racks, 2)
            assert racks[new[1]] == racks[victim_id]  # the only rack its neighbours leave
            await lh.close()

        async with await BookKeeper.connect(cluster.metadata_uri, placement_strict=True) as strict:
            with pytest.raises(errors.NotEnoughBookiesError, match="placement"):
                await strict.create_ledger(ensemble=4, write_quorum=4, ack_quorum=2)
        async with await BookKeeper.connect(cluster.metadata_uri) as lenient:
            lh = await lenient.create_ledger(ensemble=4, write_quorum=4, ack_quorum=2)
            assert lenient.stats["placement_degraded"] == 1
            await lh.close()
    run(main())


@pytest.mark.parametrize(("writable", "largest", "minimum", "ok"), [
    ({"a", "b", "c"}, 2, 1, True),    # two others left for an ensemble of 2
    ({"a", "b", "c"}, 3, 1, False),   # an ensemble of 3 would have no replacement
    ({"b", "c", "d"}, 3, 1, True),    # the bookie is not writable (read-only or gone): three others
    ({"a"}, 0, 1, False),             # no ledger open, but nothing would be left
    ({"a", "b"}, 0, 2, False),        # the operator's minimum
])
def test_stop_refusal_counts_writable_bookies_other_than_the_stopped_one(writable, largest, minimum, ok) -> None:
    """Rolling restarts: a bookie may stop while the others can host the largest open ensemble."""
    reason = stop_refusal("a", writable, largest_open_ensemble=largest, min_writable=minimum)
    assert (reason is None) == ok, reason


def test_new_ensembles_avoid_quarantined_bookies_unless_too_few_are_left(cluster5) -> None:
    """A bookie quarantined by the client (it failed an add) is left out of new ensembles while
    enough others are writable, and used when they are not (Apache BookKeeper's quarantine)."""

    async def main() -> None:
        async with await BookKeeper.connect(cluster5.metadata_uri, seed=9) as bk:
            ids = sorted(await bk.refresh_bookies())
            for b in ids[:2]:
                bk.quarantine.penalize(b)
            for _ in range(10):
                lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
                assert sorted(lh.metadata.ensembles[0]) == ids[2:], lh.metadata.ensembles
                await bk.delete_ledger(lh.ledger_id)
            bk.quarantine.penalize(ids[2])  # two healthy bookies left for an ensemble of 3
            lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
            assert len(set(lh.metadata.ensembles[0])) == 3
            await bk.delete_ledger(lh.ledger_id)
    run(main())
