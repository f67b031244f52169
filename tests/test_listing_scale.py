"""Listings and scans paged (issue 26 part 4): `bk ledgers list` streams its ids bucket by bucket
and stops when it is told to (--limit) or nobody reads (`| head`); `bk bookies can-stop` reads
every ledger's metadata in one pipelined pass, not one round trip per ledger.

The cluster is private (2 bookies) and its ledgers are metadata only, written straight into
ZooKeeper in multi-ops: two full buckets (20,000 ids of 7 digits, 160 KB of output: more than
a pipe and stdout's buffer hold), then 40 buckets of 3, then 3 ids past 10^10 (the 19-digit
subtree). What `bk` asks ZooKeeper is counted in the `bk` process itself: DRIVER wraps the
real kazoo client's read methods to record each call, then runs `bk`'s main(); nothing is faked.

Reference: docs/operations.md "Listings and scans at scale"; docs/api.md 11.5.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from bookkeeper.meta.ledger_metadata import DigestType, LedgerMetadata, LedgerState, password_digest
from bookkeeper.meta.zk import ledger_path, parse_metadata_uri
from bookkeeper.testing.cluster import LocalCluster
from tests.test_cli import CLI_TIMEOUT_S, REPO, Result, _bk_env, assert_ok, assert_one_line_error

pytestmark = [pytest.mark.cluster, pytest.mark.runtime(40)]

FULL = list(range(1_000_000, 1_020_000))  # buckets 00/0100 and 00/0101, full
SPARSE = [b * 10_000 + k for b in range(200, 240) for k in (1, 5, 9)]  # 40 buckets of 3
HIGH = [10**10 + 7, 10**10 + 8, 3 * 10**12 + 1]  # the 19-digit subtree
IDS = FULL + SPARSE + HIGH
OPEN_ENSEMBLE = {2_000_005: 1, 10**10 + 7: 2}  # the open ledgers and their ensembles; the rest are closed
MULTI_OPS = 500  # creates per ZooKeeper multi-op (a request stays well under jute.maxbuffer)

# Records every read the `bk` process sends (kazoo's sync calls go through the *_async ones, so
# the async names count requests and the sync names count requests a caller waited for alone)
# in the file named by argv[1], then runs `bk` with the rest of argv.
DRIVER = """
import json, sys
from kazoo.client import KazooClient
calls = []
def counted(name):
    method = getattr(KazooClient, name)
    def call(self, path, *args, **kwargs):
        calls.append((name, path))
        return method(self, path, *args, **kwargs)
    setattr(KazooClient, name, call)
for name in ("get", "get_children", "exists", "get_async", "get_children_async", "exists_async"):
    counted(name)
from bookkeeper.cli.main import main
try:
    rc = main(sys.argv[2:])
finally:
    with open(sys.argv[1], "w") as f:
        json.dump(calls, f)
sys.exit(rc)
"""
BUCKET = re.compile(r"/ledgers/(\d{2}/\d{4}|\d{3}/\d{4}/\d{4}/\d{4})$")
LEDGER = re.compile(r"/ledgers/(\d{2}/\d{4}|\d{3}/\d{4}/\d{4}/\d{4})/L\d{4}$")


@dataclass
class Counted:
    result: Result
    calls: list[tuple[str, str]]

    def count(self, names: tuple[str, ...], path: re.Pattern[str]) -> int:
        return sum(1 for name, p in self.calls if name in names and path.search(p))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("listing"), bookies=2, shards=1)
    c.start()
    try:
        _write_metadata(c)
        yield c
    finally:
        c.stop()


def _write_metadata(cluster: LocalCluster) -> None:
    """IDS as closed, empty ledgers on the cluster's two bookies (those in OPEN_ENSEMBLE open)."""
    hosts, root = parse_metadata_uri(cluster.metadata_uri)
    bookies = [b.bookie_id for b in cluster.bookies]
    digest = password_digest(b"")
    zk = KazooClient(hosts=hosts)
    zk.start()
    try:
        for bucket in sorted({ledger_path(root, lid).rsplit("/", 1)[0] for lid in IDS}):
            zk.ensure_path(bucket)
        for first in range(0, len(IDS), MULTI_OPS):
            tx = zk.transaction()
            for lid in IDS[first:first + MULTI_OPS]:
                size = OPEN_ENSEMBLE.get(lid, 2)
                md = LedgerMetadata(ledger_id=lid, ensemble_size=size, write_quorum=size, ack_quorum=size,
                                    digest=DigestType.CRC32C, password_digest=digest, ensembles={0: bookies[:size]},
                                    state=LedgerState.OPEN if lid in OPEN_ENSEMBLE else LedgerState.CLOSED)
                tx.create(ledger_path(root, lid), md.serialize())
            assert not [r for r in tx.commit() if isinstance(r, Exception)]
    finally:
        zk.stop()
        zk.close()


