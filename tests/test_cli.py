"""The `bk` command line against a real cluster, run as a subprocess (docs/api.md section 2).

Checked: simpletest, `bookies list --json`, `--metadata-uri` before / after the
sub-command and via BK_METADATA_URI, `ledger metadata` / `ledger read` / `ledgers list` /
`ledger delete` on a ledger written by the Python client, and the error contract:
one clear line on stderr, non-zero exit, no traceback, no log lines without -v.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bookkeeper import BookKeeper, DigestType
from bookkeeper.cli.main import build_parser
from bookkeeper.testing.cluster import LocalCluster
from tests.conftest import run

pytestmark = pytest.mark.runtime(45)

REPO = Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 60
# what a logging record looks like: a timestamp, or a level name as a word of its own
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d|\b(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")


@dataclass
class Result:
    returncode: int
    stdout: bytes
    stderr: bytes

    @property
    def out(self) -> str:
        return self.stdout.decode("utf-8")

    @property
    def err(self) -> str:
        return self.stderr.decode("utf-8", "replace")

    def __str__(self) -> str:
        return f"rc={self.returncode}\n--- stdout\n{self.out[:3000]}\n--- stderr\n{self.err[:3000]}"


def bk(*args: str, uri: str | None = None, env_uri: str | None = None) -> Result:
    """Run `bk ARGS...` (with `--metadata-uri uri` appended when given), as scripts do: no TTY, no COLUMNS."""
    env = {k: v for k, v in os.environ.items() if k not in ("BK_METADATA_URI", "COLUMNS", "LINES")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if env_uri is not None:
        env["BK_METADATA_URI"] = env_uri
    argv = [sys.executable, "-m", "bookkeeper.cli.main", *args]
    if uri is not None:
        argv += ["--metadata-uri", uri]
    p = subprocess.run(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                       timeout=CLI_TIMEOUT_S)
    return Result(p.returncode, p.stdout, p.stderr)


def assert_ok(r: Result) -> None:
    assert r.returncode == 0, str(r)
    assert "Traceback" not in r.err, str(r)
    logs = [line for line in r.err.splitlines() if LOG_LINE.search(line)]
    assert not logs, f"log lines on stderr without -v: {logs}"


def assert_one_line_error(r: Result, *, mentions: str | None = None) -> str:
    """Non-zero exit, exactly one non-empty line on stderr, no traceback; returns that line."""
    assert r.returncode != 0, str(r)
    assert "Traceback" not in r.err, str(r)
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{r.err}"
    if mentions is not None:
        assert mentions.lower() in lines[0].lower(), lines[0]
    return lines[0]


# -- a ledger written by the Python client --------------------------------------------
PAYLOADS = [
    b"hello, bookkeeper",
    b"\xff\xfe not utf-8 \x80\x81 end",        # invalid UTF-8 bytes
    "h\u00e9llo w\u00f6rld \u2713 \U0001f600".encode(),  # valid multi-byte UTF-8
    b"caf\xc3",                                   # truncated UTF-8 sequence
    b"tab\there and a NUL \x00 inside",
    b"",                                          # an empty entry
    b"line one\nline two\r\n",                    # line breaks: only checked through --json
    bytes(range(256)),
]
CUSTOM = {"app": b"cli-test", "blob": b"\x00\xff\xc3\x28"}


@dataclass
class Written:
    ledger_id: int
    ensemble: list[str]
    created_ms: int


@pytest.fixture(scope="module")
def ledger(cluster5: LocalCluster) -> Iterator[Written]:
    t0 = int(time.time() * 1000)

    async def write() -> Written:
        async with await BookKeeper.connect(cluster5.metadata_uri) as client:
            lh = await client.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, digest=DigestType.CRC32C,
                                            custom_metadata=CUSTOM)
            for p in PAYLOADS:
                await lh.add_entry(p)
            await lh.close()
            return Written(lh.ledger_id, list(lh.metadata.ensembles[0]), t0)
    w = run(write())
    yield w

    async def cleanup() -> None:
        async with await BookKeeper.connect(cluster5.metadata_uri) as client:
            if await client.metadata_call(client.store.ledger_exists, w.ledger_id):
                await client.delete_ledger(w.ledger_id)
    run(cleanup())


async def _ledger_ids(uri: str) -> set[int]:
    async with await BookKeeper.connect(uri) as client:
        return {lid async for lid in client.list_ledgers()}


# -- simpletest ---------------------------------------------------------------------
@pytest.mark.parametrize("args", [[], ["--ensemble", "5", "--write-quorum", "3", "--ack-quorum", "2",
                                       "--entries", "500"]], ids=["defaults", "5-3-2-500"])
def test_simpletest_exits_zero_and_leaves_no_ledger(cluster5: LocalCluster, args: list[str]) -> None:
    before = run(_ledger_ids(cluster5.metadata_uri))
    r = bk("simpletest", *args, uri=cluster5.metadata_uri)
    assert_ok(r)
    assert run(_ledger_ids(cluster5.metadata_uri)) - before == set(), "simpletest left its ledger behind"


@pytest.mark.parametrize("args", [["--ensemble", "6", "--write-quorum", "2", "--ack-quorum", "2"],
                                  ["--ensemble", "2", "--write-quorum", "3", "--ack-quorum", "2"]],
                         ids=["more-bookies-than-registered", "write-quorum-over-ensemble"])
def test_simpletest_impossible_quorum_is_one_line_error(cluster5: LocalCluster, args: list[str]) -> None:
    assert_one_line_error(bk("simpletest", *args, uri=cluster5.metadata_uri))


# -- bookies ------------------------------------------------------------------------
def _check_bookies_json(cluster5: LocalCluster, r: Result) -> None:
    assert_ok(r)
    rows = json.loads(r.out)
    assert isinstance(rows, list) and len(rows) == 5
    expected = {b.bookie_id: b for b in cluster5.bookies}
    assert {row["bookie_id"] for row in rows} == set(expected)
    for row in rows:
        assert {"bookie_id", "rack", "readonly", "shards"} <= set(row), row
        assert isinstance(row["rack"], str)
        assert row["readonly"] is False
        b = expected[row["bookie_id"]]
        assert row["shards"] == [{"host": "127.0.0.1", "port": b.port + i} for i in range(cluster5.shards)], row
        assert all(set(s) >= {"host", "port"} and isinstance(s["port"], int) for s in row["shards"])


def test_bookies_list_json_with_uri_before_the_sub_command(cluster5: LocalCluster) -> None:
    _check_bookies_json(cluster5, bk("--metadata-uri", cluster5.metadata_uri, "bookies", "list", "--json"))


def test_bookies_list_json_with_uri_after_the_sub_command(cluster5: LocalCluster) -> None:
    _check_bookies_json(cluster5, bk("bookies", "list", "--json", uri=cluster5.metadata_uri))
    _check_bookies_json(cluster5, bk("bookies", "--metadata-uri", cluster5.metadata_uri, "list", "--json"))


def test_bookies_list_json_with_uri_from_the_environment(cluster5: LocalCluster) -> None:
    _check_bookies_json(cluster5, bk("bookies", "list", "--json", env_uri=cluster5.metadata_uri))


def test_metadata_uri_flag_wins_over_the_environment(cluster5: LocalCluster) -> None:
    _check_bookies_json(cluster5, bk("bookies", "list", "--json", uri=cluster5.metadata_uri,
                                     env_uri="zk://nonexistent.invalid:1/elsewhere"))


def test_bookies_list_readonly_json_is_empty(cluster5: LocalCluster) -> None:
    r = bk("bookies", "list", "--readonly", "--json", uri=cluster5.metadata_uri)
    assert_ok(r)
    assert json.loads(r.out) == []


def test_bookies_list_table_names_every_bookie(cluster5: LocalCluster) -> None:
    r = bk("bookies", "list", uri=cluster5.metadata_uri)
    assert_ok(r)
    for b in cluster5.bookies:
        assert b.bookie_id in r.out


# -- one ledger ---------------------------------------------------------------------
def test_ledger_metadata_prints_the_documented_json(cluster5: LocalCluster, ledger: Written) -> None:
    r = bk("ledger", "metadata", str(ledger.ledger_id), uri=cluster5.metadata_uri)
    assert_ok(r)
    md = json.loads(r.out)
    assert {"ledger_id", "state", "ensemble_size", "write_quorum", "ack_quorum", "last_entry_id", "length",
            "digest", "ensembles", "custom_metadata", "ctime"} <= set(md), sorted(md)
    assert md["ledger_id"] == ledger.ledger_id
    assert md["state"] == "CLOSED"
    assert (md["ensemble_size"], md["write_quorum"], md["ack_quorum"]) == (3, 2, 2)
    assert md["last_entry_id"] == len(PAYLOADS) - 1
    assert md["length"] == sum(map(len, PAYLOADS))
    assert md["digest"] == "CRC32C"
    assert md["ensembles"] == [{"first_entry_id": 0, "bookies": ledger.ensemble}]
    assert set(ledger.ensemble) <= {b.bookie_id for b in cluster5.bookies}
    assert md["custom_metadata"] == {k: base64.b64encode(v).decode() for k, v in CUSTOM.items()}
    assert {k: base64.b64decode(v) for k, v in md["custom_metadata"].items()} == CUSTOM
    assert isinstance(md["ctime"], int) and ledger.created_ms - 60_000 <= md["ctime"] <= int(time.time() * 1000)


def test_ledger_read_range_prints_id_tab_data_lines(cluster5: LocalCluster, ledger: Written) -> None:
    r = bk("ledger", "read", str(ledger.ledger_id), "--from", "1", "--to", "3", uri=cluster5.metadata_uri)
    assert_ok(r)
    expected = "".join(f"{i}\t{PAYLOADS[i].decode('utf-8', 'backslashreplace')}\n" for i in range(1, 4))
    assert r.out == expected
    assert r"\xff\xfe" in r.out and r"\xc3" in r.out  # bad bytes escaped, good UTF-8 kept as is
    assert "h\u00e9llo w\u00f6rld \u2713 \U0001f600" in r.out


def test_ledger_read_defaults_to_the_whole_ledger(cluster5: LocalCluster, ledger: Written) -> None:
    """--from defaults to 0 and --to to the last entry."""
    r = bk("ledger", "read", str(ledger.ledger_id), "--to", "5", uri=cluster5.metadata_uri)
    assert_ok(r)
    assert r.out == "".join(f"{i}\t{PAYLOADS[i].decode('utf-8', 'backslashreplace')}\n" for i in range(6))
    r = bk("ledger", "read", str(ledger.ledger_id), "--json", uri=cluster5.metadata_uri)
    assert_ok(r)
    rows = [json.loads(line) for line in r.out.splitlines()]
    assert [base64.b64decode(row["data_b64"]) for row in rows] == PAYLOADS
    r = bk("ledger", "read", str(ledger.ledger_id), "--from", "6", uri=cluster5.metadata_uri)
    assert_ok(r)
    last = len(PAYLOADS) - 1
    assert r.out == "".join(f"{i}\t{PAYLOADS[i].decode('utf-8', 'backslashreplace')}\n" for i in range(6, last + 1))


def test_ledger_read_json_round_trips_every_byte(cluster5: LocalCluster, ledger: Written) -> None:
    r = bk("ledger", "read", str(ledger.ledger_id), "--from", "1", "--to", "3", "--json", uri=cluster5.metadata_uri)
    assert_ok(r)
    rows = [json.loads(line) for line in r.out.splitlines()]
    assert rows == [{"entry_id": i, "data_b64": base64.b64encode(PAYLOADS[i]).decode()} for i in range(1, 4)]
    r = bk("ledger", "read", str(ledger.ledger_id), "--from", "0", "--to", str(len(PAYLOADS) - 1), "--json",
           uri=cluster5.metadata_uri)
    assert_ok(r)
    rows = [json.loads(line) for line in r.out.splitlines()]
    assert [row["entry_id"] for row in rows] == list(range(len(PAYLOADS)))
    assert [base64.b64decode(row["data_b64"]) for row in rows] == PAYLOADS


def test_ledger_read_past_the_end_is_one_line_error(cluster5: LocalCluster, ledger: Written) -> None:
    r = bk("ledger", "read", str(ledger.ledger_id), "--from", "0", "--to", str(len(PAYLOADS) + 5),
           uri=cluster5.metadata_uri)
    assert_one_line_error(r)


def test_ledgers_list_includes_the_ledger(cluster5: LocalCluster, ledger: Written) -> None:
    r = bk("ledgers", "list", uri=cluster5.metadata_uri)
    assert_ok(r)
    ids = [int(line) for line in r.out.split()]
    assert ledger.ledger_id in ids
    assert len(ids) == len(set(ids))


def _bk_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("BK_METADATA_URI", "COLUMNS", "LINES")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_a_command_with_stdin_closed_runs(cluster5: LocalCluster, ledger: Written) -> None:
    """`bk ledgers list <&-`: the client's first socket must not take fd 0 (libuv aborted on it)."""
    p = subprocess.run([sys.executable, "-m", "bookkeeper.cli.main", "ledgers", "list",
                        "--metadata-uri", cluster5.metadata_uri], cwd=REPO, env=_bk_env(),
                       preexec_fn=lambda: os.close(0), capture_output=True, timeout=CLI_TIMEOUT_S)
    r = Result(p.returncode, p.stdout, p.stderr)
    assert_ok(r)
    assert ledger.ledger_id in [int(line) for line in r.out.split()]


