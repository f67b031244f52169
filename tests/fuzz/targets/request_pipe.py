"""The client's response pipe (RequestPipe in ext/bookkeeper/_ext/client.pyx): a receive
buffer of answers to the requests of one shard connection.

Ten requests are outstanding when the input arrives: reads 1..8 (two of them borrowing their
payload) and the adds of entries 0 and 1 (ids 9, 10) of a write handle, whose OK answers the
pipe counts in C (AckSink, AddTracker: E = Qw = Qa = 1). Properties: feed() either
dispatches every complete response or raises FrameError; each request's callback runs at
most once, with the response of its own id or an error; a borrowed payload is a view
released after its callback; entries are acknowledged in order (the tracker's LAC is -1, 0
or 1, and 1 only once entry 0 was); the same bytes fed in two pieces dispatch the same
responses and acknowledge the same entries. Anything else (another exception, a callback
error the pipe logged, an over-read under ASan) is a crash.
"""
from __future__ import annotations

import logging
from typing import Any

from bookkeeper._ext.client import AckSink, AddTracker, RequestPipe
from bookkeeper.client.bookie_client import bookie_reason
from bookkeeper.errors import BKError, error_for_status
from bookkeeper.proto import NO_KEY, FrameError, Op

from ._frames import KEY, LEDGER, response_seeds

MAX_FRAME = 1 << 16
REQUESTS = 8
BORROWING = {2, 5}
BOOKIE = "127.0.0.1:3181"


class _LoggedErrors(logging.Handler):
    """The pipe logs, and swallows, exceptions from callbacks: here each one is a finding."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


_LOGGED = _LoggedErrors()


def _error_for(status: int, payload: Any = b"") -> BKError:
    """As the client's connection makes it: the bookie's reason from the answer's payload."""
    return error_for_status(status, f"bookie fuzz: {bookie_reason(status, payload)}")


def _dispatched(chunks: list[bytes]) -> tuple[list[tuple[Any, ...]], bool]:
    """(request id, status, payload bytes or error class) per callback, then the write handle's
    LAC and failed entries, and whether a bad frame ended the feed."""
    seen: list[tuple[Any, ...]] = []
    tracker = AddTracker(ensemble_size=1, write_quorum=1, ack_quorum=1)
    failed: list[int] = []
    sink = AckSink(tracker, set(), lambda ctx, resp, err: failed.append(ctx[0]), lambda: None)

    def callback(ctx: int, resp: tuple | None, err: BaseException | None) -> None:
        assert resp is not None, "a callback without a response while the connection is up"
        assert resp[2] == ctx, f"request {ctx} got the response of request {resp[2]}"
        assert (err is None) == (resp[1] == 0), f"status {resp[1]} with error {err!r}"
        assert err is None or isinstance(err, BKError)
        payload = resp[6]
        assert isinstance(payload, memoryview if ctx in BORROWING and payload else bytes), type(payload)
        seen.append((ctx, resp[1], bytes(payload), type(err)))

    pipe = RequestPipe(MAX_FRAME, _error_for, lambda: None, lambda: None)
    for rid in range(1, REQUESTS + 1):
        pipe.send(Op.READ_ENTRY, 0, LEDGER, rid, NO_KEY, 0, b"", callback, rid, 60.0, rid in BORROWING)
    for entry_id in (0, 1):
        tracker.add(entry_id, 10, None, None, [BOOKIE])
        pipe.send(Op.ADD_ENTRY, 0, LEDGER, entry_id, KEY, 0, b"", sink, (entry_id, 0, BOOKIE), 60.0)
    bad = False
    try:
        for chunk in chunks:
            pipe.feed(chunk)
    except FrameError:
        bad = True
    acked = tracker.lac + 1
    assert -1 <= tracker.lac <= 1 and len(set(failed)) == len(failed), f"LAC {tracker.lac}, failed {failed}"
    assert not set(failed) & set(range(acked)), f"entries {failed} failed and acknowledged"
    reads_left = pipe.outstanding - (2 - acked - len(failed))
    assert reads_left == REQUESTS - len(seen) or (acked == 0 and reads_left == REQUESTS - len(seen) - 1), \
        "a request answered without its callback"
    assert len({s[0] for s in seen}) == len(seen), "a callback ran twice"
    return seen + [("lac", tracker.lac, tuple(failed))], bad


def one_input(data: bytes) -> None:
    del _LOGGED.records[:]
    logger = logging.getLogger("bookkeeper.client")
    logger.addHandler(_LOGGED)
    split = data[0] % (len(data) + 1) if data else 0
    try:
        whole, bad = _dispatched([data])
        chunked, chunked_bad = _dispatched([data[:split], data[split:]])
    finally:
        logger.removeHandler(_LOGGED)
    assert not _LOGGED.records, _LOGGED.records[0].getMessage() if _LOGGED.records else ""
    assert chunked_bad == bad, f"split at {split}: bad frame {chunked_bad}, whole: {bad}"
    if not bad:
        assert chunked == whole, f"split at {split} dispatches differently"
    for rid, status, *_ in whole:  # feedback for atheris: which answers arrived
        if status == 0:
            if rid in BORROWING:
                pass
        elif status < 4:
            pass


def seeds() -> list[bytes]:
    return response_seeds()