def bk(*args: str, uri: str) -> Result:
    p = subprocess.run([sys.executable, "-m", "bookkeeper.cli.main", *args, "--metadata-uri", uri], cwd=REPO,
                       env=_bk_env(), stdin=subprocess.DEVNULL, capture_output=True, timeout=CLI_TIMEOUT_S)
    return Result(p.returncode, p.stdout, p.stderr)


def bk_counted(tmp_path: Path, *args: str, uri: str, pipe_to: str | None = None) -> Counted:
    """`bk ARGS` through DRIVER (through `| PIPE_TO` in a shell when given: the result is then
    that command's output, and bk's exit status is the last line of its stderr)."""
    calls_file, driver = tmp_path / "calls.json", tmp_path / "driver.py"
    driver.write_text(DRIVER)
    argv = [sys.executable, str(driver), str(calls_file), *args, "--metadata-uri", uri]
    if pipe_to is None:
        p = subprocess.run(argv, cwd=REPO, env=_bk_env(), stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=CLI_TIMEOUT_S)
    else:
        script = " ".join(map(_quote, argv)) + f" | {pipe_to}; echo ${{PIPESTATUS[0]}} >&2"
        p = subprocess.run(["bash", "-c", script], cwd=REPO, env=_bk_env(), stdin=subprocess.DEVNULL,
                           capture_output=True, timeout=CLI_TIMEOUT_S)
    return Counted(Result(p.returncode, p.stdout, p.stderr), [tuple(c) for c in json.loads(calls_file.read_text())])


def _quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\\''") + "'"


def test_ledgers_list_prints_every_id_in_order_across_both_subtrees(cluster: LocalCluster) -> None:
    """Without options: every id once, ascending, the 19-digit subtree's after the 10-digit one's."""
    r = bk("ledgers", "list", uri=cluster.metadata_uri)
    assert_ok(r)
    assert [int(line) for line in r.out.split()] == IDS


def test_ledgers_list_limit_from_count_and_json(cluster: LocalCluster) -> None:
    """--limit N prints the first N; --from ID starts at the first id >= ID (in a bucket, between
    buckets, past the 10-digit subtree, past every id); --count prints only the number (after
    --from and --limit); --json is one JSON array of the same ids (`[]` when empty)."""
    uri = cluster.metadata_uri
    for args, want in ((["--limit", "7"], IDS[:7]),
                       (["--limit", "0"], []),
                       (["--from", "1019998", "--limit", "4"], [1019998, 1019999, 2000001, 2000005]),
                       (["--from", "1020000", "--limit", "2"], [2000001, 2000005]),
                       (["--from", "2390006"], [2390009, *HIGH]),
                       (["--from", str(10**10)], HIGH),
                       (["--from", str(10**10 + 8)], HIGH[1:]),
                       (["--from", str(10**13)], [])):
        r = bk("ledgers", "list", *args, uri=uri)
        assert_ok(r)
        assert [int(line) for line in r.out.split()] == want, args
        r = bk("ledgers", "list", *args, "--json", uri=uri)
        assert_ok(r)
        assert json.loads(r.out) == want, args
        r = bk("ledgers", "list", *args, "--count", uri=uri)
        assert_ok(r)
        assert r.out == f"{len(want)}\n", args
    r = bk("ledgers", "list", "--json", uri=uri)
    assert json.loads(r.out) == IDS
    assert r.out.startswith("[\n1000000,\n1000001,\n"), r.out[:40]


