"""The shard's decisions on requests, sans I/O (issue 25 item 2): pure functions of what the
shard knows of a ledger, the shard's own state and the request, giving the answer's status
and the effects the caller applies (stage and journal an add, fence, park a long poll, look
an entry up, answer once durable). No storage, journal, clock or connection is touched here:
`ShardServer` (bookie/server.py) reads what they need and applies what they decide.

Why: the add decision used to live twice, in the C add path (ext/bookkeeper/_ext/shardpath.pyx,
`AddPath.dispatch`: OK adds of ledgers the shard knows) and in `ShardServer._add` (every
other add). `ShardServer._add` now applies `decide_add`, and tests check on every combination
of its inputs that the C path takes exactly the adds it answers OK without creating a ledger
(and that the connection's roles cover), and gives every other add to Python
(tests/test_bookie_core.py)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from bookkeeper.proto import ENTRY_HEADER_BYTES, Status



@dataclass(frozen=True, slots=True)
class AddDecision:
    """The answer to one add, and whether the ledger is new to this shard (its state is then
    made and its master key journaled before the entry, so a replay knows the key first)."""

    status: Status
    create: bool = False


ADD_OK = AddDecision(Status.OK)
ADD_CREATE = AddDecision(Status.OK, create=True)
ADD_READ_ONLY = AddDecision(Status.READ_ONLY)
ADD_BAD_REQUEST = AddDecision(Status.BAD_REQUEST)
ADD_UNAUTHORIZED = AddDecision(Status.UNAUTHORIZED)
ADD_FENCED = AddDecision(Status.FENCED)


def decide_add(*, readonly: bool, known: bool, owned: bool, entry_id: int, payload_len: int,
               header_matches: bool, key_given: bool, key_matches: bool, fenced: bool,
               recovery: bool, tombstoned: bool = False) -> AddDecision:
    """One add (authorization by role is checked before, in `ShardServer.handle`).

    readonly: the shard takes no writes; known: it has the ledger's state; owned: the ledger
    id maps to this shard (shard_for_ledger, and within the id range); header_matches: the
    payload's entry header names this ledger and entry; key_given: the request carries a
    master key (not NO_KEY); key_matches: it equals the one the shard keeps (known only);
    fenced: the shard fenced the ledger (recovery); recovery: the add has RECOVERY_ADD;
    tombstoned: the ledger is unknown because it was fenced here and then deleted
    (LedgerStorage.delete_ledger: its writer is a zombie).

    The order is the answer's precedence: a read-only shard refuses everything; a malformed
    add (negative entry id, a payload shorter than its header, a ledger of another shard, a
    header naming another entry) is a bad request before any key is looked at; an unknown
    ledger is created by the first keyed add (it cannot be fenced yet), unless it is a
    fenced ledger's tombstone (fenced: the key is gone with the ledger, so any key is
    refused as fenced and no key as unauthorized); a wrong key is refused before the fence
    is told, so a prober learns nothing of the ledger's state."""
    if readonly:
        return ADD_READ_ONLY
    if entry_id < 0 or payload_len < ENTRY_HEADER_BYTES or not (known or owned) or not header_matches:
        return ADD_BAD_REQUEST
    if not known:
        if not key_given:
            return ADD_UNAUTHORIZED
        return ADD_FENCED if tombstoned else ADD_CREATE
    if not key_matches:
        return ADD_UNAUTHORIZED
    if fenced and not recovery:
        return ADD_FENCED
    return ADD_OK


class LongPoll(enum.Enum):
    """What a shard does with a long poll (see judge_long_poll)."""

    ANSWER = "answer"    # the LAC covers the entry: the entry, or NO_SUCH_ENTRY with the LAC
    UNKNOWN = "unknown"  # no such ledger here: NO_SUCH_LEDGER at once
    NOW = "now"          # the connection's cap is reached: the current state at once
    PARK = "park"        # wait for the LAC to cover the entry, or the poll's time


def judge_long_poll(*, known: bool, covered: bool, parked: int, cap: int) -> LongPoll:
    """A long poll's fate.

    | ledger held | LAC covers entry | parked on the connection | fate    |
    |-------------|------------------|--------------------------|---------|
    | no          | -                | -                        | UNKNOWN |
    | yes         | yes              | -                        | ANSWER  |
    | yes         | no               | >= cap                   | NOW     |
    | yes         | no               | < cap                    | PARK    |

    Why refuse unknown ledgers: a parked poll costs memory and a timer, and ids are free
    to invent. Why answer over the cap with the state rather than an error: the answer is
    the one its expiry would give, which every client already handles (it asks again).
    """
    if not known:
        return LongPoll.UNKNOWN
    if covered:
        return LongPoll.ANSWER
    return LongPoll.NOW if parked >= cap else LongPoll.PARK


