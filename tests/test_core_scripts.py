"""Interaction tests of the client core (bookkeeper/client/core/writer.py, recovery.py, reads.py), as
etcd raft's datadriven tests are: each file in tests/data/{writer,recovery,reads}/ is one scenario,
a run of commands against one core, each followed by `----` and the decisions it must print.
One file per defect these rules have had (the file's opening comment names it).

A case is `command key=value ...`, then `----`, then the expected lines up to a blank line.
Lines starting with `#` are comments. BK_REWRITE_SCRIPTS=1 writes the outputs the code gives
back into the files (for a deliberate change of rule; review the diff).

Writer commands: ledger e= qw= qa= segments=0:a,b,c;5:a,b,d [lac=N] [recovery]; add [n=1];
ack <entry> <bookie> [slot=N]; fail <entry> <bookie> <error> [slot=N]; change; replace <bookie>...; written;
conflict state=S [segments=...]; close; close-conflict state=S [last=N]; lac writing= lac=
told= sent= arm=; state. Recovery commands: ledger ... [state=S] [writer=...]; metadata
segments=...; begin; fence;
fenced <bookie> lac=N | fenced <bookie> <error>; read <entry>; copy <bookie> <data>;
deny <bookie>; error <bookie> <error>; bad <bookie>; outcome. Read commands: entry-read <entry>
replicas=a,b,c; next; copy-from <bookie>; fault <bookie> <error>. Stream writer commands
(bookkeeper/stream/core.py, tests/data/stream/): stream [set=bytes] [inflight=bytes] [records=N]
[bytes=N] [age=S] [last=txid]; segment seq=N [now=S]; write <call> <size>... [txids=1,2];
seal [length=N] [now=S]; acked <set> entry=N; settle <set> [error]; control; suspend; resume;
roll-done; stop <error>; close-segment last=N length=N.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from bookkeeper import errors
from bookkeeper._ext.client import AddTracker
from bookkeeper.client.core import reads, recovery, writer
from bookkeeper.client.core.writer import Change, CloseStep, Verdict, WriterCore
from bookkeeper.meta.ledger_metadata import DigestType, LedgerMetadata, LedgerState
from bookkeeper.meta.streams import Segment
from bookkeeper.proto import Flag
from bookkeeper.stream import core as stream_core
from bookkeeper.stream.position import Position
from bookkeeper.stream.writer import WriterSettings

DATA = Path(__file__).parent / "data"
SCRIPTS = [p for part in ("writer", "recovery", "reads", "stream") for p in sorted(DATA.glob(f"{part}/*.txt"))]

ERRORS: dict[str, type[errors.BKError]] = {
    "timeout": errors.TimeoutError,
    "unavailable": errors.BookieUnavailableError,
    "fenced": errors.LedgerFencedError,
    "no-entry": errors.NoSuchEntryError,
    "no-ledger": errors.NoSuchLedgerError,
    "too-large": errors.TooLargeError,
    "unauthorized": errors.UnauthorizedError,
    "zk-loss": errors.MetadataServiceError,
    "lock-lost": errors.StreamLockLostError,
}


def _segments(text: str) -> dict[int, list[str]]:
    return {int(first): bookies.split(",") for first, bookies in (s.split(":") for s in text.split(";"))}


def _show_segments(segments: dict[int, list[str]]) -> str:
    return " ".join(f"{first}:{','.join(segments[first])}" for first in sorted(segments))


def _fence_word(flags: int) -> str:
    return "FENCE" if flags & Flag.FENCE else "no FENCE"


class _Settled:
    """What the tracker holds per entry in place of a future: records how it settled."""

    def __init__(self, script: Script, entry_id: int) -> None:
        self.script, self.entry_id, self.settled = script, entry_id, False

    def done(self) -> bool:
        return self.settled

    def set_result(self, _lac: int) -> None:
        self.settled = True
        self.script.settled.append(f"e{self.entry_id}")

    def set_exception(self, err: BaseException) -> None:
        self.settled = True
        self.script.settled.append(f"e{self.entry_id}")


class _Call:
    """A stream write call's completion (a future in the shell): records how it ended."""

    def __init__(self, name: str) -> None:
        self.name, self.outcome = name, ""

    def done(self) -> bool:
        return bool(self.outcome)

    def set_result(self, positions: list[Position]) -> None:
        self.outcome = "done at " + " ".join(f"{p.segment}/{p.entry}/{p.slot}" for p in positions)

    def set_exception(self, err: BaseException) -> None:
        self.outcome = f"failed: {type(err).__name__}"


