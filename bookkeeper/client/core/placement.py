"""Ensemble placement: which bookies store a ledger, and who replaces a failed one.

Rule (Reference: Apache BookKeeper RackawareEnsemblePlacementPolicy): every write set
(Qw consecutive ensemble positions, cyclically) spans distinct racks when the
registered racks allow it. An ensemble change keeps the rule for the replaced slot.
When the racks are too few, the policy degrades to best effort (and says so), or
refuses in strict mode. Pure functions over a random.Random: deterministic in tests.
"""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Placement:
    ensemble: list[str]
    rack_aware: bool       # True if every write set spans distinct racks
    reason: str = ""       # why not, when rack_aware is False


def _neighbours(pos: int, size: int, write_quorum: int) -> list[int]:
    """Positions sharing some write set with pos (cyclic window of Qw - 1 on each side)."""
    span = min(write_quorum - 1, size - 1)
    return sorted({(pos + d) % size for d in range(-span, span + 1) if d != 0})


def write_sets_rack_distinct(ensemble: Sequence[str], racks: Mapping[str, str], write_quorum: int) -> bool:
    size = len(ensemble)
    for start in range(size):
        members = [racks.get(ensemble[(start + i) % size], "") for i in range(min(write_quorum, size))]
        if len(set(members)) != len(members):
            return False
    return True


def choose_ensemble(candidates: Mapping[str, str], *, ensemble_size: int, write_quorum: int,
                    rng: random.Random, rack_aware: bool = True, attempts: int = 64) -> Placement:
    """Pick ensemble_size bookies from candidates (bookie id -> rack)."""
    ids = sorted(candidates)
    if len(ids) < ensemble_size:
        raise ValueError(f"{ensemble_size} bookies needed, {len(ids)} available")
    if not rack_aware:
        return Placement(rng.sample(ids, ensemble_size), False, "random placement")
    racks = len(set(candidates.values()))
    if racks < min(write_quorum, ensemble_size):
        attempts = 0  # a write set of Qw needs Qw racks: no draw can succeed (the default one-rack cluster)
    for _ in range(attempts):
        chosen: list[str] = []
        ok = True
        for pos in range(ensemble_size):
            near = {candidates[chosen[p]] for p in _neighbours(pos, ensemble_size, write_quorum) if p < len(chosen)}
            pool = [b for b in ids if b not in chosen and candidates[b] not in near]
            if not pool:
                ok = False
                break
            chosen.append(rng.choice(pool))
        if ok and write_sets_rack_distinct(chosen, candidates, write_quorum):
            return Placement(chosen, True)
    return Placement(rng.sample(ids, ensemble_size), False,
                     f"{racks} rack(s) cannot give every write set of {write_quorum} distinct racks")


def choose_replacement(ensemble: Sequence[str], slot: int, candidates: Mapping[str, str], *,
                       write_quorum: int, exclude: set[str], rng: random.Random,
                       rack_aware: bool = True) -> tuple[str | None, bool]:
    """A bookie for ensemble[slot]: (bookie or None if none is left, rack rule kept)."""
    pool = [b for b in sorted(candidates) if b not in ensemble and b not in exclude]
    if not pool:
        return None, False
    if rack_aware:
        near = {candidates.get(ensemble[p], "") for p in _neighbours(slot, len(ensemble), write_quorum)}
        good = [b for b in pool if candidates[b] not in near]
        if good:
            return rng.choice(good), True
    return rng.choice(pool), False


def stop_refusal(bookie_id: str, writable: set[str], *, largest_open_ensemble: int,
                 min_writable: int = 1) -> str | None:
    """Why stopping `bookie_id` now would strand a writer (None: it would not).

    Every writer whose ensemble holds the stopped bookie needs a writable replacement
    outside its ensemble: that exists for all of them only while the other writable
    bookies number at least the largest ensemble of an open ledger. Used before a
    rolling restart stops a bookie.
    """
    others = len(writable - {bookie_id})
    need = max(largest_open_ensemble, min_writable)
    if others >= need:
        return None
    return (f"stopping {bookie_id} would leave {others} other writable bookie(s); "
            f"{need} needed (largest open ensemble {largest_open_ensemble}, minimum {min_writable})")