def test_ledger_read_into_a_closed_pipe_exits_141_quietly(cluster5: LocalCluster) -> None:
    """`bk ledger read ... | head -1`: the reader goes after one line; bk exits 141 (as a pipeline
    member killed by SIGPIPE would) with nothing on stderr, not a BrokenPipeError traceback."""
    async def write() -> int:
        async with await BookKeeper.connect(cluster5.metadata_uri) as client:
            lh = await client.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
            await asyncio.gather(*(lh.add_entry_async(b"x" * 1024) for _ in range(400)))  # ~400 KiB of lines
            await lh.close()
            return lh.ledger_id
    lid = run(write())
    p = subprocess.Popen([sys.executable, "-m", "bookkeeper.cli.main", "ledger", "read", str(lid),
                          "--metadata-uri", cluster5.metadata_uri], cwd=REPO, env=_bk_env(),
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline().startswith(b"0\t")  # type: ignore[union-attr]
        p.stdout.close()  # type: ignore[union-attr]
        err = p.stderr.read()  # type: ignore[union-attr]
        assert p.wait(CLI_TIMEOUT_S) == 141, err
        assert err == b"", err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_ledger_delete_removes_the_ledger(cluster5: LocalCluster) -> None:
    async def write() -> int:
        async with await BookKeeper.connect(cluster5.metadata_uri) as client:
            lh = await client.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
            for p in PAYLOADS[:3]:
                await lh.add_entry(p)
            await lh.close()
            return lh.ledger_id
    lid = run(write())
    uri = cluster5.metadata_uri
    assert lid in [int(x) for x in bk("ledgers", "list", uri=uri).out.split()]

    r = bk("ledger", "delete", str(lid), uri=uri)
    assert_ok(r)
    assert lid not in [int(x) for x in bk("ledgers", "list", uri=uri).out.split()]
    assert lid not in run(_ledger_ids(uri))

    line = assert_one_line_error(bk("ledger", "metadata", str(lid), uri=uri))
    assert str(lid) in line
    assert_one_line_error(bk("ledger", "read", str(lid), uri=uri))
    assert_one_line_error(bk("ledger", "delete", str(lid), uri=uri))


# -- errors -------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["ledgers", "list"], ["bookies", "list", "--json"], ["ledger", "metadata", "1"],
                                  ["simpletest"]], ids=lambda a: "-".join(a))
