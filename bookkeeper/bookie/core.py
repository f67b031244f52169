"""The shard's decisions on requests, sans I/O (issue 25 item 2): pure functions of what the
shard knows of a ledger, the shard's own state and the request, giving the answer's status
and the effects the caller applies. No storage, journal, clock or connection is touched here.

Why: the add decision used to live twice, in the C add path (ext/bookkeeper/_ext/shardpath.pyx,
`AddPath.dispatch`: OK adds of ledgers the shard knows) and in `ShardServer._add` (every
other add). `ShardServer._add` now applies `decide_add`, and tests check on every combination
of its inputs that the C path takes exactly the adds it answers OK without creating a ledger
(and that the connection's roles cover), and gives every other add to Python
(tests/test_bookie_core.py)."""
from __future__ import annotations

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
               recovery: bool) -> AddDecision:
    """One add (authorization by role is checked before, in `ShardServer.handle`).

    readonly: the shard takes no writes; known: it has the ledger's state; owned: the ledger
    id maps to this shard (shard_for_ledger, and within the id range); header_matches: the
    payload's entry header names this ledger and entry; key_given: the request carries a
    master key (not NO_KEY); key_matches: it equals the one the shard keeps (known only);
    fenced: the shard fenced the ledger (recovery); recovery: the add has RECOVERY_ADD.

    The order is the answer's precedence: a read-only shard refuses everything; a malformed
    add (negative entry id, a payload shorter than its header, a ledger of another shard, a
    header naming another entry) is a bad request before any key is looked at; an unknown
    ledger is created by the first keyed add (it cannot be fenced yet); a wrong key is
    refused before the fence is told, so a prober learns nothing of the ledger's state."""
    if readonly:
        return ADD_READ_ONLY
    if entry_id < 0 or payload_len < ENTRY_HEADER_BYTES or not (known or owned) or not header_matches:
        return ADD_BAD_REQUEST
    if not known:
        return ADD_CREATE if key_given else ADD_UNAUTHORIZED
    if not key_matches:
        return ADD_UNAUTHORIZED
    if fenced and not recovery:
        return ADD_FENCED
    return ADD_OK