class Script:
    """One scenario's state: the metadata, a writer core over an AddTracker, the votes."""

    def __init__(self) -> None:
        self.md: LedgerMetadata | None = None
        self.core: WriterCore | None = None
        self.change: Change | None = None
        self.proposal: LedgerMetadata | None = None
        self.fence: recovery.FenceVote | None = None
        self.read: recovery.EntryVote | None = None
        self.entry_read: reads.ReplicaRead | None = None
        self.next = 0
        self.settled: list[str] = []  # entries settled by the last command, in order
        self.stream: stream_core.StreamWriterCore | None = None
        self.calls: dict[str, _Call] = {}
        self.sets: list[tuple[stream_core.RecordSet, int, int]] = []  # sent: the set, its payload size, its segment

    # -- commands --------------------------------------------------------------
    def run(self, cmd: str, args: list[str], kw: dict[str, str]) -> list[str]:
        fn = getattr(self, "do_" + cmd.replace("-", "_"), None)
        if fn is None:
            raise ValueError(f"unknown command {cmd!r}")
        out: list[str] = fn(args, kw)
        return out

    def do_ledger(self, args: list[str], kw: dict[str, str]) -> list[str]:
        e, qw, qa = int(kw["e"]), int(kw["qw"]), int(kw["qa"])
        writer = _segments(kw["writer"]) if "writer" in kw else None
        self.md = LedgerMetadata(ledger_id=7, ensemble_size=e, write_quorum=qw, ack_quorum=qa,
                                 digest=DigestType.CRC32C, password_digest="", ensembles=_segments(kw["segments"]),
                                 state=LedgerState(kw.get("state", "OPEN")), writer_ensembles=writer, version=1)
        lac = int(kw.get("lac", -1))
        tracker = AddTracker(ensemble_size=e, write_quorum=qw, ack_quorum=qa, lac=lac)
        self.core = WriterCore(self.md, tracker, recovery="recovery" in args)
        self.next = lac + 1
        return [f"ledger {e}/{qw}/{qa} {self.md.state.value} {_show_segments(self.md.ensembles)}"]

    @property
    def _core(self) -> WriterCore:
        assert self.core is not None, "no ledger command yet"
        return self.core

    def do_add(self, args: list[str], kw: dict[str, str]) -> list[str]:
        core, out = self._core, []
        for _ in range(int(kw.get("n", 1))):
            eid = self.next
            self.next += 1
            ensemble = core.metadata.ensemble_for(eid)
            idxs = core.tracker.add(eid, 10, _Settled(self, eid), b"e%d" % eid, ensemble)
            out.append(f"e{eid} -> {' '.join(ensemble[i] for i in idxs)}")
        return out

    def _slot(self, entry_id: int, bookie: str, kw: dict[str, str]) -> int:
        if "slot" in kw:  # a bookie no longer at any slot of the entry: where it was
            return int(kw["slot"])
        sent = self._core.tracker.sent_to(entry_id)
        if bookie in sent:
            return int(sent.index(bookie))
        return self._core.metadata.ensemble_for(entry_id).index(bookie)  # settled: where it was written

    def do_ack(self, args: list[str], kw: dict[str, str]) -> list[str]:
        core = self._core
        self.settled = []
        entry_id, bookie = int(args[0]), args[1]
        core.tracker.ack_from(entry_id, self._slot(entry_id, bookie, kw), bookie, core.failed)
        return [f"lac {core.tracker.lac}" + (f", acknowledged {' '.join(self.settled)}" if self.settled else "")]

    def do_fail(self, args: list[str], kw: dict[str, str]) -> list[str]:
        core = self._core
        entry_id, bookie, err = int(args[0]), args[1], ERRORS[args[2]]("injected")
        verdict, error = core.on_failure(entry_id, self._slot(entry_id, bookie, kw), bookie, err)
        if verdict is Verdict.FAIL:
            assert error is not None
            self.settled = []
            for _eid, fut in core.fail(error):
                fut.set_exception(error)
            return [f"fail: {type(error).__name__}: {error}"] + ([f"adds failed: {' '.join(self.settled)}"]
                                                                  if self.settled else [])
        return [f"{verdict.value}" + (f" (failed: {' '.join(sorted(core.failed))})" if core.failed else "")]

    def do_change(self, args: list[str], kw: dict[str, str]) -> list[str]:
        self.change = self._core.next_change()
        if self.change is None:
            return ["no change: nothing goes to a failed bookie (failed set forgotten)"]
        c = self.change
        return [f"change from {c.start}: {','.join(c.base)}, slots {' '.join(map(str, c.slots))}"]

    def do_replace(self, args: list[str], kw: dict[str, str]) -> list[str]:
        assert self.change is not None, "no change command before"
        ensemble = list(self.change.base)
        for slot, bookie in zip(self.change.slots, args, strict=True):
            ensemble[slot] = bookie
        self.proposal = self._core.proposal(self.change, ensemble)
        if self.proposal is None:
            return ["already in the metadata: nothing to write"]
        return [f"propose {_show_segments(self.proposal.ensembles)}"]

    def do_written(self, args: list[str], kw: dict[str, str]) -> list[str]:
        written = None if self.proposal is None else self.proposal.replace(version=self.proposal.version + 1)
        resends = self._core.changed(written)
        for r in resends:  # as the shell's send does
            self._core.tracker.mark_sent(r.entry_id, r.idx, r.bookie)
        return [f"resend e{r.entry_id} slot {r.idx} -> {r.bookie}" for r in resends] or ["no resend"]

    def do_conflict(self, args: list[str], kw: dict[str, str]) -> list[str]:
        core = self._core
        fresh = core.metadata.replace(state=LedgerState(kw["state"]), version=core.metadata.version + 1,
                                      **({"ensembles": _segments(kw["segments"])} if "segments" in kw else {}))
        fenced = core.on_conflict(fresh)
        if fenced is not None:
            return [f"fenced: {type(fenced).__name__}: {fenced}"]
        return [f"next try on version {core.metadata.version}: {_show_segments(core.metadata.ensembles)}"]

    def do_close(self, args: list[str], kw: dict[str, str]) -> list[str]:
        p = self._core.close_proposal()
        return [f"close at {p.last_entry_id}, length {p.length}"]

    def do_close_conflict(self, args: list[str], kw: dict[str, str]) -> list[str]:
        core = self._core
        fresh = core.metadata.replace(state=LedgerState(kw["state"]), version=core.metadata.version + 1,
                                      last_entry_id=int(kw.get("last", -1)))
        try:
            step = core.on_close_conflict(fresh)
        except errors.BKError as e:
            return [f"error: {type(e).__name__}: {e}"]
        return ["done: closed by another at the same entry" if step is CloseStep.DONE else "write the close again"]

    def do_lac(self, args: list[str], kw: dict[str, str]) -> list[str]:
        step = writer.lac_step(writing=kw["writing"] == "1", lac=int(kw["lac"]), lac_told=int(kw["told"]),
                        adds_sent=int(kw["sent"]), adds_at_arm=int(kw["arm"]))
        return [step.value]

    def do_state(self, args: list[str], kw: dict[str, str]) -> list[str]:
        core = self._core
        return [f"lac {core.tracker.lac}, outstanding {core.tracker.outstanding}, "
                f"failed [{' '.join(sorted(core.failed))}], writing {'yes' if core.writing else 'no'}, "
                f"segments {_show_segments(core.metadata.ensembles)}"]

    # -- recovery --------------------------------------------------------------
    @property
    def _md(self) -> LedgerMetadata:
        assert self.md is not None, "no ledger command yet"
        return self.md

    def do_metadata(self, args: list[str], kw: dict[str, str]) -> list[str]:
        """Another client changed the segments (an interrupted recovery's ensemble change)."""
        self.md = self._md.replace(ensembles=_segments(kw["segments"]), version=self._md.version + 1)
        return [f"{self.md.state.value} {_show_segments(self.md.ensembles)}"]

    def do_begin(self, args: list[str], kw: dict[str, str]) -> list[str]:
        proposal = recovery.recovery_proposal(self._md)
        if proposal is None:
            return [f"nothing to write: {self._md.state.value}"]
        self.md = proposal
        if proposal.writer_ensembles is None:
            return ["write IN_RECOVERY, no writer's segments noted"]
        return [f"write IN_RECOVERY, writer's segments {_show_segments(proposal.writer_ensembles)}"]

    def do_fence(self, args: list[str], kw: dict[str, str]) -> list[str]:
        self.fence = recovery.FenceVote(recovery.writer_view(self._md))
        return [f"READ_LAC {_fence_word(self.fence.flags)} to {' '.join(self.fence.bookies)}"]

    def do_fenced(self, args: list[str], kw: dict[str, str]) -> list[str]:
        assert self.fence is not None
        idx = self.fence.bookies.index(args[0])
        if len(args) > 1:
            decided = self.fence.answer(idx, None, ERRORS[args[1]]("injected"))
        else:
            decided = self.fence.answer(idx, int(kw["lac"]))
        if not decided:
            return ["undecided"]
        try:
            return [f"decided: recovery reads from entry {self.fence.outcome() + 1}"]
        except errors.RecoveryError as e:
            return [f"decided: {type(e).__name__}: {e}"]

    def do_read(self, args: list[str], kw: dict[str, str]) -> list[str]:
        self.read = recovery.EntryVote(recovery.writer_view(self._md), int(args[0]))
        return [f"READ_ENTRY {args[0]} {_fence_word(self.read.flags)} to {' '.join(self.read.bookies)}"]

    def _answer(self, data: bytes | None, err: BaseException | None) -> list[str]:
        assert self.read is not None
        if not self.read.answer(data, err):
            return ["undecided"]
        found = self.read.outcome()
        return ["decided: never acknowledged, the ledger ends before it" if found is None
                else f"decided: rewrite {found.decode()}"]

    def do_copy(self, args: list[str], kw: dict[str, str]) -> list[str]:
        return self._answer(args[1].encode(), None)

    def do_deny(self, args: list[str], kw: dict[str, str]) -> list[str]:
        return self._answer(None, errors.NoSuchEntryError("injected"))

    def do_error(self, args: list[str], kw: dict[str, str]) -> list[str]:
        return self._answer(None, ERRORS[args[1]]("injected"))

    def do_bad(self, args: list[str], kw: dict[str, str]) -> list[str]:
        return self._answer(None, errors.DigestMismatchError("injected"))

    def do_outcome(self, args: list[str], kw: dict[str, str]) -> list[str]:
        assert self.read is not None
        try:
            found = self.read.outcome()
        except errors.RecoveryError as e:
            return [f"{type(e).__name__}: {e}"]
        return [repr(found)]

    # -- an entry read --------------------------------------------------------------
    def do_entry_read(self, args: list[str], kw: dict[str, str]) -> list[str]:
        self.entry_read = reads.ReplicaRead(7, int(args[0]), kw["replicas"].split(","))
        return [f"read 7:{args[0]} from {' '.join(self.entry_read.replicas)}"]

    def do_next(self, args: list[str], kw: dict[str, str]) -> list[str]:
        r = self.entry_read
        assert r is not None
        bookie = r.take_next()
        if bookie is None:
            return ["nobody left to ask"]
        return [f"ask {bookie}, " + ("a speculative timer" if r.can_speculate else "no timer")]

    def do_copy_from(self, args: list[str], kw: dict[str, str]) -> list[str]:
        r = self.entry_read
        assert r is not None
        return [f"settled by {args[0]}'s copy" if r.copy_arrived() else f"{args[0]}'s copy comes late: ignored"]

    def do_fault(self, args: list[str], kw: dict[str, str]) -> list[str]:
        r = self.entry_read
        assert r is not None
        out = [f"penalize {args[0]}" if r.error_arrived(ERRORS[args[1]]("injected")) else f"{args[0]} denies: no penalty"]
        if r.exhausted:
            err = r.failure()
            out.append(f"read failed: {type(err).__name__}: {err}")
        return out


    # -- a stream writer -------------------------------------------------------------
    @property
    def _stream(self) -> stream_core.StreamWriterCore:
        assert self.stream is not None, "no stream command yet"
        return self.stream

    def _calls_ended(self) -> list[str]:
        out = [f"{c.name} {c.outcome}" for c in self.calls.values() if c.outcome]
        self.calls = {n: c for n, c in self.calls.items() if not c.outcome}
        return out

    def do_stream(self, args: list[str], kw: dict[str, str]) -> list[str]:
        settings = WriterSettings(record_set_max_bytes=int(kw.get("set", 64 * 1024)),
                                  max_inflight_bytes=int(kw.get("inflight", 32 * 1024 * 1024)),
                                  segment_max_records=int(kw["records"]) if "records" in kw else None,
                                  segment_max_bytes=int(kw["bytes"]) if "bytes" in kw else None,
                                  segment_max_age_s=float(kw["age"]) if "age" in kw else None).validate()
        self.stream = stream_core.StreamWriterCore("s", settings, last_txid=int(kw.get("last", -1)))
        return [f"stream s after txid {self.stream.last_txid}"]

    def do_segment(self, args: list[str], kw: dict[str, str]) -> list[str]:
        seq = int(kw["seq"])
        self._stream.segment_started(Segment(seq=seq, ledger_id=100 + seq, ctime_ms=0), float(kw.get("now", 0)))
        return [f"segment {seq} open"]

    def do_write(self, args: list[str], kw: dict[str, str]) -> list[str]:
        call = _Call(args[0])
        records = [b"x" * int(n) for n in args[1:]]
        txids = [int(t) for t in kw["txids"].split(",")] if "txids" in kw else None
        try:
            seal = self._stream.accept(records, txids, stream_core.Waiter(call, len(records)))  # type: ignore[arg-type]
        except (errors.BKError, ValueError, TypeError) as e:
            return [f"refused: {type(e).__name__}: {e}"]
        self.calls[call.name] = call
        p = self._stream.pending
        return [f"pending {len(p.records)} record(s), {p.size} bytes, last txid {self._stream.last_txid}: seal "
                f"{seal.value}"]

    def do_seal(self, args: list[str], kw: dict[str, str]) -> list[str]:
        """What the shell's _maybe_seal does: sets until the core holds the rest."""
        core, out = self._stream, []
        length = int(kw.get("length", 0))
        while True:
            step = core.next_set(length)
            if step is None:
                why = ("a roll" if core.rolling else "ZooKeeper paused" if core.suspended else
                       f"the writer failed ({type(core.error).__name__})" if core.error else None)
                out.append(f"held: {why}" if why and core.pending.records else "nothing pending")
                return out
            if step is stream_core.Room.WAIT:
                out.append(f"wait for room: {core.inflight_bytes} bytes in flight")
                return out
            batch, payload = step
            assert core.segment is not None
            reason = core.sent(batch, len(payload), now=float(kw.get("now", 0)), ledger_length=length)
            self.sets.append((batch, len(payload), core.segment.seq))
            owners = " ".join(f"{w.fut.name}:{n}" for w, n in batch.owners)
            out.append(f"set {len(self.sets) - 1}: txids {batch.records[0][0]}..{batch.records[-1][0]} "
                       f"({owners}), {len(payload)} bytes")
            if reason is not None:
                core.rolling = True
                out.append(f"roll ({reason.value})")

    def do_acked(self, args: list[str], kw: dict[str, str]) -> list[str]:
        batch, size, seq = self.sets[int(args[0])]
        out = self._settle(size, None)
        batch.acked(seq, int(kw["entry"]))
        return out + self._calls_ended()

    def do_settle(self, args: list[str], kw: dict[str, str]) -> list[str]:
        batch, size, _seq = self.sets[int(args[0])]
        exc = ERRORS[args[1]]("injected") if len(args) > 1 else None
        out = self._settle(size, exc)
        if exc is not None:
            batch.fail(self._stream.set_failed(exc))
        return out + self._calls_ended()

    def _settle(self, size: int, exc: BaseException | None) -> list[str]:
        core = self._stream
        err = core.settled(size, exc)
        if err is not None:
            if core.error is None:
                core.fail(err).fail(err)
            return [f"writer stops: {type(err).__name__}"]
        return ["idle: arm the control timer"] if core.idle else ["settled"]

    def do_control(self, args: list[str], kw: dict[str, str]) -> list[str]:
        core = self._stream
        payload = core.control()
        if payload is None:
            return ["no control entry"]
        core.control_sent(len(payload))
        self.sets.append((stream_core.RecordSet(), len(payload), core.segment.seq if core.segment else -1))
        return [f"control entry {len(self.sets) - 1}: LAC of txid {core.seg_last_txid}, {len(payload)} bytes"]

    def do_suspend(self, args: list[str], kw: dict[str, str]) -> list[str]:
        self._stream.suspended = True
        return ["suspended"]

    def do_resume(self, args: list[str], kw: dict[str, str]) -> list[str]:
        self._stream.suspended = False
        return ["resumed"]

    def do_roll_done(self, args: list[str], kw: dict[str, str]) -> list[str]:
        self._stream.rolling = False
        return ["roll done"]

    def do_stop(self, args: list[str], kw: dict[str, str]) -> list[str]:
        err = ERRORS[args[0]]("injected")
        self._stream.fail(err).fail(err)
        return [f"stopped: {type(err).__name__}"] + self._calls_ended()

    def do_close_segment(self, args: list[str], kw: dict[str, str]) -> list[str]:
        seg = self._stream.segment_closed(int(kw["last"]), int(kw["length"]), 0)
        if seg is None:
            return ["retire the segment: its ledger is empty"]
        return [f"close segment {seg.seq}: txids {seg.first_txid}..{seg.last_txid}, {seg.records} record(s), "
                f"last entry {seg.last_entry}, {seg.size_bytes} bytes"]