def test_missing_metadata_uri_is_one_clear_line(argv: list[str]) -> None:
    r = bk(*argv)
    line = assert_one_line_error(r, mentions="metadata")
    assert "BK_METADATA_URI" in line or "--metadata-uri" in line, line
    assert r.stdout == b""


def test_malformed_metadata_uri_is_one_clear_line() -> None:
    r = bk("ledgers", "list", uri="http://127.0.0.1:2181/ledgers")
    assert_one_line_error(r, mentions="uri")


def test_verbose_flag_is_accepted_and_output_unchanged(cluster5: LocalCluster, ledger: Written) -> None:
    quiet = bk("ledger", "metadata", str(ledger.ledger_id), uri=cluster5.metadata_uri)
    loud = bk("-v", "ledger", "metadata", str(ledger.ledger_id), uri=cluster5.metadata_uri)
    assert loud.returncode == 0, str(loud)
    assert json.loads(loud.out) == json.loads(quiet.out)


@pytest.mark.parametrize("uri", ["[zk://127.0.0.1:2181]/ledgers", "127.0.0.1:2181/ledgers[/zk]"],
                         ids=["bracketed-placeholder", "closing-bracket-tag"])
def test_bad_metadata_uri_is_echoed_verbatim_in_one_line(uri: str) -> None:
    """The error names the URI exactly as given (square brackets are text, not markup)."""
    line = assert_one_line_error(bk("ledgers", "list", uri=uri))
    assert uri in line, line