def is_idle(*, now: float, last_request: float, timeout_s: float, outstanding: bool) -> bool:
    """Whether to close a connection for idleness.

    | timeout_s | outstanding (parked polls, unsent or unread answers, held requests) | silent >= timeout | idle |
    |-----------|---------------------------------------------------------------------|-------------------|------|
    | 0         | -                                                                   | -                 | no   |
    | > 0       | yes                                                                 | -                 | no   |
    | > 0       | no                                                                  | yes / no          | yes / no |
    """
    return timeout_s > 0 and not outstanding and now - last_request >= timeout_s


class ReadAction(enum.Enum):
    """What a shard does with a read (READ_ENTRY or READ_LAC)."""

    REFUSE = "refuse"  # answer `status` now
    LOOKUP = "lookup"  # answer what storage holds: the entry (else NO_SUCH_ENTRY, the LAC), or the last entry
    FENCE = "fence"    # fence (state made first when `create`), journal it, answer the lookup once durable
    PARK = "park"      # a long poll waits for the LAC to cover its entry, or for its time


@dataclass(frozen=True, slots=True)
class ReadDecision:
    """A read's decision: the action, the status of a refusal, whether a fence makes the
    ledger's state, and whether a long poll was refused (counted: long_polls_refused)."""

    action: ReadAction
    status: Status = Status.OK
    create: bool = False
    poll_refused: bool = False


READ_LOOKUP = ReadDecision(ReadAction.LOOKUP)
READ_PARK = ReadDecision(ReadAction.PARK)
READ_FENCE = ReadDecision(ReadAction.FENCE)
READ_FENCE_CREATE = ReadDecision(ReadAction.FENCE, create=True)
READ_BAD_REQUEST = ReadDecision(ReadAction.REFUSE, Status.BAD_REQUEST)
READ_UNAUTHORIZED = ReadDecision(ReadAction.REFUSE, Status.UNAUTHORIZED)
READ_NO_SUCH_LEDGER = ReadDecision(ReadAction.REFUSE, Status.NO_SUCH_LEDGER)
POLL_UNKNOWN = ReadDecision(ReadAction.REFUSE, Status.NO_SUCH_LEDGER, poll_refused=True)
POLL_NOW = ReadDecision(ReadAction.REFUSE, Status.NO_SUCH_ENTRY, poll_refused=True)


def decide_fence(*, known: bool, key_given: bool, key_matches: bool) -> ReadDecision:
    """A fencing read (FENCE flag): recovery's first step. It needs the ledger's key (an
    unkeyed fence would let anyone stop any writer); a ledger this shard never saw is fenced
    all the same, its state made with the key, so that a late first add of the old writer is
    refused too. The answer leaves only once the fence is durable (journaled)."""
    if not key_given:
        return READ_UNAUTHORIZED
    if not known:
        return READ_FENCE_CREATE
    return READ_FENCE if key_matches else READ_UNAUTHORIZED


def decide_read(*, owned: bool, fence: bool, long_poll: bool, entry_id: int, known: bool, key_given: bool,
                key_matches: bool, covered: bool, parked: int, cap: int) -> ReadDecision:
    """A READ_ENTRY. owned: the ledger id maps to this shard; covered: the shard's LAC of the
    ledger covers the entry; parked, cap: the connection's parked long polls and its bound.
    A plain read needs no key (reads are authorized by role, before)."""
    if not owned:
        return READ_BAD_REQUEST
    if fence:
        return decide_fence(known=known, key_given=key_given, key_matches=key_matches)
    if long_poll and entry_id >= 0:
        fate = judge_long_poll(known=known, covered=covered, parked=parked, cap=cap)
        return {LongPoll.PARK: READ_PARK, LongPoll.ANSWER: READ_LOOKUP, LongPoll.UNKNOWN: POLL_UNKNOWN,
                LongPoll.NOW: POLL_NOW}[fate]
    return READ_LOOKUP if known else READ_NO_SUCH_LEDGER


def decide_read_lac(*, owned: bool, fence: bool, known: bool, key_given: bool, key_matches: bool) -> ReadDecision:
    """A READ_LAC: the LAC and last entry id this shard holds (LOOKUP), fenced first with FENCE."""
    if not owned:
        return READ_BAD_REQUEST
    if fence:
        return decide_fence(known=known, key_given=key_given, key_matches=key_matches)
    return READ_LOOKUP if known else READ_NO_SUCH_LEDGER


def decide_write_lac(*, owned: bool, lac: int, known: bool, key_given: bool, key_matches: bool,
                     fenced: bool) -> Status:
    """A WRITE_LAC (an idle writer's LAC): OK means the shard raises its LAC of the ledger to
    `lac` if higher, never lowers it. Only the ledger's writer (its key) may send one, and not
    once the ledger is fenced: a recovered ledger's end is recovery's to say."""
    if not owned or lac < 0:
        return Status.BAD_REQUEST
    if not known:
        return Status.NO_SUCH_LEDGER
    if not (key_given and key_matches):
        return Status.UNAUTHORIZED
    return Status.FENCED if fenced else Status.OK
