"""The shard's request decisions (bookkeeper/bookie/core.py, issue 25 item 2): the whole
table of each (add, read, read LAC, write LAC, fence) against the rules docs/protocol.md
states, and the C add path (ext/bookkeeper/_ext/shardpath.pyx) checked against the add
decision on every combination of its inputs, through a real in-process shard (ShardServer,
AddPath, Journal, LedgerStorage; no sockets)."""
from __future__ import annotations

import asyncio
import itertools
import struct
from pathlib import Path

import uvloop

from bookkeeper.bookie.core import (ADD_BAD_REQUEST, ADD_CREATE, ADD_FENCED, ADD_OK, ADD_READ_ONLY, ADD_UNAUTHORIZED,
                                   AddDecision, ReadAction, ReadDecision, decide_add, decide_read, decide_read_lac,
                                   decide_write_lac)
from bookkeeper.bookie.journal import Journal
from bookkeeper.bookie.server import BookieProtocol, ShardServer
from bookkeeper.bookie.storage import LedgerStorage
from bookkeeper.bookie.trust import ADD_RECOVER, ADD_WRITE
from bookkeeper.client.digest import master_key
from bookkeeper.proto import NO_KEY, Flag, Op, Status, encode_request, shard_for_ledger
from bookkeeper.testing.syncers import ManualSyncer
from tests.test_shard_inprocess import Socket

KEY = master_key(b"core")
OTHER_KEY = master_key(b"not the key")
BOOL = (False, True)


def oracle(readonly: bool, known: bool, owned: bool, entry_id: int, payload_len: int, header_matches: bool,
           key_given: bool, key_matches: bool, fenced: bool, recovery: bool, tombstoned: bool) -> AddDecision:
    """The checks docs/protocol.md lists for ADD_ENTRY, one condition per answer, written apart from decide_add."""
    well_formed = entry_id >= 0 and payload_len >= 32 and header_matches and (known or owned)
    conditions = {
        ADD_READ_ONLY: readonly,
        ADD_BAD_REQUEST: not readonly and not well_formed,
        ADD_CREATE: not readonly and well_formed and not known and key_given and not tombstoned,
        ADD_UNAUTHORIZED: not readonly and well_formed and ((not known and not key_given) or (known and not key_matches)),
        ADD_FENCED: not readonly and well_formed and ((known and key_matches and fenced and not recovery)
                                                      or (not known and key_given and tombstoned)),
        ADD_OK: not readonly and well_formed and known and key_matches and (not fenced or recovery),
    }
    held = [d for d, cond in conditions.items() if cond]
    assert len(held) == 1, held  # the rules cover every case exactly once
    return held[0]


def test_decide_add_agrees_with_the_rules_on_every_combination() -> None:
    """All 2,048 combinations of decide_add's inputs (key_matches only where a ledger is known
    counts, a tombstone only where it is not; each is given both ways everywhere): the
    oracle's answer, and every answer reached."""
    seen = set()
    for readonly, known, owned, entry_id, payload_len, header, given, matches, fenced, recovery, tomb in \
            itertools.product(BOOL, BOOL, BOOL, (-1, 0), (31, 32), BOOL, BOOL, BOOL, BOOL, BOOL, BOOL):
        matches = matches and known and given  # a key can only match a key the shard keeps
        fenced = fenced and known
        tomb = tomb and not known  # a tombstone is of a ledger the shard no longer holds
        got = decide_add(readonly=readonly, known=known, owned=owned, entry_id=entry_id, payload_len=payload_len,
                         header_matches=header, key_given=given, key_matches=matches, fenced=fenced,
                         recovery=recovery, tombstoned=tomb)
        assert got == oracle(readonly, known, owned, entry_id, payload_len, header, given, matches, fenced,
                             recovery, tomb), (readonly, known, owned, entry_id, payload_len, header, given, matches,
                                               fenced, recovery, tomb)
        seen.add(got)
    assert seen == {ADD_OK, ADD_CREATE, ADD_READ_ONLY, ADD_BAD_REQUEST, ADD_UNAUTHORIZED, ADD_FENCED}