def test_out_of_range_ledger_id_is_one_line_error(cluster5: LocalCluster) -> None:
    assert_one_line_error(bk("ledger", "metadata", str(10**12), uri=cluster5.metadata_uri))


def test_ledger_read_of_password_protected_crc_ledger_needs_no_password(cluster5: LocalCluster) -> None:
    """An admin read of a CRC32C ledger works without its password; a wrong --password is refused."""
    async def write() -> int:
        async with await BookKeeper.connect(cluster5.metadata_uri) as c:
            lh = await c.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, password=b"pw")
            for i in range(3):
                await lh.add_entry(b"p%d" % i)
            await lh.close()
            return lh.ledger_id
    lid = run(write())
    r = bk("ledger", "read", str(lid), uri=cluster5.metadata_uri)
    assert_ok(r)
    assert r.out.splitlines() == ["0\tp0", "1\tp1", "2\tp2"]
    assert_one_line_error(bk("ledger", "read", str(lid), "--password", "nope", uri=cluster5.metadata_uri),
                          mentions="UnauthorizedError")
    assert_ok(bk("ledger", "read", str(lid), "--password", "pw", uri=cluster5.metadata_uri))


def test_a_mistyped_metadata_root_is_an_error_not_an_empty_cluster(cluster5: LocalCluster) -> None:
    """A client pointed at a path with no cluster says so, and creates nothing there."""
    wrong = cluster5.metadata_uri.replace("/ledgers", "/ledgerz")
    line = assert_one_line_error(bk("ledgers", "list", uri=wrong), mentions="no BookKeeper cluster")
    assert "/ledgerz" in line
    from kazoo.client import KazooClient
    zk = KazooClient(hosts=cluster5.zk.connect_string)
    zk.start(timeout=10)
    try:
        assert zk.exists("/ledgerz") is None
    finally:
        zk.stop()
        zk.close()


