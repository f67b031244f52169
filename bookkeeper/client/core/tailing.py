"""What a tailer's long polls at a ledger's head say (sans-I/O; the shell is
ReadHandle.tail in bookkeeper.client.ledger).

At the head a tailer long-polls the next entry on the first replica of its write set, and
when that one has not answered after `speculative_read_timeout_ms` (or failed) on every
other bookie of the entry's ensemble too: a speculative long poll, as Apache BookKeeper's
reader has. Why every bookie in the end: a bookie's LAC moves only when the writer tells it,
by the LAC piggybacked on an add sent to that bookie or by an explicit LAC sent to the write
set of the last acknowledged entry. The first replica of the next entry may hear of neither
for as long as the writer pauses (after pipelined adds, at 3/2/2 one pause in three), while
some bookie of the ensemble always hears the explicit LAC (one to two intervals after the
pause; later when many of its client's handles pause at once: the LAC wheel's budget,
docs/protocol.md). Why not every bookie at once: while entries flow the first replica
answers within about two adds, and polling all of them cost 27-37% of the adds/s of a W=1
writer beside a tailer (`bk bench cluster`: every extra request and answer wakes a shard and
the client). A bookie answers once its LAC covers the entry, with the entry if it stores it
(docs/protocol.md, READ_ENTRY).

A bookie that holds nothing of the ledger yet (no add has reached it) answers at once with
NO_SUCH_LEDGER rather than park the poll (a peer must not park polls on ledger ids nobody
writes). While every bookie says so, a tailer waits between rounds (`unheld_pause_s`), or
until the metadata watch fires, instead of asking again at once.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence


class PollAnswer(enum.Enum):
    """One bookie's answer to a long poll of entry e."""

    ENTRY = "entry"      # OK: its LAC covers e and it sent e
    COVERED = "covered"  # its LAC covers e but it does not store e: read e from e's write set
    EXPIRED = "expired"  # the poll's time ran out with its LAC short of e
    UNHELD = "unheld"    # NO_SUCH_LEDGER at once: the bookie holds nothing of the ledger yet
    FAILED = "failed"    # an error: the bookie is down, timed out, refused, or sent a bad copy


UNHELD_PAUSE_FIRST_S = 0.01
UNHELD_PAUSE_MAX_S = 0.1  # a tailer of a new ledger sees its first entry at most this late


def judge_poll_answer(entry_id: int, *, ok: bool, absent: bool, lac: int, unheld: bool = False) -> PollAnswer:
    """One answer, from its status and the LAC it carries (unheld: the status is NO_SUCH_LEDGER).

    | ok  | absent (NO_SUCH_ENTRY or NO_SUCH_LEDGER) | lac >= entry_id | unheld | answer  |
    |-----|------------------------------------------|-----------------|--------|---------|
    | yes | -                                        | -               | -      | ENTRY   |
    | no  | yes                                      | yes             | -      | COVERED |
    | no  | yes                                      | no              | no     | EXPIRED |
    | no  | yes                                      | no              | yes    | UNHELD  |
    | no  | no                                       | -               | -      | FAILED  |

    An OK answer is an entry whatever LAC it carries: a bookie answers a long poll with the
    entry only once its LAC covers it. The caller turns an OK answer whose digest fails into
    FAILED.
    """
    if ok:
        return PollAnswer.ENTRY
    if absent:
        if lac >= entry_id:
            return PollAnswer.COVERED
        return PollAnswer.UNHELD if unheld else PollAnswer.EXPIRED
    return PollAnswer.FAILED


def head_outcome(answers: Sequence[PollAnswer], asked: int) -> PollAnswer | None:
    """The wait's outcome from the answers so far (in arrival order) of `asked` polls; None
    while it is not settled.

    | answers so far                            | outcome                       |
    |-------------------------------------------|-------------------------------|
    | one is ENTRY or COVERED                   | the first of them             |
    | fewer than asked, none ENTRY or COVERED   | None: wait for the others     |
    | all in, at least one EXPIRED              | EXPIRED (nothing new: ask again) |
    | all in, no EXPIRED, at least one UNHELD   | UNHELD (pause, then ask again) |
    | all in, every one FAILED                  | FAILED                        |
    """
    for answer in answers:
        if answer is PollAnswer.ENTRY or answer is PollAnswer.COVERED:
            return answer
    if len(answers) < asked:
        return None
    for settled in (PollAnswer.EXPIRED, PollAnswer.UNHELD):
        if settled in answers:
            return settled
    return PollAnswer.FAILED


def unheld_pause_s(previous_s: float) -> float:
    """The pause before the next round while no bookie holds the ledger: doubling from
    UNHELD_PAUSE_FIRST_S up to UNHELD_PAUSE_MAX_S (previous_s 0: the first such round)."""
    return min(UNHELD_PAUSE_MAX_S, previous_s * 2 or UNHELD_PAUSE_FIRST_S)