def _payload(ledger_id: int, entry_id: int, kind: str) -> bytes:
    """An entry payload: 'short' (under its 32-byte header), 'match' (its header names this
    ledger and entry) or 'other' (it names the next entry). The shard reads the header only."""
    if kind == "short":
        return bytes(10)
    named = entry_id if kind == "match" else entry_id + 1
    return struct.pack(">QqqQ", ledger_id, named, -1, 4) + b"data"


def test_the_c_add_path_takes_exactly_the_adds_decide_add_answers_ok_on_a_known_ledger(tmp_path: Path) -> None:
    """A two-shard bookie's shard 0, every combination of: ledger unknown and owned, unknown
    and another shard's, known, known and fenced, fenced and then deleted; the right key, another, none; RECOVERY_ADD
    or not; entry -1 or 0; a short payload, a matching header, a header naming another entry;
    read-only or not; the connection's add roles (both, write, recover, none). Each add on a
    fresh connection: its answer is decide_add's, and the C path took it exactly when that
    answer is OK on a known ledger and the roles cover it (otherwise Python did)."""
    owned_ids = (i for i in itertools.count(1) if shard_for_ledger(i, 2) == 0)
    foreign_ids = (i for i in itertools.count(1) if shard_for_ledger(i, 2) == 1)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        storage = LedgerStorage(tmp_path / "ledgers")
        server = ShardServer(storage=storage, shard_index=0, shards=2, max_frame_bytes=1 << 20, readonly=False,
                             data_dir=str(tmp_path))
        syncer = ManualSyncer()
        journal = Journal(tmp_path / "journal", syncer=syncer, loop=loop, on_durable=server.on_durable,
                          on_failed=server.on_failed, preallocate_bytes=1 << 20)
        journal.start()
        server.journal = journal
        python_dispatch = server.dispatch
        to_python: list[tuple] = []

        def recording(conn: BookieProtocol, frame: tuple) -> None:
            to_python.append(frame)
            python_dispatch(conn, frame)

        server.dispatch = recording  # type: ignore[method-assign]
        cases = 0
        for state, key, recovery, entry_id, payload_kind, readonly, roles in itertools.product(
                ("unknown", "foreign", "known", "fenced", "deleted"), (KEY, OTHER_KEY, NO_KEY), BOOL, (-1, 0),
                ("short", "match", "other"), BOOL, (ADD_WRITE | ADD_RECOVER, ADD_WRITE, ADD_RECOVER, 0)):
            lid = next(foreign_ids if state == "foreign" else owned_ids)
            if state in ("known", "fenced", "deleted"):
                storage.create_ledger(lid, KEY).fenced = state != "known"
            if state == "deleted":
                storage.delete_ledger(lid, now=1.0)  # garbage-collected: a tombstone is left
            server.readonly = readonly
            conn, sock = BookieProtocol(server), Socket()
            conn.connection_made(sock)
            conn.add_roles = roles
            flags = int(Flag.RECOVERY_ADD) if recovery else 0
            payload = _payload(lid, entry_id, payload_kind)
            expected = decide_add(readonly=readonly, known=state in ("known", "fenced"), owned=state != "foreign",
                                  entry_id=entry_id, payload_len=len(payload), header_matches=payload_kind == "match",
                                  key_given=key != NO_KEY, key_matches=key == KEY and state in ("known", "fenced"),
                                  fenced=state == "fenced", recovery=recovery, tombstoned=state == "deleted")
            to_python.clear()
            conn.data_received(encode_request(Op.ADD_ENTRY, flags, 1, lid, entry_id, key, 0, payload))
            for _ in range(3):
                await asyncio.sleep(0)
                syncer.release_all()
            answers = sock.responses()
            case = (state, key == KEY, key == NO_KEY, recovery, entry_id, payload_kind, readonly, roles)
            assert [(r[0], r[1]) for r in answers] == [(Op.ADD_ENTRY, expected.status)], (case, answers, expected)
            covered = roles & (ADD_RECOVER if recovery else ADD_WRITE)
            c_path = expected == ADD_OK and bool(covered)
            assert (not to_python) == c_path, (case, expected, len(to_python))
            assert (storage.ledger(lid) is not None) == (state in ("known", "fenced") or expected == ADD_CREATE), case
            cases += 1
        journal.close()
        storage.close()
        return cases

    assert uvloop.run(main()) == 5 * 3 * 2 * 2 * 3 * 2 * 4