def test_bookies_can_stop_refuses_while_an_open_ledger_would_have_no_replacement(make_cluster) -> None:
    """`bk bookies can-stop` (rolling restarts): with 2 bookies, stopping one is fine until a
    ledger with ensemble 2 is open (its writer would have no replacement), and fine again once
    it is closed; the refusal is one line naming both counts."""
    cluster: LocalCluster = make_cluster(bookies=2, shards=1)
    victim = cluster.bookies[0].bookie_id
    r = bk("bookies", "can-stop", victim, "--json", uri=cluster.metadata_uri)
    assert_ok(r)
    assert json.loads(r.out) == {"bookie_id": victim, "can_stop": True, "reason": None, "other_writable": 1,
                                 "largest_open_ensemble": 0}

    async def main() -> None:
        async with await BookKeeper.connect(cluster.metadata_uri) as client:
            lh = await client.create_ledger(ensemble=2, write_quorum=2, ack_quorum=2)
            await lh.add_entry(b"x")
            line = assert_one_line_error(bk("bookies", "can-stop", victim, uri=cluster.metadata_uri),
                                         mentions="2 needed")
            assert "1 other writable" in line, line
            await lh.close()
            assert_ok(bk("bookies", "can-stop", victim, uri=cluster.metadata_uri))
            assert_one_line_error(bk("bookies", "can-stop", victim, "--min-writable", "2", uri=cluster.metadata_uri))
    run(main())


# -- auto-recovery commands: read-only views and bad input (docs/autorecovery.md) ------------
def test_autorecovery_status_and_list_on_a_cluster_without_auto_recovery(cluster5: LocalCluster) -> None:
    """No bookie runs auto-recovery here: no auditor, nothing marked, every bookie writable."""
    r = bk("autorecovery", "status", "--json", uri=cluster5.metadata_uri)
    assert_ok(r)
    status = json.loads(r.out)
    # Apache BookKeeper's object first (what every bookie's /api/v1/autorecovery/status answers) ...
    assert {k: status[k] for k in ("enabled", "auditor", "underreplicated")} == {
        "enabled": True, "auditor": None, "underreplicated": 0}
    # ... then this view's own keys
    assert status["candidates"] == 0 and status["under_replicated"] == 0 and status["auditor_node"] is None
    assert status["enabled"] is True and len(status["bookies"]["writable"]) == len(cluster5.bookies)
    r = bk("autorecovery", "list", "--json", uri=cluster5.metadata_uri)
    assert_ok(r)
    assert json.loads(r.out) == []
    assert_ok(bk("autorecovery", "status", uri=cluster5.metadata_uri))


