"""The checker: a pure function from a history's records to a VerifyReport.

Why pure and after the fact: the workload cannot know, while it runs, which of its
acknowledged entries a later recovery will keep; only the whole history can say. No I/O, no
clock: a table of small hand-written histories tests every anomaly (tests/test_verify_checker.py),
and `bk verify check FILE` re-judges a run offline with the same code.

What it reports (docs/operations.md, "Checking a cluster"):

| kind | when |
|---|---|
| `lost` | an add (or stream append) was acknowledged, and the final read-back after recovery did not return it; `detail` says whether the hole is at the ledger's start, middle or end |
| `unexpected` | a read returned content no writer ever sent for that entry (or txid) |
| `divergent` | two reads returned different contents for one entry; two ends for one ledger; a read of an entry past the ledger's recovered end |
| `ack_past_end` | an add was acknowledged after a close or recovery had fixed the ledger's end below it (fencing failed) |
| `lac_regression` | one reader saw a ledger's LAC go back |
| `stream_duplicate` | one stream reader met a txid twice |
| `stream_order` | one stream reader met a txid lower than one before it |

Besides: `writer_errors` (failures a writer saw other than the fencing a takeover causes:
distinct (proc, ledger, error) incidents), `longest_stall_s` (the longest time a writer had an
add outstanding and no add completed), `fault_errors` (fault steps whose command failed),
`fault_steps` (each step's kind, target, inject and heal times, and the longest writer stall
that overlapped it: what a fault cost the writers).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

ANOMALY_KINDS = ("lost", "unexpected", "divergent", "ack_past_end", "lac_regression", "stream_duplicate",
                 "stream_order")
WRITES = ("add", "append")  # the writes whose completions bound a writer's stall
TAKEOVER_PROC = "takeover"
FINAL_PROC = "final"
STALL_NOTED_S = 0.2  # waits longer than this are kept, to say which fault step they overlapped


@dataclass(frozen=True, slots=True)
class Anomaly:
    kind: str
    ledger_id: int | None
    entry_id: int | None
    detail: str
    line: int  # 1-based line of the history record that shows it


@dataclass(slots=True)
class VerifyReport:
    """A checked run: what `bk verify` prints and `--json` dumps."""

    ops: int = 0                     # invocations
    acked: int = 0                   # acknowledged adds and stream appends
    anomalies: list[Anomaly] = field(default_factory=list)
    longest_stall_s: float = 0.0
    longest_stall_proc: str | None = None   # who stalled, and from when (seconds since the start)
    longest_stall_from_s: float | None = None
    writer_errors: int = 0
    writer_error_samples: list[str] = field(default_factory=list)
    ledgers: int = 0
    takeovers: int = 0
    stream_records: int = 0          # acknowledged stream appends
    faults: int = 0                  # fault steps injected
    fault_errors: list[str] = field(default_factory=list)
    fault_steps: list[dict[str, Any]] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)  # acknowledged ledgers/streams never read back
    seconds: float = 0.0             # the run's length (0 for an offline check)
    check_seconds: float = 0.0
    history: str | None = None

    @property
    def ok(self) -> bool:
        return not self.anomalies

    @property
    def complete(self) -> bool:
        """Every ledger and stream with an acknowledgement was read back: a history cut short
        (an interrupted run) cannot say whether anything was lost, and says so."""
        return not self.unchecked

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for a in self.anomalies:
            out[a.kind] += 1
        return dict(out)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["longest_stall_s"] = round(self.longest_stall_s, 3)
        out["anomaly_counts"] = self.counts()
        return out


def _where(entry_id: int, read_ids: set[int]) -> str:
    """start, middle or end: where an unreadable entry sits among the ones read back."""
    if entry_id > max(read_ids):
        return "end"
    return "start" if entry_id < min(read_ids) else "middle"


class _Checker:
    """One pass over the records, then the end-of-history checks (finish)."""

    MAX_SAMPLES = 10

    def __init__(self) -> None:
        self.r = VerifyReport()
        self.sent: dict[tuple[int, int], str] = {}             # (ledger, entry) -> digest invoked
        self.acked: dict[int, dict[int, int]] = defaultdict(dict)  # ledger -> entry -> line of the ack
        self.read: dict[tuple[int, int], tuple[str, int]] = {}  # (ledger, entry) -> (digest, line) first read
        self.final_read: dict[int, set[int]] = defaultdict(set)
        self.max_read: dict[int, tuple[int, int]] = {}           # ledger -> (highest entry read, line)
        self.ends: dict[int, tuple[int, int]] = {}              # ledger -> (end, line) first fixed
        self.final_failed: dict[int, str] = {}
        self.lacs: dict[tuple[str, int], int] = {}
        self.takeover_ledgers: set[int] = set()
        self.errors: set[tuple[str, Any, str]] = set()
        self.ledgers: set[int] = set()
        self.outstanding: dict[str, int] = defaultdict(int)
        self.since: dict[str, float] = {}
        self.appended: dict[tuple[str, int], str] = {}       # (stream, txid) -> digest sent
        self.appends_acked: dict[tuple[str, int], int] = {}  # (stream, txid) -> line of the ack
        self.stream_seen: dict[tuple[str, str], set[int]] = defaultdict(set)  # (reader, stream) -> txids
        self.stream_last: dict[tuple[str, str], int] = {}
        self.final_txids: set[tuple[str, int]] = set()
        self.final_streams: set[str] = set()   # streams whose read-back began
        self.final_ledgers: set[int] = set()   # ledgers whose read-back began
        self.line = 0
        self.last_t = 0.0
        self.stalls: list[tuple[float, float]] = []  # (from, to) of each wait past STALL_NOTED_S

    def anomaly(self, kind: str, ledger_id: int | None, entry_id: int | None, detail: str,
                line: int | None = None) -> None:
        self.r.anomalies.append(Anomaly(kind, ledger_id, entry_id, detail, self.line if line is None else line))

    # -- per record ------------------------------------------------------------------
    def feed(self, rec: dict[str, Any]) -> None:
        self.line += 1
        typ, f = rec["type"], rec["f"]
        self.last_t = rec["t"]
        if typ == "invoke":
            self.r.ops += 1
            self.invoke(rec, f)
            return
        if f in WRITES:
            self.write_done(rec)
        handler = self.HANDLERS.get((f, typ))
        if handler is not None:
            handler(self, rec)
        elif typ == "fail":
            self.failed(rec, f)

    def invoke(self, rec: dict[str, Any], f: str) -> None:
        if f == "add":
            self.sent[rec["ledger_id"], rec["entry_id"]] = rec["value"]
            proc = rec["proc"]
            if self.outstanding[proc] == 0:
                self.since[proc] = rec["t"]
            self.outstanding[proc] += 1
        elif f == "append":
            self.appended[rec.get("stream", ""), rec["txid"]] = rec["value"]
            proc = rec["proc"]
            if self.outstanding[proc] == 0:
                self.since[proc] = rec["t"]
            self.outstanding[proc] += 1
        elif f == "recover" and rec["proc"] == TAKEOVER_PROC:
            self.takeover_ledgers.add(rec["ledger_id"])
            self.r.takeovers += 1
        elif f == "stream_read" and rec["proc"] == FINAL_PROC:
            self.final_streams.add(rec.get("stream", ""))
        elif f == "recover" and rec["proc"] == FINAL_PROC:
            self.final_ledgers.add(rec["ledger_id"])
        elif f == "fault" and rec.get("phase") == "inject":
            self.r.faults += 1
            self.r.fault_steps.append({"step": rec.get("step"), "kind": rec.get("kind"), "target": rec.get("target"),
                                       "inject_s": rec["t"], "healed_s": None, "longest_stall_s": 0.0})

    def write_done(self, rec: dict[str, Any]) -> None:
        """A write completed: the writer's stall, if it had one, ends here."""
        proc = rec["proc"]
        if self.outstanding[proc] <= 0:
            return
        t = rec["t"]
        if t - self.since[proc] > STALL_NOTED_S:
            self.stalls.append((self.since[proc], t))
        if t - self.since[proc] > self.r.longest_stall_s:
            self.r.longest_stall_s = t - self.since[proc]
            self.r.longest_stall_proc, self.r.longest_stall_from_s = proc, self.since[proc]
        self.outstanding[proc] -= 1
        self.since[proc] = t

    def add_ok(self, rec: dict[str, Any]) -> None:
        ledger, entry = rec["ledger_id"], rec["entry_id"]
        self.r.acked += 1
        self.acked[ledger][entry] = self.line
        end = self.ends.get(ledger)
        if end is not None and entry > end[0]:
            self.anomaly("ack_past_end", ledger, entry,
                         f"acknowledged after the ledger's end was fixed at {end[0]} (line {end[1]})")

    def create_ok(self, rec: dict[str, Any]) -> None:
        self.ledgers.add(rec["ledger_id"])

    def end_fixed(self, rec: dict[str, Any]) -> None:
        ledger, end = rec["ledger_id"], rec["end"]
        self.ledgers.add(ledger)
        first = self.ends.get(ledger)
        if first is None:
            self.ends[ledger] = (end, self.line)
        elif first[0] != end:
            self.anomaly("divergent", ledger, None,
                         f"ledger ended at {end} by {rec['proc']} {rec['f']}, at {first[0]} before (line {first[1]})")

    def read_ok(self, rec: dict[str, Any]) -> None:
        ledger, first = rec["ledger_id"], rec["entry_id"]
        values = rec.get("values")
        if values is None:
            values = [rec["value"]]
        final = rec["proc"] == FINAL_PROC
        for entry, value in enumerate(values, first):
            self.one_read(ledger, entry, value)
            if final:
                self.final_read[ledger].add(entry)
        if values:
            last = first + len(values) - 1
            if last > self.max_read.get(ledger, (-1, 0))[0]:
                self.max_read[ledger] = (last, self.line)

    def one_read(self, ledger: int, entry: int, value: str) -> None:
        key = (ledger, entry)
        sent = self.sent.get(key)
        if sent != value:
            self.anomaly("unexpected", ledger, entry,
                         f"read {value}, " + (f"sent {sent}" if sent is not None else "never sent"))
        seen = self.read.get(key)
        if seen is None:
            self.read[key] = (value, self.line)
        elif seen[0] != value:
            self.anomaly("divergent", ledger, entry, f"read {value}, and {seen[0]} before (line {seen[1]})")

    def lac_ok(self, rec: dict[str, Any]) -> None:
        key = (rec["proc"], rec["ledger_id"])
        lac = rec["value"]
        before = self.lacs.get(key)
        if before is not None and lac < before:
            self.anomaly("lac_regression", rec["ledger_id"], lac, f"{rec['proc']} saw the LAC go from {before} to {lac}")
        else:
            self.lacs[key] = lac

    def recover_fail(self, rec: dict[str, Any]) -> None:
        if rec["proc"] == FINAL_PROC:
            self.final_failed[rec["ledger_id"]] = rec.get("error", "failed")
        else:
            self.failed(rec, "recover")

    def read_fail(self, rec: dict[str, Any]) -> None:
        if rec["proc"] == FINAL_PROC:
            self.final_failed[rec["ledger_id"]] = rec.get("error", "failed")

    def append_ok(self, rec: dict[str, Any]) -> None:
        self.r.acked += 1
        self.r.stream_records += 1
        self.appends_acked[rec.get("stream", ""), rec["txid"]] = self.line

    def stream_read_ok(self, rec: dict[str, Any]) -> None:
        proc, stream, txid, value = rec["proc"], rec.get("stream", ""), rec["txid"], rec["value"]
        sent = self.appended.get((stream, txid))
        if sent != value:
            self.anomaly("unexpected", None, None, f"stream {stream} txid {txid} at {rec.get('position')}: "
                         f"read {value}, " + (f"sent {sent}" if sent is not None else "never sent"))
        if proc == FINAL_PROC:
            self.final_txids.add((stream, txid))
        seen = self.stream_seen[proc, stream]
        last = self.stream_last.get((proc, stream))
        if txid in seen:
            self.anomaly("stream_duplicate", None, None, f"{proc} read txid {txid} again at {rec.get('position')}")
        elif last is not None and txid < last:
            self.anomaly("stream_order", None, None, f"{proc} read txid {txid} after txid {last} at {rec.get('position')}")
        seen.add(txid)
        self.stream_last[proc, stream] = max(txid, last if last is not None else txid)

    def fault_fail(self, rec: dict[str, Any]) -> None:
        self.r.fault_errors.append(f"step {rec.get('step')} {rec.get('kind')} {rec.get('phase')}: "
                                   f"{rec.get('error', 'failed')}")

    def failed(self, rec: dict[str, Any], f: str) -> None:
        """A writer's failure: expected when its ledger was taken over, else a writer error."""
        if f not in ("add", "create", "close", "append") or rec["proc"] == FINAL_PROC:
            return
        if rec.get("retry") or rec.get("ledger_id") in self.takeover_ledgers:
            return  # the writer tried again (a retriable error), or its ledger was taken over
        incident = (rec["proc"], rec.get("ledger_id"), str(rec.get("error", "")).split(":")[0])
        if incident not in self.errors:
            self.errors.add(incident)
            self.r.writer_errors += 1
            if len(self.r.writer_error_samples) < self.MAX_SAMPLES:
                self.r.writer_error_samples.append(f"line {self.line}: {rec['proc']} {f} "
                                                   f"ledger {rec.get('ledger_id')}: {rec.get('error')}")

    def fault_ok(self, rec: dict[str, Any]) -> None:
        if rec.get("phase") == "heal" and self.r.fault_steps and self.r.fault_steps[-1]["step"] == rec.get("step"):
            self.r.fault_steps[-1]["healed_s"] = rec["t"]

    HANDLERS = {("add", "ok"): add_ok, ("create", "ok"): create_ok, ("close", "ok"): end_fixed,
                ("recover", "ok"): end_fixed, ("read", "ok"): read_ok, ("lac", "ok"): lac_ok,
                ("recover", "fail"): recover_fail, ("read", "fail"): read_fail, ("append", "ok"): append_ok,
                ("stream_read", "ok"): stream_read_ok, ("fault", "fail"): fault_fail,
                ("fault", "ok"): fault_ok}

    # -- at the end ------------------------------------------------------------------
    def finish(self) -> VerifyReport:
        for ledger, acked in self.acked.items():
            if ledger in self.final_ledgers:
                self.lost_in(ledger, acked)
            else:
                self.r.unchecked.append(f"ledger {ledger}: {len(acked)} acknowledged, never read back")
        for ledger, (last, line) in self.max_read.items():
            end = self.ends.get(ledger)
            if end is not None and last > end[0]:
                self.anomaly("divergent", ledger, last, f"read, past the ledger's recovered end {end[0]}", line)
        unread: dict[str, int] = defaultdict(int)
        for (stream, txid), line in self.appends_acked.items():
            if stream not in self.final_streams:
                unread[stream] += 1
            elif (stream, txid) not in self.final_txids:
                self.anomaly("lost", None, None, f"stream {stream} txid {txid}: acknowledged, not read back", line)
        self.r.unchecked += [f"stream {stream}: {n} acknowledged, never read back" for stream, n in unread.items()]
        self.stalls_at_the_end()
        self.stall_per_step()
        self.r.ledgers = len(self.ledgers)
        self.r.anomalies.sort(key=lambda a: a.line)
        return self.r

    def stalls_at_the_end(self) -> None:
        """A writer still waiting when the history ends stalled until then (no completion closes
        its wait: a writer given up on at the end records none)."""
        for proc, n in self.outstanding.items():
            if n > 0 and proc in self.since:
                since = self.since[proc]
                if self.last_t - since > STALL_NOTED_S:
                    self.stalls.append((since, self.last_t))
                if self.last_t - since > self.r.longest_stall_s:
                    self.r.longest_stall_s = self.last_t - since
                    self.r.longest_stall_proc, self.r.longest_stall_from_s = proc, since

    def stall_per_step(self) -> None:
        """Each fault step's longest stall: of the waits that overlapped it (inject to heal)."""
        for step in self.r.fault_steps:
            start, end = step["inject_s"], step["healed_s"]
            end = end if end is not None else float("inf")
            step["longest_stall_s"] = round(max((b - a for a, b in self.stalls if a <= end and b >= start),
                                                default=0.0), 3)

    def lost_in(self, ledger: int, acked: dict[int, int]) -> None:
        read_ids = self.final_read.get(ledger)
        end = self.ends.get(ledger)
        why = self.final_failed.get(ledger)
        for entry, line in sorted(acked.items()):
            if read_ids is not None and entry in read_ids:
                continue
            where = _where(entry, read_ids) if read_ids else "whole ledger"  # nothing of it read back
            if end is not None and entry > end[0]:
                detail = f"{where}: acknowledged, past the recovered end {end[0]}"
            elif why is not None:
                detail = f"{where}: acknowledged, not read back ({why})"
            else:
                detail = f"{where}: acknowledged, not read back after recovery"
            self.anomaly("lost", ledger, entry, detail, line)


class HistoryRecordError(ValueError):
    """A record without a key its kind needs."""


def check_history(records: Iterable[dict[str, Any]]) -> VerifyReport:
    """Check a history (records in file order) and return what it shows; HistoryRecordError
    names the line of a record that lacks a key its kind needs."""
    checker = _Checker()
    feed = checker.feed
    try:
        for rec in records:
            feed(rec)
    except (KeyError, TypeError) as e:
        raise HistoryRecordError(f"line {checker.line}: not a history record ({type(e).__name__}: {e})") from None
    return checker.finish()
