"""The write handle's batch and callback forms (add_entries, add_entries_async,
add_entry_callback) against in-process bookies that answer each add by a rule: ids, order,
failure semantics (a failed batch fails every entry from the first failed one on, exactly as
single adds do), bad input that sends nothing and the outstanding bound. The same forms on a
real cluster, with close(): tests/test_roundtrip.py."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest
import uvloop

from bookkeeper.client.bookie_client import _ShardProtocol
from bookkeeper.client.client import BookKeeper
from bookkeeper.client.ledger import WriteHandle
from bookkeeper.errors import LedgerFencedError, TooLargeError, TooManyOutstandingAddsError
from bookkeeper.meta.ledger_metadata import DigestType, LedgerMetadata, password_digest
from bookkeeper.proto import Op, Status, encode_responses, parse_requests


class RuleBookie(asyncio.Transport):
    """A bookie shard answering every ADD on the next loop turn with rule(entry_id), in one buffer."""

    def __init__(self, protocol: _ShardProtocol, rule: Callable[[int], int], sent: list[int]) -> None:
        super().__init__()
        self.protocol, self.rule, self.sent = protocol, rule, sent
        self.loop = asyncio.get_running_loop()

    def write(self, data: Any) -> None:
        frames, _ = parse_requests(data, 1 << 30)
        answers = []
        for f in frames:
            if f[0] == Op.ADD_ENTRY:
                self.sent.append(f[4])
                answers.append((f[0], self.rule(f[4]), f[2], f[3], f[4], -1, b""))
        self.loop.call_soon(self.protocol.feed, encode_responses(answers))

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def handle(rule: Callable[[int], int] = lambda e: Status.OK, *, quorum: tuple[int, int, int] = (1, 1, 1),
           **config: Any) -> tuple[WriteHandle, list[int]]:
    """An open write handle on `quorum` rule-answering bookies; the list records each ADD's entry id."""
    from bookkeeper.client.config import ClientConfig
    e, qw, qa = quorum
    bk = BookKeeper(store=None, config=ClientConfig(explicit_lac_interval_ms=0, **config))  # type: ignore[arg-type]
    ids = [f"rule-{i}:3181" for i in range(e)]
    bk._bookies = {b: {"shards": [{"host": b, "port": 3181}]} for b in ids}
    sent: list[int] = []
    for b in ids:
        conn = bk.pool.connection_to(b, 3181)
        protocol = _ShardProtocol(conn)
        transport = RuleBookie(protocol, rule, sent)
        protocol.connection_made(transport)
        conn.attach(transport)
    md = LedgerMetadata(ledger_id=1, ensemble_size=e, write_quorum=qw, ack_quorum=qa, digest=DigestType.CRC32C,
                        password_digest=password_digest(b""), ensembles={0: ids})
    return WriteHandle(bk, md, b""), sent


def run(main: Callable[[], Any]) -> None:
    uvloop.run(main())


def test_a_batch_gets_consecutive_ids_between_single_adds() -> None:
    async def main() -> None:
        h, sent = handle(quorum=(3, 2, 2))
        first = await h.add_entry(b"single")
        batch = await h.add_entries_async([b"a", bytearray(b"b"), memoryview(b"c")])
        after = await h.add_entry_async(b"again")
        assert (first, batch, after) == (0, [1, 2, 3], 4)
        assert h.last_add_confirmed == 4 and h.length == len(b"single") + 3 + len(b"again")
        assert sorted(sent) == sorted([e for e in range(5) for _ in range(2)])  # each to its 2-bookie write set
        assert await h.add_entries([]) == [] and await h.add_entries([b"x"] * 5) == [5, 6, 7, 8, 9]
    run(main)


@pytest.mark.parametrize("fail_at", [0, 3, 7])
def test_a_failed_batch_fails_from_the_first_failed_entry_on_like_single_adds(fail_at: int) -> None:
    """The bookie fences entry fail_at: the batch's error lists the ids acknowledged before it, and
    single adds in the same situation see exactly those succeed and the rest fail."""
    def rule(e: int) -> int:
        return Status.FENCED if e >= fail_at else Status.OK

    async def main() -> None:
        h, _ = handle(rule)
        with pytest.raises(LedgerFencedError) as caught:
            await h.add_entries_async([b"%d" % i for i in range(8)])
        assert caught.value.acknowledged == list(range(fail_at))  # type: ignore[attr-defined]
        assert h.last_add_confirmed == fail_at - 1
        with pytest.raises(LedgerFencedError):
            h.add_entries_async([b"later"])  # the handle stays failed

        single, _ = handle(rule)
        futs = [single.add_entry_async(b"%d" % i) for i in range(8)]
        outcomes = await asyncio.gather(*futs, return_exceptions=True)
        assert [o for o in outcomes if not isinstance(o, BaseException)] == list(range(fail_at))
        assert all(isinstance(o, LedgerFencedError) for o in outcomes[fail_at:])
    run(main)


def test_bad_entries_in_a_batch_send_nothing() -> None:
    async def main() -> None:
        h, sent = handle(max_outstanding_adds=10)
        with pytest.raises(TypeError, match="bytes"):
            h.add_entries_async([b"ok", "not bytes"])  # type: ignore[list-item]
        with pytest.raises(TooLargeError):
            h.add_entries_async([b"ok", bytes(6 << 20)])
        with pytest.raises(TooManyOutstandingAddsError):
            h.add_entries_async([b"x"] * 11)
        with pytest.raises(TooManyOutstandingAddsError, match="split it|exceeds"):
            await h.add_entries([b"x"] * 11)
        assert sent == [] and h.outstanding == 0
        assert await h.add_entry(b"first") == 0  # no id was used up
    run(main)


def test_add_entries_waits_for_room_at_the_outstanding_bound() -> None:
    """With 8 of 10 outstanding, a batch of 5 waits until 3 more are acknowledged, then goes."""
    async def main() -> None:
        h, _ = handle(max_outstanding_adds=10)
        singles = [h.add_entry_async(b"s") for _ in range(8)]
        batch = asyncio.ensure_future(h.add_entries([b"b"] * 5))
        assert await asyncio.gather(*singles) == list(range(8))
        assert await batch == [8, 9, 10, 11, 12]
    run(main)


def test_callbacks_run_in_id_order_and_then_report_the_failure(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        h, _ = handle()
        seen: list[tuple[int, Any]] = []
        for i in range(5):
            h.add_entry_callback(b"%d" % i, lambda e, err: seen.append((e, err)))
        h.add_entry_callback(b"boom", lambda e, err: 1 / 0)  # logged; later callbacks still run
        h.add_entry_callback(b"6", lambda e, err: seen.append((e, err)))
        while h.outstanding:
            await asyncio.sleep(0)
        assert seen == [(e, None) for e in range(5)] + [(6, None)] and h.last_add_confirmed == 6
        assert "add callback for entry 5 failed" in caplog.text

        failing, _ = handle(lambda e: Status.FENCED if e >= 2 else Status.OK)
        got: list[tuple[int, Any]] = []
        for i in range(4):
            failing.add_entry_callback(b"%d" % i, lambda e, err: got.append((e, type(err).__name__ if err else None)))
        while len(got) < 4:
            await asyncio.sleep(0)
        assert got == [(0, None), (1, None), (2, "LedgerFencedError"), (3, "LedgerFencedError")]
    with caplog.at_level(logging.ERROR, logger="bookkeeper.client.ledger"):
        run(main)
