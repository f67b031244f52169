"""The Spark source without Spark: the ledgers option, entry-range splitting and ordering, option
validation, chunk sizes, which ledgers skipUnreadable skips, the data-loss decisions of
failOnDataLoss, and that `import bookkeeper` never imports pyspark.

Reference: issue 12 (partitions of at most max_entries_per_partition, bounded memory per
partition); issue 22 item 5 (failOnDataLoss, as Kafka's source); issue 27 item 5
(skipUnreadable); docs/api.md section 7 (options).
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from bookkeeper import errors
from bookkeeper.meta.ledger_metadata import DigestType
from bookkeeper.spark.options import BATCH_BYTES, BATCH_ROWS_MAX, SourceOptions, chunk_entries
from bookkeeper.meta.streams import Segment
from bookkeeper.spark.planning import (SKIPPED_NAMED_MAX, Access, Bounds, Gap, LedgerRange, Verdict, balance,
                                       decide_access, describe_gap, describe_skipped, find_gap, judge, parse_ledgers,
                                       split_ledger)
from bookkeeper.stream import Position


@pytest.mark.parametrize("text,singles,ranges", [
    ("7", (7,), ()),
    ("1,2,10-20", (1, 2), ((10, 20),)),
    (" 3 , 5-5 ", (3,), ((5, 5),)),
    ("0-0,9", (9,), ((0, 0),)),
])
def test_ledgers_option_parses_ids_and_inclusive_ranges(text, singles, ranges) -> None:
    """Ids are singles (must exist), A-B are inclusive ranges (absent ids skipped)."""
    spec = parse_ledgers(text)
    assert (spec.singles, spec.ranges) == (singles, ranges)


@pytest.mark.parametrize("text", ["", "a", "1,,2", "5-3", "-1", "1-", "1-2-3", "1.5"])
def test_bad_ledgers_option_is_refused(text: str) -> None:
    """Anything but ids and A-B ranges (A <= B) is a ConfigError quoting the bad item."""
    with pytest.raises(errors.ConfigError, match="ledgers"):
        parse_ledgers(text)


@pytest.mark.parametrize("last,max_entries,expected", [
    (-1, 10, []),                                   # an empty ledger: no partition
    (0, 10, [(0, 0)]),
    (9, 10, [(0, 9)]),
    (10, 10, [(0, 5), (6, 10)]),                    # 11 entries: two ranges within one of each other
    (99_999, 30_000, [(0, 24_999), (25_000, 49_999), (50_000, 74_999), (75_000, 99_999)]),
    (6, 3, [(0, 2), (3, 4), (5, 6)]),
])
def test_split_ledger_into_balanced_ranges(last, max_entries, expected) -> None:
    """ceil(n / max) ranges covering 0..last exactly, none above max, sizes within one."""
    ranges = split_ledger(5, last, 1000 * (last + 1), max_entries)
    assert [(r.first, r.last) for r in ranges] == expected
    assert sum(r.planned_bytes for r in ranges) <= 1000 * (last + 1)
    assert all(r.last - r.first + 1 <= max_entries for r in ranges)


@pytest.mark.parametrize("filters,box", [
    ([], (0, 2**63 - 1, 0, 2**63 - 1)),
    ([("ledger_id", "=", 7)], (7, 7, 0, 2**63 - 1)),
    ([("entry_id", ">", 10), ("entry_id", "<=", 20)], (0, 2**63 - 1, 11, 20)),
    ([("entry_id", ">=", 10), ("entry_id", "<", 10)], (0, 2**63 - 1, 10, 9)),       # empty
    ([("ledger_id", ">=", 3), ("ledger_id", "<", 9), ("ledger_id", "=", 5)], (5, 5, 0, 2**63 - 1)),
])
def test_pushed_filters_narrow_to_a_box(filters, box) -> None:
    """Comparisons on ledger_id / entry_id intersect into inclusive bounds."""
    b = Bounds()
    for column, op, value in filters:
        b = b.narrow(column, op, value)
    assert (b.ledger_lo, b.ledger_hi, b.entry_lo, b.entry_hi) == box


def test_split_clips_to_entry_bounds_exactly() -> None:
    """Entry bounds clip the ledger before it is split: the ranges cover exactly the bounded entries."""
    ranges = split_ledger(1, 99_999, 10**7, 30_000, bounds=Bounds().narrow("entry_id", ">=", 500)
                          .narrow("entry_id", "<", 40_000))
    assert [(r.first, r.last) for r in ranges] == [(500, 20_249), (20_250, 39_999)]
    assert split_ledger(1, 99, 100, 10, bounds=Bounds().narrow("entry_id", ">", 500)) == []


def test_balance_puts_the_largest_partitions_first() -> None:
    """Largest planned bytes first (ties by ledger and entry), so big tasks start early."""
    rs = [LedgerRange(1, 0, 9, 10), LedgerRange(2, 0, 9, 500), LedgerRange(3, 0, 9, 500), LedgerRange(4, 0, 9, 99)]
    assert [r.ledger_id for r in balance(rs)] == [2, 3, 4, 1]


def test_options_parse_and_validate() -> None:
    """Defaults, case-insensitive keys, positions, and one error per bad option naming it."""
    o = SourceOptions.parse({"metadata_uri": "zk://h:1/l", "ledgers": "1-3", "PASSWORD": "pw",
                             "include_open": "TRUE", "startingOffsets": "2:0:5"})
    assert (o.password, o.include_open, o.digest, o.starting, o.ending, o.fail_on_data_loss) == (
        b"pw", True, DigestType.CRC32C, Position(2, 0, 5), "latest", True)
    assert not SourceOptions.parse({"metadata_uri": "zk://h:1", "stream": "s", "FAILONDATALOSS": " False"}) \
        .fail_on_data_loss
    assert not o.skip_unreadable
    assert SourceOptions.parse({"metadata_uri": "zk://h:1", "ledgers": "1-9", "skipUnreadable": "True "}) \
        .skip_unreadable
    bad = [({}, "metadata_uri"), ({"metadata_uri": "zk://h:1"}, "exactly one"),
           ({"metadata_uri": "zk://h:1", "ledgers": "1", "stream": "s"}, "exactly one"),
           ({"metadata_uri": "zk://h:1", "ledgers": "1", "digest": "md5"}, "digest"),
           ({"metadata_uri": "zk://h:1", "ledgers": "1", "include_open": "yes"}, "include_open"),
           ({"metadata_uri": "zk://h:1", "stream": "s", "maxRecordsPerTrigger": "-4"}, "maxRecordsPerTrigger"),
           ({"metadata_uri": "zk://h:1", "stream": "s", "startingOffsets": "soon"}, "SEQ:ENTRY:SLOT"),
           ({"metadata_uri": "zk://h:1", "stream": "s", "failOnDataLoss": "no"},
            "option failOnDataLoss must be true or false, not 'no'"),
           ({"metadata_uri": "zk://h:1", "ledgers": "1-9", "skipunreadable": "1"},
            "option skipUnreadable must be true or false, not '1'")]
    for options, mentions in bad:
        with pytest.raises(errors.BKError, match=mentions):
            SourceOptions.parse(options)


@pytest.mark.parametrize("planned,entries", [(0, 1), (100 * 100_000, 100_000), (65536 * 1000, 1000),
                                              (10 << 30, 1), (4096 * 30_000, 30_000)])
def test_chunks_bound_a_partition_readers_memory(planned: int, entries: int) -> None:
    """A range read holds about BATCH_BYTES of payload (at least one entry, at most BATCH_ROWS_MAX rows)."""
    n = chunk_entries(planned, entries)
    per_entry = max(1, planned // entries)
    assert 1 <= n <= BATCH_ROWS_MAX and (n == 1 or n * per_entry <= BATCH_BYTES)


@pytest.mark.parametrize("unreadable,named,skip_unreadable,access", [
    (False, False, False, Access.READ),
    (False, False, True, Access.READ),
    (False, True, False, Access.READ),
    (False, True, True, Access.READ),
    (True, True, False, Access.FAIL),    # named by its id: the user asked for it
    (True, True, True, Access.FAIL),
    (True, False, False, Access.FAIL),   # caught by a range, without the option: as before it
    (True, False, True, Access.SKIP),
])
def test_decide_access_is_its_docstring_table(unreadable: bool, named: bool, skip_unreadable: bool,
                                              access: Access) -> None:
    """Every combination of planning.decide_access's inputs, row by row of its table: only a
    ledger a range caught is ever skipped, and only with skipUnreadable."""
    assert decide_access(unreadable=unreadable, named=named, skip_unreadable=skip_unreadable) is access


def test_describe_skipped_counts_and_names_the_first_few() -> None:
    """One line: how many of the ledgers looked at, each named with why, the first
    SKIPPED_NAMED_MAX only (a range over a busy cluster may skip thousands)."""
    head = "skipped {} of {} ledgers that cannot be opened with this read's password and digest (skipUnreadable=true): "
    assert describe_skipped([(4, "wrong password"), (9, "digest mac, not crc32c")], 12) == \
        head.format(2, 12) + "4 (wrong password), 9 (digest mac, not crc32c)"
    many = [(lid, "wrong password") for lid in range(SKIPPED_NAMED_MAX + 3)]
    assert describe_skipped(many, 100) == head.format(SKIPPED_NAMED_MAX + 3, 100) + ", ".join(
        f"{lid} (wrong password)" for lid in range(SKIPPED_NAMED_MAX)) + " and 3 more"
    exactly = many[:SKIPPED_NAMED_MAX]
    assert describe_skipped(exactly, 50).endswith(f"{SKIPPED_NAMED_MAX - 1} (wrong password)")


def _seg(seq: int, state: str = "closed", records: int = 10, last_entry: int = 4) -> Segment:
    return Segment(seq=seq, ledger_id=100 + seq, state=state, records=records, last_entry=last_entry)


P = Position


@pytest.mark.parametrize("start,segments,next_seq,gap", [
    # start's segment survives, or is not made yet: nothing jumped over
    (P(2, 3, 1), [_seg(2), _seg(3, "open")], 4, None),
    (P(4, 0, 0), [_seg(2), _seg(3)], 4, None),
    # a hole above a survivor: an empty segment a writer retired, never retention's
    (P(3, 0, 0), [_seg(2), _seg(4)], 5, None),
    (P(4, 0, 0), [_seg(2)], 5, None),
    # the oldest segments removed under the start: their nodes are gone with their figures
    (P(1, 0, 5), [_seg(3), _seg(4, "open")], 5, Gap(P(1, 0, 5), P(3, 0, 0), (1, 2), (), 3)),
    (P(2, 0, 0), [_seg(3)], 4, Gap(P(2, 0, 0), P(3, 0, 0), (2,), (), 3)),
    # no survivor at all: resume where the next segment will start
    (P(2, 1, 0), [], 4, Gap(P(2, 1, 0), P(4, 0, 0), (2, 3), (), None)),
    # nodes still marked truncated (a deletion under way) name their ledgers, and show what
    # held nothing from the start: a start past a segment's end, an empty segment
    (P(1, 0, 0), [_seg(1, "truncated"), _seg(2, "truncated"), _seg(3)], 4,
     Gap(P(1, 0, 0), P(3, 0, 0), (1, 2), (101, 102), 3)),
    (P(1, 5, 0), [_seg(1, "truncated"), _seg(2, "truncated", records=0, last_entry=-1), _seg(3)], 4, None),
    (P(1, 5, 0), [_seg(1, "truncated"), _seg(3)], 4, Gap(P(1, 5, 0), P(3, 0, 0), (2,), (), 3)),
    (P(1, 4, 2), [_seg(1, "truncated"), _seg(3)], 4, Gap(P(1, 4, 2), P(3, 0, 0), (1, 2), (101,), 3)),
])
def test_find_gap_names_the_removed_segments_a_start_jumps_over(start, segments, next_seq, gap) -> None:
    """Retention and truncation remove a stream's oldest segments only: a start below every
    survivor, in a removed segment, jumps a gap; a hole above a survivor is an empty segment."""
    assert find_gap(start, segments, next_seq) == gap


GAP = Gap(P(1, 0, 5), P(3, 0, 0), (1, 2), (), 3)
TAIL = Gap(P(2, 1, 0), P(4, 0, 0), (2, 3), (), None)


@pytest.mark.parametrize("gap,after,first,verdict", [
    (None, None, None, Verdict.NONE),
    (GAP, None, 20, Verdict.LOST),       # a start without its txid (a position given by the user)
    (TAIL, 4, None, Verdict.LOST),       # no survivor past the gap
    (GAP, 4, None, Verdict.WAIT),        # the survivor holds no record yet
    (GAP, 19, 20, Verdict.NONE),         # the next txid follows the last read: nothing between
    (GAP, 4, 20, Verdict.LOST),
    (GAP, 30, 0, Verdict.LOST),          # txids started again: what lay between is unknown
])
def test_judge_is_its_docstring_table(gap, after, first, verdict) -> None:
    """The verdict table of planning.judge, row by row."""
    assert judge(gap, after, first) is verdict


def test_describe_gap_says_the_range_and_what_is_known_of_it() -> None:
    """Positions always; segments as a run or a list; ledger ids while known; txids when both ends are."""
    assert describe_gap(GAP, 4, 20) == "positions 1:0:5 up to 3:0:0 (segments 1..2; txids 5..19)"
    assert describe_gap(GAP, None, 20) == "positions 1:0:5 up to 3:0:0 (segments 1..2)"
    marked = Gap(P(1, 0, 0), P(5, 0, 0), (1, 3), (101, 103), 5)
    assert describe_gap(marked, None, None) == "positions 1:0:0 up to 5:0:0 (segments 1, 3, ledgers 101, 103)"
    one = Gap(P(2, 0, 0), P(3, 0, 0), (2,), (102,), 3)
    assert describe_gap(one, 7, 8) == "positions 2:0:0 up to 3:0:0 (segment 2, ledger 102)"


def test_importing_bookkeeper_never_imports_pyspark() -> None:
    """The client, streams and the CLI load without pyspark; only bookkeeper.spark pulls it in."""
    code = ("import sys, bookkeeper, bookkeeper.sync, bookkeeper.stream, bookkeeper.cli.main; "
            "assert 'pyspark' not in sys.modules; import bookkeeper.spark; assert 'pyspark' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