@pytest.mark.parametrize("command", ["recover", "decommission"])
def test_recover_and_decommission_of_an_unknown_bookie_change_nothing(cluster5: LocalCluster, command: str) -> None:
    """A bookie id with no cookie, registration, marker or ledger: one line, exit 1, no
    decommissioning marker and no under-replication mark left behind."""
    line = assert_one_line_error(bk(command, "10.9.9.9:1", uri=cluster5.metadata_uri), mentions="unknown bookie")
    assert "10.9.9.9:1" in line
    from kazoo.client import KazooClient
    zk = KazooClient(hosts=cluster5.zk.connect_string)
    zk.start(timeout=10)
    try:
        assert zk.exists("/ledgers/decommissioning/10.9.9.9:1") is None
        assert not zk.exists("/ledgers/underreplication/ledgers") or \
            zk.get_children("/ledgers/underreplication/ledgers") == []
    finally:
        zk.stop()
        zk.close()


@pytest.mark.parametrize("command", ["gc", "info"])
@pytest.mark.parametrize("http", ["localhost", "localhost:http", ":8000", "127.0.0.1:0", "127.0.0.1:70000"])
def test_bookie_gc_and_info_with_a_bad_host_port_is_a_usage_error(command: str, http: str) -> None:
    r = bk("bookie", command, "--http", http)
    assert r.returncode == 2
    assert_one_line_error(r, mentions="HOST:PORT")


def test_bookie_info_of_an_unreachable_bookie_is_one_line_error() -> None:
    from bookkeeper.testing.cluster import free_port_block

    r = bk("bookie", "info", "--http", f"127.0.0.1:{free_port_block()}")
    assert r.returncode == 1
    assert_one_line_error(r, mentions="cannot reach the admin HTTP")


def _io_uring_line(directory: Path) -> str:
    from bookkeeper.bookie.journal.syncer import probe_io_uring

    reason = probe_io_uring(str(directory))
    return "io_uring available" if reason is None else f"io_uring unavailable: {reason}"


def test_version_prints_the_distribution_version_first_then_commit_python_liburing_io_uring(tmp_path: Path) -> None:
    """`bk --version` from this checkout: the distribution's version, the checkout's commit,
    Python, liburing, and what the bookie's own io_uring probe says on this kernel."""
    r = bk("--version")
    assert_ok(r)
    lines = r.out.splitlines()
    assert lines[0] == f"bookkeeper-py {importlib.metadata.version('bookkeeper-py')}"
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert lines[1] in (f"commit {head}", f"commit {head} (with uncommitted changes)"), lines
    assert lines[2:] == [f"Python {platform.python_version()} ({platform.python_implementation()})",
                         f"liburing {importlib.metadata.version('liburing')}", _io_uring_line(tmp_path)]


