"""Mutations: known-wrong variants of the write and recovery rules, swapped in by the
simulator only (for the length of one run), to show that its invariants catch them.

Each is a small patch over the production module it breaks, undone when the run ends;
nothing here is imported by production code. A mutation that no seed catches says the
simulator cannot see that class of bug: `tests/test_sim.py` runs each over seeds 0..19.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from bookkeeper._ext.client import AddTracker
from bookkeeper.client import ledger
from bookkeeper.client.core import recovery, writer
from bookkeeper.meta.ledger_metadata import LedgerState

MUTATIONS: dict[str, str] = {
    "ack-before-qa": "the writer acknowledges an entry once Qa - 1 bookies stored it",
    "lac-from-unacked": "a batch piggybacks as LAC the entry before it, acknowledged or not",
    "recovery-fences-one": "recovery goes on after the first bookie answers its fence",
    "recovery-reads-without-fence": "recovery's entry reads carry no FENCE (its first fence still does: #2614)",
    "fence-before-durable": "a bookie answers a fence before the fence is in its journal",
    "recovery-without-fence": "recovery's reads carry no FENCE flag (nothing is fenced)",
    "fenced-takes-add": "a bookie answers a fence but does not mark the ledger fenced",
    "ack-before-fsync": "the journal device reports a write durable before it is synced",
    "replay-past-corrupt-middle": "journal replay treats a damaged block with valid ones after it as a torn end",
    "no-resend-to-replaced": "an ensemble change does not resend outstanding entries to the new bookie",
    "no-replacement-on-late-failure": "a bookie failing an entry already acknowledged without it stays",
    "replaced-bookie-acks-count": "an OK a bookie gave before it failed still counts once a change replaces it",
    "gc-stale-listing": "garbage collection keeps a bucket's listing after the bucket changed (pzxid ignored)",
    "recovery-from-interrupted-segments": "recovery reads the segments an interrupted recovery wrote",
    "recovery-below-last-segment": "recovery starts at the fenced LAC even below the writer's last segment (#2615)",
}


def _tracker_with(qa_drop: int = 0, lac_ahead: bool = False) -> Callable[..., Any]:
    class Tracker(AddTracker):  # type: ignore[misc]
        def send_entries(self, datas: list[bytes], first_entry: int, piggyback_lac: int, *rest: Any) -> Any:
            return super().send_entries(datas, first_entry, first_entry - 1 if lac_ahead else piggyback_lac, *rest)

    def make(*, ensemble_size: int, write_quorum: int, ack_quorum: int, **kw: Any) -> Any:
        return Tracker(ensemble_size=ensemble_size, write_quorum=write_quorum,
                       ack_quorum=max(1, ack_quorum - qa_drop), **kw)
    return make


@contextlib.contextmanager
def _patched(target: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, old)


@contextlib.contextmanager
def _unfenced(*votes: type) -> Iterator[None]:
    """Recovery's requests decided by these votes go without FENCE."""
    with contextlib.ExitStack() as stack:
        for vote in votes:
            stack.enter_context(_patched(vote, "flags", 0))
        yield


def _fence_ignored() -> contextlib.AbstractContextManager[None]:
    from bookkeeper.bookie.server import ShardServer
    original = ShardServer._fence

    def fence(self: Any, ledger_id: int, st: Any, key: bytes, create: bool) -> Any:
        st = original(self, ledger_id, st, key, create)
        st.fenced = False
        return st
    return _patched(ShardServer, "_fence", fence)


def _fence_answered_early() -> contextlib.AbstractContextManager[None]:
    from bookkeeper._ext.journal import REC_FENCE
    from bookkeeper.bookie.journal.journal import Journal
    original = Journal.append

    def append(self: Any, rtype: int, ledger_id: int, entry_id: int, data: bytes, item: Any, **kw: Any) -> None:
        if rtype == REC_FENCE and item[0] is not None:
            item[0].respond(item[1])  # answered now; journaled with no answer waiting
            item = (None, None, 0.0)
        original(self, rtype, ledger_id, entry_id, data, item, **kw)
    return _patched(Journal, "append", append)


def _no_resend() -> contextlib.AbstractContextManager[None]:
    original = ledger.WriteHandle._send_add

    def send_add(self: Any, entry_id: int, idx: int, bookie: str, payload: bytes) -> None:
        sent = self._tracker.sent_to(entry_id)
        if sent and sent[idx] is not None and sent[idx] != bookie:
            self._tracker.mark_sent(entry_id, idx, bookie)  # counted as resent, never sent
            return
        original(self, entry_id, idx, bookie, payload)
    return _patched(ledger.WriteHandle, "_send_add", send_add)


def _forget_writer_segments() -> contextlib.AbstractContextManager[None]:
    def proposal(md: Any) -> Any:
        return None if md.state is not LedgerState.OPEN else md.replace(state=LedgerState.IN_RECOVERY)
    return _patched(recovery, "recovery_proposal", proposal)


def _stale_listing() -> contextlib.AbstractContextManager[None]:
    from bookkeeper.bookie.gc import DeletedLedgerFinder
    original = DeletedLedgerFinder._listed

    def listed(self: Any, bucket: str, stats: Any) -> Any:
        cached = self._buckets.get(bucket)
        return cached[1] if cached is not None else original(self, bucket, stats)
    return _patched(DeletedLedgerFinder, "_listed", listed)


@contextlib.contextmanager
def applied(name: str | None) -> Iterator[None]:
    """The production code with mutation `name` swapped in (none: unchanged)."""
    if name is None:
        yield
        return
    if name not in MUTATIONS:
        raise ValueError(f"no mutation {name!r} (bk sim --list-mutations)")
    patch: contextlib.AbstractContextManager[None]
    if name == "ack-before-qa":
        patch = _patched(ledger, "AddTracker", _tracker_with(qa_drop=1))
    elif name == "lac-from-unacked":
        patch = _patched(ledger, "AddTracker", _tracker_with(lac_ahead=True))
    elif name == "recovery-fences-one":
        patch = _patched(recovery, "fence_covered", lambda ok, **_kw: bool(ok))
    elif name == "recovery-without-fence":
        patch = _unfenced(recovery.FenceVote, recovery.EntryVote)
    elif name == "recovery-reads-without-fence":
        patch = _unfenced(recovery.EntryVote)
    elif name == "fence-before-durable":
        patch = _fence_answered_early()
    elif name == "fenced-takes-add":
        patch = _fence_ignored()
    elif name == "no-resend-to-replaced":
        patch = _no_resend()
    elif name == "replay-past-corrupt-middle":
        from bookkeeper.bookie.journal import journal, policy
        original = policy.replay_step

        def step(header: Any, scan: Any, *, reused: bool) -> Any:
            if scan is policy.BlockScan.CORRUPT_MIDDLE:
                return policy.ReplayStep.APPLY_TORN
            return original(header, scan, reused=reused)
        patch = _patched(journal, "replay_step", step)
    elif name == "no-replacement-on-late-failure":
        patch = _patched(writer.WriterCore, "still_writing_to", lambda *_a: False)
    elif name == "gc-stale-listing":
        patch = _stale_listing()
    elif name == "replaced-bookie-acks-count":
        patch = _patched(writer.WriterCore, "forget_failed_copies", lambda *_a: None)
    elif name == "recovery-from-interrupted-segments":
        patch = _forget_writer_segments()
    elif name == "recovery-below-last-segment":
        patch = _patched(recovery, "acknowledged_floor", lambda _view: -1)
    else:  # ack-before-fsync: the simulated journal device itself (SimSyncer(ack_before_sync=True))
        patch = contextlib.nullcontext()
    with patch:
        yield
