"""The JSONL history of a `bk verify` run: one line per invocation and per completion.

Why a history and not in-run assertions: as in Jepsen, the workload only records what it
asked for and what it was told; a pure checker (checker.py) decides afterwards, so the same
file can be checked again offline (`bk verify check FILE`) and a checker fix re-judges old runs.

Schema (version 1; every line one JSON object; keys absent when they do not apply):

| key | meaning |
|---|---|
| `i` | sequence number, 0, 1, 2, ... in file order |
| `t` | seconds since the run started (monotonic clock) |
| `proc` | who: `w<n>` writer, `r<n>.<session>` tailing reader, `takeover`, `s<n>` stream writer, `sr<n>` stream reader, `final` (the closing read-back), `nemesis` (faults), `run` (start and end) |
| `type` | `invoke`, then one of `ok`, `fail` (it did not happen, or its outcome is unknown: the error says which), `info` (unknown: the run ended first) |
| `f` | `start`, `end`, `create`, `add`, `close`, `recover`, `read`, `lac`, `append`, `stream_read`, `fault` |
| `ledger_id`, `entry_id` | the ledger and entry (`read`: the first entry of `values`) |
| `value` | `add`/`append`: digest of the payload; `lac`: the LAC seen; `stream_read`: digest of the record |
| `values` | `read` ok: digests of entries `entry_id`, `entry_id + 1`, ... |
| `end` | `close`/`recover` ok: the ledger's last entry id (-1: empty) |
| `txid`, `position`, `stream` | `append` and `stream_read` |
| `error` | `fail`: `ErrorType: message` |
| `kind`, `phase`, `step`, `target` | `fault` (`phase` is `inject` or `heal`) |
| `nonce`, `seed`, `schema` | `start` |

Payloads are a pure function of (nonce, ledger, entry, writer) and digests are short
(blake2b, 6 bytes), so a reader recognises content without anyone storing it and the file
stays small. Lines are buffered and written in blocks; `close()` (also on Ctrl-C or an
exception, through the context manager) flushes the rest, so a finished run's file is whole.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from collections.abc import Callable
from typing import IO, Any

SCHEMA = 1
FLUSH_LINES = 4096  # lines buffered before a write: one write per few thousand operations
FLUSH_S = 1.0       # or this old: a file someone follows (tail -f) is never far behind
PAYLOAD_BYTES = 100  # an entry's size: small, so the bar of adds per run is about the protocol


def payload(nonce: str, ledger_id: int, entry_id: int, proc: str, size: int = PAYLOAD_BYTES) -> bytes:
    """The bytes `proc` writes as entry `entry_id` of `ledger_id` in the run `nonce`: distinct per
    entry and per run, so a stale or misplaced entry never passes for the right one."""
    head = b"%s:%d:%d:%s:" % (nonce.encode(), ledger_id, entry_id, proc.encode())
    return head + b"." * max(0, size - len(head))


def stream_payload(nonce: str, stream: str, txid: int, size: int = PAYLOAD_BYTES) -> bytes:
    """A stream record's bytes, distinct per (run, stream, txid)."""
    head = b"%s:%s:%d:" % (nonce.encode(), stream.encode(), txid)
    return head + b"." * max(0, size - len(head))


def digest(data: bytes) -> str:
    """The short digest a history holds instead of a payload."""
    return hashlib.blake2b(data, digest_size=6).hexdigest()


class History:
    """Appends records to a JSONL file (or, with no path, to `records` in memory: the suite's
    harness checks small runs without a file)."""

    def __init__(self, path: Path | None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._t0 = clock()
        self._seq = 0
        self._buf: list[str] = []
        self._flushed_s = 0.0
        self.records: list[dict[str, Any]] = []
        self._file: IO[str] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("w", encoding="utf-8")

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._t0

    def record(self, proc: str, type_: str, f: str, **fields: Any) -> None:
        """Append one record; `fields` whose value is None are left out."""
        now = self._clock() - self._t0
        rec: dict[str, Any] = {"i": self._seq, "t": round(now, 4), "proc": proc, "type": type_, "f": f}
        rec.update((k, v) for k, v in fields.items() if v is not None)
        self._seq += 1
        if self._file is None:
            self.records.append(rec)
            return
        self._buf.append(json.dumps(rec, separators=(",", ":")))
        if len(self._buf) >= FLUSH_LINES or now - self._flushed_s > FLUSH_S:
            self.flush()

    def flush(self) -> None:
        self._flushed_s = self._clock() - self._t0
        if self._file is not None and self._buf:
            self._file.write("\n".join(self._buf) + "\n")
            self._buf.clear()
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None


# How the record of an acknowledged add starts (History.record writes i, t, proc, type, f in
# that order, without spaces).
ACKNOWLEDGED_ADD = b'"type":"ok","f":"add"'


def has_acknowledged_add(path: Path) -> bool:
    """Whether a history being written already holds an acknowledged add (its run's load has
    begun): what a harness waits for before it injects a fault or signals the run. A partial
    last line is fine; a file not made yet is False."""
    try:
        return ACKNOWLEDGED_ADD in path.read_bytes()
    except FileNotFoundError:
        return False


class HistoryFormatError(ValueError):
    """A history line that is not a JSON object with the keys every record has."""


def read_history(path: Path, *, chunk_lines: int = 20_000) -> Iterator[dict[str, Any]]:
    """The records of a history file, in order (line n is record n - 1); a line that is not a
    JSON object raises HistoryFormatError naming it.

    Why in chunks: one json.loads of many lines joined as an array costs half of a call per
    line (the per-call overhead is most of a small record's decoding); a chunk that fails is
    decoded again line by line, to name the bad line."""
    with path.open(encoding="utf-8") as fh:
        first = 1
        while True:
            lines = [line for line in itertools.islice(fh, chunk_lines) if line.strip()]
            if not lines:
                return
            try:
                records = json.loads("[" + ",".join(lines) + "]")
            except json.JSONDecodeError:
                records = [_one(path, first + n, line) for n, line in enumerate(lines)]
            for n, rec in enumerate(records):
                if not isinstance(rec, dict):
                    raise HistoryFormatError(f"{path}:{first + n}: not a history record (a JSON object)")
                yield rec
            first += len(lines)


def _one(path: Path, n: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise HistoryFormatError(f"{path}:{n}: not JSON ({e.msg})") from None
