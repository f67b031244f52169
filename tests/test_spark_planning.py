"""The Spark source without Spark: the ledgers option, entry-range splitting and ordering, option
validation, chunk sizes, and that `import bookkeeper` never imports pyspark.

Reference: issue 12 (partitions of at most max_entries_per_partition, bounded memory per
partition); docs/api.md section 7 (options).
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from bookkeeper import errors
from bookkeeper.meta.ledger_metadata import DigestType
from bookkeeper.spark.options import BATCH_BYTES, BATCH_ROWS_MAX, SourceOptions, chunk_entries
from bookkeeper.spark.planning import Bounds, LedgerRange, balance, parse_ledgers, split_ledger
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
    assert (o.password, o.include_open, o.digest, o.starting, o.ending) == (
        b"pw", True, DigestType.CRC32C, Position(2, 0, 5), "latest")
    bad = [({}, "metadata_uri"), ({"metadata_uri": "zk://h:1"}, "exactly one"),
           ({"metadata_uri": "zk://h:1", "ledgers": "1", "stream": "s"}, "exactly one"),
           ({"metadata_uri": "zk://h:1", "ledgers": "1", "digest": "md5"}, "digest"),
           ({"metadata_uri": "zk://h:1", "ledgers": "1", "include_open": "yes"}, "include_open"),
           ({"metadata_uri": "zk://h:1", "stream": "s", "maxRecordsPerTrigger": "-4"}, "maxRecordsPerTrigger"),
           ({"metadata_uri": "zk://h:1", "stream": "s", "startingOffsets": "soon"}, "SEQ:ENTRY:SLOT")]
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


def test_importing_bookkeeper_never_imports_pyspark() -> None:
    """The client, streams and the CLI load without pyspark; only bookkeeper.spark pulls it in."""
    code = ("import sys, bookkeeper, bookkeeper.sync, bookkeeper.stream, bookkeeper.cli.main; "
            "assert 'pyspark' not in sys.modules; import bookkeeper.spark; assert 'pyspark' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