def _cases(text: str) -> list[tuple[str, list[str], int, int]]:
    """(command line, expected lines, first and last line index of the expected block)."""
    lines = text.split("\n")
    out: list[tuple[str, list[str], int, int]] = []
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if not line or line.startswith("#"):
            i += 1
            continue
        if i + 1 >= len(lines) or lines[i + 1].strip() != "----":
            raise ValueError(f"line {i + 1}: {line!r} is not followed by ----")
        j = i + 2
        while j < len(lines) and lines[j].strip():
            j += 1
        out.append((line, lines[i + 2:j], i + 2, j))
        i = j
    return out


def _parse(line: str) -> tuple[str, list[str], dict[str, str]]:
    cmd, *words = line.split()
    args = [w for w in words if "=" not in w]
    kw = dict(w.split("=", 1) for w in words if "=" in w)
    return cmd, args, kw


def _check(path: Path) -> tuple[list[str], list[tuple[int, int, list[str]]]]:
    """Run one script: its mismatches (described), and each mismatching block with the output got."""
    script = Script()
    rewritten: list[tuple[int, int, list[str]]] = []
    mismatches: list[str] = []
    for line, expected, start, end in _cases(path.read_text()):
        try:
            got = script.run(*_parse(line))
        except Exception as e:  # noqa: BLE001 - a scenario gone off its rails is a mismatch, reported
            got = [f"the command failed: {e!r}"]
        if got != expected:
            mismatches.append(f"{path.name}:{start - 1}: {line}\n  expected: {expected}\n  got:      {got}")
            rewritten.append((start, end, got))
    return mismatches, rewritten


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_script(path: Path) -> None:
    mismatches, rewritten = _check(path)
    if rewritten and os.environ.get("BK_REWRITE_SCRIPTS") == "1":
        lines = path.read_text().split("\n")
        for start, end, got in reversed(rewritten):
            lines[start:end] = got
        path.write_text("\n".join(lines))
        return
    assert not mismatches, "\n".join(mismatches)