@pytest.mark.parametrize("args", [["--limit", "-1"], ["--from", "-5"]])
def test_ledgers_list_negative_numbers_are_one_line_usage_errors(cluster: LocalCluster, args: list[str]) -> None:
    r = bk("ledgers", "list", *args, uri=cluster.metadata_uri)
    line = assert_one_line_error(r, mentions=args[0])
    assert r.returncode == 2, line


def test_ledgers_list_limit_reads_only_the_buckets_it_prints(cluster: LocalCluster, tmp_path: Path) -> None:
    """--limit 3 lists the first bucket (and at most one more), never the 42 others; --from
    skips the buckets below it without listing them."""
    got = bk_counted(tmp_path, "ledgers", "list", "--limit", "3", uri=cluster.metadata_uri)
    assert_ok(got.result)
    assert got.result.out.split() == [str(i) for i in IDS[:3]]
    assert got.count(("get_children",), BUCKET) <= 2, got.calls
    got = bk_counted(tmp_path, "ledgers", "list", "--from", str(2_390_000), "--limit", "1", uri=cluster.metadata_uri)
    assert got.result.out.split() == ["2390001"]
    assert got.count(("get_children",), BUCKET) <= 2, got.calls


def test_ledgers_list_into_head_stops_listing_and_exits_quietly(cluster: LocalCluster, tmp_path: Path) -> None:
    """`bk ledgers list | head -n 3`: head prints the first three ids; bk stops at the broken
    pipe (exit 141, nothing on stderr), and the buckets after the two it was printing are never
    listed: the ids are written as they are listed, not gathered first."""
    got = bk_counted(tmp_path, "ledgers", "list", uri=cluster.metadata_uri, pipe_to="head -n 3")
    assert got.result.returncode == 0, str(got.result)
    assert got.result.out.split() == [str(i) for i in IDS[:3]]
    assert got.result.err.splitlines() == ["141"], got.result.err
    assert got.count(("get_children",), BUCKET) <= 3, got.calls


def test_can_stop_reads_every_ledger_in_pipelined_batches(cluster: LocalCluster, tmp_path: Path) -> None:
    """`bk bookies can-stop` finds the largest open ensemble (2, past 10^10, after 20,000 closed
    ledgers) and refuses to stop one of two bookies, exit 1. Its ZooKeeper reads: one per
    ledger and one per bucket, and the reads it waits for one by one (a round trip each) are
    the bucket listings and a few more, not one per ledger."""
    victim = cluster.bookies[0].bookie_id
    got = bk_counted(tmp_path, "bookies", "can-stop", victim, "--json", uri=cluster.metadata_uri)
    assert got.result.returncode == 1, str(got.result)
    answer = json.loads(got.result.out)
    assert (answer["can_stop"], answer["other_writable"], answer["largest_open_ensemble"]) == (False, 1, 2), answer
    assert "2 needed" in got.result.err, got.result.err
    assert got.count(("get_async",), LEDGER) == len(IDS)
    buckets = len({ledger_path("/ledgers", lid).rsplit("/", 1)[0] for lid in IDS})
    assert got.count(("get_children",), BUCKET) == buckets
    alone = got.count(("get", "get_children", "exists"), re.compile(""))
    assert alone <= buckets + 30, f"{alone} reads waited for one at a time over {len(IDS)} ledgers"
