"""A hypothesis state machine per connection: a real in-process shard (tests/fuzz/targets/_shard.py:
ShardServer, AddPath, Journal, LedgerStorage) and three connections to it, driven with valid
and invalid frames in any order hypothesis picks.

Invariants, checked after every step:
- answers match requests: each answer on a connection is for a request sent on it (op and
  request id), exactly once, with the status a small model of the shard predicts (a ledger's
  first add claims it with its key; another key is UNAUTHORIZED; a fenced ledger takes only
  recovery adds; a read gets the bytes that were added);
- nothing stored changes on an error path: the shard's ledgers (key, fenced, LAC, last
  entry) and its write cache are the same before and after a request answered with an error;
- a bad frame closes only its own connection: the others keep being answered.
Reference: docs/protocol.md ("Bounds", "Status codes"); bookkeeper/bookie/server.py's docstring.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

sys.path.insert(0, str(Path(__file__).resolve().parent))

from targets._frames import KEY, entry  # noqa: E402
from targets._shard import Shard  # noqa: E402

from bookkeeper.client.digest import master_key  # noqa: E402
from bookkeeper.proto import NO_KEY, Flag, Op, Status, encode_request, parse_responses  # noqa: E402

OTHER_KEY = master_key(b"not the writer")
LEDGERS = (7, 8, 9)
CONNECTIONS = 3
BAD_FRAMES = {
    "shorter than a header": b"\x00\x00\x00\x08\x01" + bytes(7),
    "over the frame limit": b"\x7f\xff\xff\xff\x01",
    "unknown version": b"\x00\x00\x00\x40\x07" + bytes(0x40 - 1),
}


class Model:
    """What the shard should hold: per ledger its key, whether fenced, and its entries."""

    def __init__(self) -> None:
        self.keys: dict[int, bytes] = {}
        self.fenced: set[int] = set()
        self.entries: dict[int, dict[int, bytes]] = {}

    def add(self, ledger: int, entry_id: int, key: bytes, recovery: bool, payload: bytes) -> Status:
        if ledger not in self.keys:
            if key == NO_KEY:
                return Status.UNAUTHORIZED
            self.keys[ledger] = key
        elif self.keys[ledger] != key:
            return Status.UNAUTHORIZED
        if ledger in self.fenced and not recovery:
            return Status.FENCED
        self.entries.setdefault(ledger, {})[entry_id] = payload
        return Status.OK

    def fence(self, ledger: int, key: bytes) -> Status:
        if key == NO_KEY or self.keys.setdefault(ledger, key) != key:
            return Status.UNAUTHORIZED
        self.fenced.add(ledger)
        return Status.OK

    def read(self, ledger: int, entry_id: int) -> tuple[Status, bytes]:
        if ledger not in self.keys:
            return Status.NO_SUCH_LEDGER, b""
        data = self.entries.get(ledger, {}).get(entry_id)
        return (Status.OK, data) if data is not None else (Status.NO_SUCH_ENTRY, b"")


class ConnectionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.shard = Shard()
        self.model = Model()
        self.conns = [self.shard.connect() for _ in range(CONNECTIONS)]
        self.seen = [0] * CONNECTIONS  # bytes of each connection's answers already checked
        self.next_rid = 1
        self.next_entry: dict[int, int] = {}

    def teardown(self) -> None:
        for conn, _ in self.conns:
            self.shard.disconnect(conn)
        self.shard.close()

    # -- helpers --------------------------------------------------------------------
    def _stored(self) -> Any:
        s = self.shard.storage
        return ({lid: (st.master_key, st.fenced, st.lac, st.last_entry) for lid, st in s.ledgers.items()},
                dict(s.write_cache))

    def _answers(self, c: int) -> list[tuple]:
        """The answers that arrived on connection c since the last look."""
        received = bytes(self.conns[c][1].received)
        answers, used = parse_responses(received[self.seen[c]:], 1 << 30)
        assert self.seen[c] + used == len(received), "a partial answer"
        self.seen[c] += used
        return answers

    def _ask(self, c: int, op: int, flags: int, ledger: int, entry_id: int, key: bytes, payload: bytes) -> tuple:
        """Send one request on open connection c; its one answer (every other open connection
        got nothing)."""
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        before = self._stored()
        self.shard.send(self.conns[c][0], encode_request(op, flags, rid, ledger, entry_id, key, 0, payload))
        answers = self._answers(c)
        assert [(a[0], a[2]) for a in answers] == [(op, rid)], f"request {rid} got {answers}"
        assert not any(self._answers(o) for o in range(CONNECTIONS) if o != c), "an answer on another connection"
        if answers[0][1] != Status.OK:
            assert self._stored() == before, f"status {answers[0][1]} changed what is stored"
        assert not self.shard.errors.take()
        return answers[0]

    def _open(self, c: int) -> bool:
        return not self.conns[c][1].closed

    # -- rules ----------------------------------------------------------------------
    @rule(c=st.integers(0, CONNECTIONS - 1), ledger=st.sampled_from(LEDGERS),
          key=st.sampled_from([KEY, OTHER_KEY, NO_KEY]), recovery=st.booleans(), size=st.integers(0, 64))
    def add(self, c: int, ledger: int, key: bytes, recovery: bool, size: int) -> None:
        if not self._open(c):
            return
        entry_id = self.next_entry.get(ledger, 0)
        payload = entry(ledger, entry_id, bytes([entry_id % 256]) * size)
        expected = self.model.add(ledger, entry_id, key, recovery, payload)
        if expected == Status.OK:
            self.next_entry[ledger] = entry_id + 1
        answer = self._ask(c, Op.ADD_ENTRY, Flag.RECOVERY_ADD if recovery else 0, ledger, entry_id, key, payload)
        assert answer[1] == expected, f"add {ledger}:{entry_id}: {Status(answer[1]).name}, expected {expected.name}"

    @rule(c=st.integers(0, CONNECTIONS - 1), ledger=st.sampled_from(LEDGERS), entry_id=st.integers(-1, 4))
    def read(self, c: int, ledger: int, entry_id: int) -> None:
        if not self._open(c):
            return
        expected, data = self.model.read(ledger, entry_id)
        answer = self._ask(c, Op.READ_ENTRY, 0, ledger, entry_id, NO_KEY, b"")
        assert (answer[1], answer[6]) == (expected, data), f"read {ledger}:{entry_id}: {answer}"

    @rule(c=st.integers(0, CONNECTIONS - 1), ledger=st.sampled_from(LEDGERS), key=st.sampled_from([KEY, OTHER_KEY]))
    def fence(self, c: int, ledger: int, key: bytes) -> None:
        if not self._open(c):
            return
        expected = self.model.fence(ledger, key)
        answer = self._ask(c, Op.READ_LAC, Flag.FENCE, ledger, -1, key, b"")
        assert answer[1] == expected, f"fence {ledger}: {Status(answer[1]).name}, expected {expected.name}"

    @rule(c=st.integers(0, CONNECTIONS - 1), op=st.integers(max(Op) + 1, 255))
    def unknown_op(self, c: int, op: int) -> None:
        if not self._open(c):
            return
        answer = self._ask(c, op, 0, LEDGERS[0], 0, KEY, b"")
        assert answer[1] == Status.UNKNOWN_OP, answer

    @rule(c=st.integers(0, CONNECTIONS - 1), kind=st.sampled_from(sorted(BAD_FRAMES)))
    def bad_frame(self, c: int, kind: str) -> None:
        """A bad frame closes its connection and only that one; nothing stored changes."""
        if not self._open(c):
            return
        before = self._stored()
        self.shard.send(self.conns[c][0], BAD_FRAMES[kind])
        assert self.conns[c][1].closed, f"a frame {kind} left its connection open"
        assert not self._answers(c), "a bad frame was answered"
        assert self._stored() == before, f"a frame {kind} changed what is stored"

    @precondition(lambda self: any(not self._open(c) for c in range(CONNECTIONS)))
    @rule()
    def reconnect(self) -> None:
        c = next(c for c in range(CONNECTIONS) if not self._open(c))
        self.shard.disconnect(self.conns[c][0])
        self.conns[c] = self.shard.connect()
        self.seen[c] = 0

    # -- invariants -------------------------------------------------------------------
    @invariant()
    def open_connections_are_answered(self) -> None:
        """Whatever closed the others, every open connection still gets its answers."""
        for c in range(CONNECTIONS):
            if self._open(c):
                answer = self._ask(c, Op.GET_BOOKIE_INFO, 0, 0, -1, NO_KEY, b"")
                assert answer[1] == Status.OK, answer


ConnectionMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=20, deadline=None,
                                               database=None, suppress_health_check=[HealthCheck.too_slow])
test_connection_machine = ConnectionMachine.TestCase