# The simulator's mutations that break a rule of the core: each must fail some script.
CORE_MUTATIONS = {
    "no-replacement-on-late-failure": "late_failure_replaces_hung_bookie",
    "replaced-bookie-acks-count": "acks_during_change",
    "recovery-fences-one": "fence_coverage",
    "recovery-reads-without-fence": "reads_fence",
    "recovery-without-fence": "fence_coverage",
    "recovery-from-interrupted-segments": "interrupted_recovery_segments",
    "recovery-below-last-segment": "last_segment_floor",
}


@pytest.mark.parametrize("mutation", sorted(CORE_MUTATIONS))
def test_each_core_mutation_fails_its_script(mutation: str) -> None:
    """The scripts can fail: with a known-wrong rule swapped in (the simulator's mutations,
    bookkeeper/testing/sim/mutations.py) the script of that defect no longer passes. Some of
    these the simulator's seeds catch rarely or never (docs/simulation.md); the scripts place them."""
    from bookkeeper.testing.sim.mutations import applied
    with applied(mutation):
        failing = {p.stem for p in SCRIPTS if _check(p)[0]}
    assert CORE_MUTATIONS[mutation] in failing


def test_the_scripts_exist_and_parse() -> None:
    """A glob that finds nothing, or a file without a case, would pass silently above."""
    assert {p.parent.name for p in SCRIPTS} == {"writer", "recovery", "reads", "stream"}
    for path in SCRIPTS:
        assert _cases(path.read_text()), f"{path} has no case"


def test_a_wrong_expectation_fails(tmp_path: Path) -> None:
    """The runner compares: a script with a wrong decision is reported with its line."""
    script = tmp_path / "wrong.txt"
    script.write_text("ledger e=3 qw=2 qa=2 segments=0:a,b,c\n----\nledger 3/2/2 OPEN 0:a,b,c\n\n"
                      "add\n----\ne0 -> a b\n\n"
                      "ack 0 a\n----\nlac 0, acknowledged e0\n")  # one of Qa = 2: not acknowledged
    mismatches, rewritten = _check(script)
    assert len(mismatches) == 1 and "wrong.txt:9: ack 0 a" in mismatches[0]
    assert rewritten[0][2] == ["lac -1"]