def _fence_oracle(known: bool, given: bool, matches: bool) -> ReadDecision:
    """docs/protocol.md's fencing: the key is needed; an unknown ledger is fenced with its state made."""
    if not given or (known and not matches):
        return ReadDecision(ReadAction.REFUSE, Status.UNAUTHORIZED)
    return ReadDecision(ReadAction.FENCE, create=not known)


def test_read_decisions_agree_with_the_protocol_tables_on_every_combination() -> None:
    """decide_read, decide_read_lac and decide_write_lac on every combination of their inputs
    (a key can only match one the shard keeps; a cap of 3 long polls, 2 or 3 parked), against
    the answers docs/protocol.md tabulates, written apart; every action is reached."""
    actions = set()
    for owned, fence, poll, entry_id, known, given, matches, covered, parked in itertools.product(
            BOOL, BOOL, BOOL, (-1, 0), BOOL, BOOL, BOOL, BOOL, (2, 3)):
        matches, covered = matches and known and given, covered and known
        got = decide_read(owned=owned, fence=fence, long_poll=poll, entry_id=entry_id, known=known, key_given=given,
                          key_matches=matches, covered=covered, parked=parked, cap=3)
        if not owned:
            want = ReadDecision(ReadAction.REFUSE, Status.BAD_REQUEST)
        elif fence:
            want = _fence_oracle(known, given, matches)
        elif poll and entry_id >= 0:
            want = (ReadDecision(ReadAction.REFUSE, Status.NO_SUCH_LEDGER, poll_refused=True) if not known else
                    ReadDecision(ReadAction.LOOKUP) if covered else
                    ReadDecision(ReadAction.REFUSE, Status.NO_SUCH_ENTRY, poll_refused=True) if parked >= 3 else
                    ReadDecision(ReadAction.PARK))
        else:
            want = ReadDecision(ReadAction.LOOKUP) if known else ReadDecision(ReadAction.REFUSE, Status.NO_SUCH_LEDGER)
        assert got == want, (owned, fence, poll, entry_id, known, given, matches, covered, parked)
        actions.add(got.action)
        lac_got = decide_read_lac(owned=owned, fence=fence, known=known, key_given=given, key_matches=matches)
        lac_want = (ReadDecision(ReadAction.REFUSE, Status.BAD_REQUEST) if not owned else
                    _fence_oracle(known, given, matches) if fence else
                    ReadDecision(ReadAction.LOOKUP) if known else ReadDecision(ReadAction.REFUSE, Status.NO_SUCH_LEDGER))
        assert lac_got == lac_want, (owned, fence, known, given, matches)
    assert actions == set(ReadAction)
    statuses = set()
    for owned, lac, known, given, matches, fenced in itertools.product(BOOL, (-1, 0, 5), BOOL, BOOL, BOOL, BOOL):
        matches, fenced = matches and known and given, fenced and known
        got_status = decide_write_lac(owned=owned, lac=lac, known=known, key_given=given, key_matches=matches,
                                      fenced=fenced)
        want_status = (Status.BAD_REQUEST if not owned or lac < 0 else Status.NO_SUCH_LEDGER if not known else
                       Status.UNAUTHORIZED if not matches else Status.FENCED if fenced else Status.OK)
        assert got_status == want_status, (owned, lac, known, given, matches, fenced)
        statuses.add(got_status)
    assert statuses == {Status.OK, Status.BAD_REQUEST, Status.NO_SUCH_LEDGER, Status.UNAUTHORIZED, Status.FENCED}