def test_version_outside_a_checkout_leaves_the_commit_out(tmp_path: Path) -> None:
    """The package run from a copy that is no git checkout (as an installed wheel is): no commit
    line, the rest as from the checkout."""
    shutil.copytree(REPO / "bookkeeper", tmp_path / "bookkeeper", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tmp_path)
    p = subprocess.run([sys.executable, "-m", "bookkeeper.cli.main", "--version"], cwd=tmp_path, env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == f"bookkeeper-py {importlib.metadata.version('bookkeeper-py')}"
    assert not any(line.startswith("commit") for line in lines) and len(lines) == 4, lines


def test_bookie_without_conf_or_sub_command_is_a_usage_error() -> None:
    r = bk("bookie")
    assert r.returncode == 2
    assert_one_line_error(r, mentions="--conf")


@pytest.mark.parametrize("bookie_id", ["", "a/b", "readonly"])
def test_recover_of_what_cannot_be_a_bookie_id_is_a_usage_error(cluster5: LocalCluster, bookie_id: str) -> None:
    r = bk("recover", bookie_id, uri=cluster5.metadata_uri)
    assert r.returncode == 2
    assert_one_line_error(r, mentions="not a bookie id")


# -- help and layout (issue 27 item 6) ---------------------------------------------------
def _parser_entries(parser: argparse.ArgumentParser, path: str = "bk") -> Iterator[tuple[str, argparse.Action | None,
                                                                                         str, str | None]]:
    """(command path, action or None for a sub-command, what it is called, its help) for every
    option, positional and sub-command under `parser` (bk's own tree: main.py's builder and
    stream.py's parsers, which it adds)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, child in action.choices.items():
                yield path, None, name, helps.get(name)
                yield from _parser_entries(child, f"{path} {name}")
        elif action.help is not argparse.SUPPRESS:
            yield path, action, "/".join(action.option_strings) or action.dest, action.help


def test_every_option_positional_and_sub_command_has_help_text() -> None:
    missing = [f"{path} {name}" for path, _, name, help_ in _parser_entries(build_parser()) if not (help_ or "").strip()]
    assert not missing, "no help text: " + ", ".join(missing)


# NAME, HOST:PORT, FILE.toml, ENTRY_ID; not FROM_ (argparse's name for dest from_) nor ledger_id
READABLE_METAVAR = re.compile(r"[A-Z][A-Z0-9_:]*(?<!_)(\.[a-z]+)?")


def _shown_metavar(action: argparse.Action) -> str:
    """What `--help` and the usage line show for the value an action takes."""
    if isinstance(action.metavar, str):
        return action.metavar
    if action.choices is not None:
        return "{" + ",".join(map(str, action.choices)) + "}"
    return action.dest.upper() if action.option_strings else action.dest


def test_every_value_is_shown_by_a_readable_name() -> None:
    """`ledger read` once showed `--from FROM_`, positionals showed `ledger_id`: a value's name is
    upper case (FILE.toml, HOST:PORT, ENTRY_ID), without argparse's trailing underscore, or the
    list of its choices."""
    bad = []
    for path, action, name, _ in _parser_entries(build_parser()):
        if action is None or action.nargs == 0:
            continue
        shown = _shown_metavar(action)
        if not (shown.startswith("{") or READABLE_METAVAR.fullmatch(shown)):
            bad.append(f"{path} {name} {shown}")
    assert not bad, "values shown by argparse's default name: " + ", ".join(bad)


def test_bookie_gc_table_shows_every_figure_whole_at_80_columns() -> None:
    from rich.console import Console

    from bookkeeper.cli.main import GC_BYTES, GC_COUNTS, gc_table

    result = {"ledgers_deleted": 12_345, "logs_compacted": 678, "logs_deleted": 9_012, "entries_copied": 345_678_901,
              "bytes_copied": 12_345_678_901_234, "bytes_reclaimed": 98_765_432_109_876, "duration_s": 1234.5}
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    console.print(gc_table(result))
    text = console.export_text()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80, text
    for key, name in GC_COUNTS + GC_BYTES:
        assert name in text and f"{result[key]:,}" in text, (name, text)
    assert "1234.50 s" in text


def test_a_wide_cli_table_wraps_at_80_columns_and_cuts_nothing() -> None:
    """Every `bk` table is made by cli_table: seven columns of long numbers (a stream's segments)
    wrap in 80 columns, every header and value whole (read back without the line breaks)."""
    from rich.console import Console

    from bookkeeper.cli.common import cli_table

    headers = ("seq", "ledger", "state", "first txid", "last txid", "records", "bytes")
    values = ("123456", "9876543210", "CLOSED", "1234567890123", "1234567899999", "1,234,567,890", "98,765,432,109,876")
    table = cli_table(*headers, title="stream events")
    table.add_row(*values)
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    console.print(table)
    text = console.export_text()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80, text
    cells = [re.sub(r"\s+", " ", " ".join(col)).strip() for col in _columns(text, len(headers))]
    for header, value, cell in zip(headers, values, cells):
        assert cell.replace(" ", "").startswith(header.replace(" ", "")), (header, cell)
        assert value in cell.replace(" ", ""), (value, cell)


def _columns(text: str, count: int) -> list[list[str]]:
    """The cells of a rendered rich table, column by column (lines between the box's bars)."""
    columns: list[list[str]] = [[] for _ in range(count)]
    for line in text.splitlines():
        parts = re.split(r"[┃│]", line)
        if len(parts) == count + 2:
            for i, part in enumerate(parts[1:-1]):
                columns[i].append(part.strip())
    return columns


# -- sandbox (issue 27 items 1 and 2) -------------------------------------------------------
SANDBOX_UP_TIMEOUT_S = 180
BOOKIE_LINE = re.compile(r"^bookie (?P<id>\S+) rack=(?P<rack>\S+) shards=(?P<shards>\S+) admin=http://(?P<admin>\S+)$")
CLIENT_RUN = """
import asyncio, logging, os
from bookkeeper import BookKeeper
logging.basicConfig(level=logging.INFO)  # even an INFO line about placement would show

async def main() -> None:
    async with await BookKeeper.connect(os.environ["BK_METADATA_URI"]) as bk:
        for _ in range(3):
            lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
            await lh.add_entry(b"x")
            await lh.close()
            await bk.delete_ledger(lh.ledger_id)
asyncio.run(main())
"""


def _descendants(pid: int) -> set[int]:
    from bookkeeper.testing.cluster import children_of

    found, todo = set(), [pid]
    while todo:
        for child in children_of(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _read_until_export(proc: subprocess.Popen[str]) -> list[str]:
    """stdout lines until `export BK_METADATA_URI=...`, the sandbox's last start-up line."""
    lines: list[str] = []
    deadline = time.monotonic() + SANDBOX_UP_TIMEOUT_S
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith("export BK_METADATA_URI="):
            return lines
    raise AssertionError(f"no export line from bk sandbox (rc {proc.poll()}): {lines}")


def test_sandbox_prints_admin_ports_and_the_uri_and_ctrl_c_stops_everything(tmp_path: Path) -> None:
    """`bk sandbox --dir D`: a line per bookie with its rack, shard addresses and admin HTTP (whose
    /metrics answers), `metadata_uri=` and `export BK_METADATA_URI=` lines and D/metadata_uri; a
    client run against it logs nothing about placement (three racks for rack-aware placement);
    `bk bookie gc --http` on a bookie fits 80 columns; SIGINT stops every process it started.
    ZooKeeper's port is given (--zk-port): the test must not take a developer's 2181."""
    from bookkeeper.testing.cluster import free_port_block

    directory, zk_port = tmp_path / "sandbox", free_port_block()
    stderr_path = tmp_path / "sandbox.err"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "bookkeeper.cli.main", "sandbox", "--dir", str(directory),
                                 "--bookies", "3", "--shards", "1", "--zk-port", str(zk_port)],
                                cwd=REPO, env=_bk_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=stderr, text=True)
    started: set[int] = set()
    try:
        lines = _read_until_export(proc)
        started = _descendants(proc.pid)
        uri = f"zk://127.0.0.1:{zk_port}/ledgers"
        assert lines[-2:] == [f"metadata_uri={uri}", f"export BK_METADATA_URI={uri}"], lines
        assert (directory / "metadata_uri").read_text() == uri + "\n"
        bookies = [m.groupdict() for m in map(BOOKIE_LINE.match, lines) if m]
        assert len(bookies) == 3 and len({b["rack"] for b in bookies}) == 3, lines
        for b in bookies:
            assert b["shards"] == b["id"], b  # one shard, listening on the bookie's port
            with urllib.request.urlopen(f"http://{b['admin']}/metrics", timeout=30) as r:
                assert r.status == 200 and b"bookkeeper_" in r.read()

        client = subprocess.run([sys.executable, "-c", CLIENT_RUN], cwd=REPO, env={**_bk_env(), "BK_METADATA_URI": uri},
                                stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
        assert client.returncode == 0, client.stderr
        assert "placement" not in client.stderr and "WARNING" not in client.stderr, client.stderr

        gc = bk("bookie", "gc", "--http", bookies[0]["admin"])
        assert_ok(gc)
        assert max(map(len, gc.out.splitlines())) <= 80 and "…" not in gc.out, gc.out
        for name in ("ledgers deleted", "entry logs compacted", "bytes reclaimed", "duration"):
            assert name in gc.out, gc.out
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        finally:
            for pid in started | {proc.pid}:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
    err = stderr_path.read_text()
    assert proc.returncode == 0, err
    assert not [pid for pid in started if _alive(pid)], f"left running after Ctrl-C: {started}\n{err}"
    assert len(started) >= 7, started  # ZooKeeper, three bookie supervisors, a shard each
    assert not (directory / "metadata_uri").exists()
    assert "Traceback" not in err, err


@pytest.mark.parametrize("asked, took, note", [
    (None, 2181, None),
    (None, 12345, "ZooKeeper's usual port 2181 is in use (another ZooKeeper or sandbox?): took port 12345; "
                  "use the URI printed below"),
    (2181, 2181, None),
    (12345, 12345, None),  # asked for: nothing to explain
])
def test_sandbox_says_which_zookeeper_port_it_took_and_why(asked: int | None, took: int, note: str | None) -> None:
    from bookkeeper.cli.main import zk_port_note

    assert zk_port_note(asked=asked, took=took) == note
