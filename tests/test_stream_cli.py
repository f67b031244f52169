"""`bk stream ...` against a real cluster, run as a subprocess (docs/api.md section 6, CLI).

Checked: create / list (--json) / describe (--json shape and figures, the table) / write (a
position per stdin line, printed as each line arrives) / tail (--no-follow, --json, --from,
--count while following a live writer, Ctrl-C, a closed stdout) / truncate --before /
delete, namespaces, and the error contract: one line on stderr, non-zero exit, no
traceback, for a duplicate stream, a missing stream, a bad position.

The streams live in the session's `cluster5`, one namespace per test (or per fixture), so
the tests neither see nor disturb each other's streams.
"""
from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import pytest

from bookkeeper.stream import Position
from bookkeeper.testing.cluster import LocalCluster
from tests.test_cli import CLI_TIMEOUT_S, REPO, Result, assert_ok, assert_one_line_error

pytestmark = [pytest.mark.cluster, pytest.mark.runtime(40)]

SEGMENT_RECORDS = 5
# 27 records: plain lines, multi-byte UTF-8, bytes that are not UTF-8, an empty line, and a
# last line ending in "\r\n" (written without the "\r")
LINES = [f"line {i}".encode() for i in range(23)] + ["h\u00e9llo".encode(), b"\xff raw", b"", b"crlf"]
STDIN = b"\n".join(LINES[:-1]) + b"\n" + LINES[-1] + b"\r\n"


def _env(env_uri: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("BK_METADATA_URI", "COLUMNS", "LINES")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONFAULTHANDLER"] = "1"  # a hung bk sent SIGABRT prints every thread's stack
    if env_uri is not None:
        env["BK_METADATA_URI"] = env_uri
    return env


def bk(uri: str, *args: str, stdin: bytes = b"") -> Result:
    """`bk ARGS... --metadata-uri URI` with `stdin`, as a script runs it."""
    p = subprocess.run([sys.executable, "-m", "bookkeeper.cli.main", *args, "--metadata-uri", uri], cwd=REPO,
                       env=_env(), input=stdin, capture_output=True, timeout=CLI_TIMEOUT_S)
    return Result(p.returncode, p.stdout, p.stderr)


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default. A test run started in the background
    of a non-interactive shell (`make test &`, nohup) has SIGINT ignored, every child inherits
    that, and Python then installs no KeyboardInterrupt: the Ctrl-C test would test the shell."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextmanager
def running(uri: str, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """`bk ARGS...` in the background with stdin, stdout and stderr piped, SIGINT at its default
    (as from a terminal); killed on the way out."""
    p = subprocess.Popen([sys.executable, "-m", "bookkeeper.cli.main", *args, "--metadata-uri", uri], cwd=REPO,
                         env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=_default_sigint)
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=CLI_TIMEOUT_S)
        for f in (p.stdin, p.stdout, p.stderr):
            with suppress(OSError):
                f.close()  # type: ignore[union-attr]


def readline(p: subprocess.Popen[bytes], timeout_s: float = CLI_TIMEOUT_S) -> bytes:
    """The next stdout line of a background `bk`, failing (not hanging) if none comes in time."""
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(p.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    t.start()
    t.join(timeout_s)
    assert got and got[0], f"no line from {p.args} within {timeout_s} s (rc={p.poll()})"
    return got[0]


def describe(uri: str, name: str, ns: str) -> dict:
    r = bk(uri, "stream", "describe", name, "--namespace", ns, "--json")
    assert_ok(r)
    return json.loads(r.out)


def tail_lines(r: Result) -> list[tuple[str, str]]:
    """`POSITION<TAB>DATA` lines as pairs (DATA may hold tabs of its own)."""
    return [tuple(line.split("\t", 1)) for line in r.stdout.decode("utf-8").splitlines()]  # type: ignore[misc]


@dataclass
class Written:
    """A stream written once by `bk stream write` (LINES, SEGMENT_RECORDS records a segment)."""

    uri: str
    ns: tuple[str, str]
    write: Result
    positions: list[Position]


@pytest.fixture(scope="module")
def written(cluster5: LocalCluster) -> Written:
    uri = cluster5.metadata_uri
    ns = ("--namespace", "cli-written")
    assert_ok(bk(uri, "stream", "create", "events", *ns))
    r = bk(uri, "stream", "write", "events", *ns, "--segment-max-records", str(SEGMENT_RECORDS), stdin=STDIN)
    assert_ok(r)
    return Written(uri, ns, r, [Position.parse(p) for p in r.out.splitlines()])


# -- create, list -------------------------------------------------------------------------
def test_create_then_list_json_names_the_namespace_streams(cluster5: LocalCluster) -> None:
    """create puts a stream in its --namespace only; list --json is the sorted array of names."""
    uri = cluster5.metadata_uri
    assert_ok(bk(uri, "stream", "create", "orders", "--namespace", "cli-a"))
    assert_ok(bk(uri, "stream", "create", "audit", "--namespace", "cli-a"))
    assert_ok(bk(uri, "stream", "create", "other", "--namespace", "cli-a2"))
    r = bk(uri, "stream", "list", "--namespace", "cli-a", "--json")
    assert_ok(r)
    assert json.loads(r.out) == ["audit", "orders"]
    r = bk(uri, "stream", "list", "--namespace", "cli-a")
    assert_ok(r)
    assert r.out.splitlines() == ["audit", "orders"]


def test_list_of_an_unused_namespace_is_an_empty_json_array(cluster5: LocalCluster) -> None:
    """list --json of a namespace nobody used prints []."""
    r = bk(cluster5.metadata_uri, "stream", "list", "--namespace", "cli-empty", "--json")
    assert_ok(r)
    assert json.loads(r.out) == []


def test_duplicate_create_is_one_line_exit_1(cluster5: LocalCluster) -> None:
    """A second create of a name is one stderr line naming StreamExistsError, exit 1."""
    uri = cluster5.metadata_uri
    assert_ok(bk(uri, "stream", "create", "dup", "--namespace", "cli-dup"))
    r = bk(uri, "stream", "create", "dup", "--namespace", "cli-dup")
    assert_one_line_error(r, mentions="StreamExistsError")
    assert r.returncode == 1


def test_create_of_an_invalid_name_is_one_line_error(cluster5: LocalCluster) -> None:
    """A stream name that cannot be a znode name is refused in one line."""
    assert_one_line_error(bk(cluster5.metadata_uri, "stream", "create", "bad/name"), mentions="invalid stream name")


def test_create_settings_show_in_describe(cluster5: LocalCluster) -> None:
    """create's retention and quorum options are what describe --json reports; an empty stream has no segment."""
    uri = cluster5.metadata_uri
    assert_ok(bk(uri, "stream", "create", "tuned", "--namespace", "cli-tuned", "-e", "2", "-w", "2", "-a", "1",
                 "--retention-max-age-s", "3600", "--retention-max-bytes", "1000000"))
    d = describe(uri, "tuned", "cli-tuned")
    assert (d["name"], d["ensemble"], d["write_quorum"], d["ack_quorum"]) == ("tuned", 2, 2, 1)
    assert (d["retention_max_age_s"], d["retention_max_bytes"], d["segments"]) == (3600, 1000000, [])


def test_create_with_impossible_quorums_is_one_line_error(cluster5: LocalCluster) -> None:
    """ack quorum above write quorum is refused in one line, and no stream is left behind."""
    uri = cluster5.metadata_uri
    assert_one_line_error(bk(uri, "stream", "create", "q", "--namespace", "cli-q", "-w", "2", "-a", "3"),
                          mentions="ack_quorum")
    assert json.loads(bk(uri, "stream", "list", "--namespace", "cli-q", "--json").out) == []


# -- write, tail, describe on one written stream ------------------------------------------
def test_write_prints_one_position_per_line_in_order(written: Written) -> None:
    """write prints a parseable position for every stdin line, increasing, SEGMENT_RECORDS per segment."""
    assert len(written.positions) == len(LINES)
    assert written.positions == sorted(set(written.positions))
    per_segment = [sum(1 for p in written.positions if p.segment == s)
                   for s in sorted({p.segment for p in written.positions})]
    assert per_segment == [5, 5, 5, 5, 5, 2]


def test_tail_no_follow_prints_every_record(written: Written) -> None:
    """tail --no-follow prints POSITION<TAB>DATA for every record (UTF-8, backslashreplace) and exits 0."""
    r = bk(written.uri, "stream", "tail", "events", *written.ns, "--no-follow")
    assert_ok(r)
    got = tail_lines(r)
    assert [Position.parse(p) for p, _ in got] == written.positions
    assert [d for _, d in got] == [b.decode("utf-8", "backslashreplace") for b in LINES]


def test_tail_json_round_trips_every_byte(written: Written) -> None:
    """tail --json prints {"position", "txid", "data_b64"} per record; txids count from 0."""
    r = bk(written.uri, "stream", "tail", "events", *written.ns, "--no-follow", "--json")
    assert_ok(r)
    objs = [json.loads(line) for line in r.out.splitlines()]
    assert [base64.b64decode(o["data_b64"]) for o in objs] == LINES
    assert [o["txid"] for o in objs] == list(range(len(LINES)))
    assert [Position.parse(o["position"]) for o in objs] == written.positions


def test_tail_from_a_position_starts_there(written: Written) -> None:
    """tail --from POSITION prints that record and the ones after it."""
    start = written.positions[12]
    r = bk(written.uri, "stream", "tail", "events", *written.ns, "--no-follow", "--from", str(start))
    assert_ok(r)
    assert [Position.parse(p) for p, _ in tail_lines(r)] == written.positions[12:]


def test_tail_from_latest_without_follow_prints_nothing(written: Written) -> None:
    """tail --from latest --no-follow stops at once: nothing is after the current end."""
    r = bk(written.uri, "stream", "tail", "events", *written.ns, "--no-follow", "--from", "latest")
    assert_ok(r)
    assert r.out == ""


def test_tail_count_without_follow_stops_after_n(written: Written) -> None:
    """tail --count 3 prints the first three records only."""
    r = bk(written.uri, "stream", "tail", "events", *written.ns, "--count", "3")
    assert_ok(r)
    assert [Position.parse(p) for p, _ in tail_lines(r)] == written.positions[:3]


def test_describe_json_shape_and_figures(written: Written) -> None:
    """describe --json lists the closed segments with their txids, record counts and sizes."""
    d = describe(written.uri, "events", written.ns[1])
    assert d["name"] == "events" and d["writer"] is None
    segs = d["segments"]
    assert {"seq", "ledger_id", "state", "first_txid", "last_txid", "records", "bytes"} <= set(segs[0])
    assert [s["seq"] for s in segs] == sorted({p.segment for p in written.positions})
    assert [s["records"] for s in segs] == [5, 5, 5, 5, 5, 2]
    assert [(s["first_txid"], s["last_txid"]) for s in segs] == [(i, min(i + 4, 26)) for i in range(0, 27, 5)]
    assert all(s["state"] == "closed" and s["bytes"] > 0 for s in segs)
    assert len({s["ledger_id"] for s in segs}) == len(segs)


def test_describe_table_shows_segments_and_settings(written: Written) -> None:
    """describe without --json prints the segment table and a settings line."""
    r = bk(written.uri, "stream", "describe", "events", *written.ns)
    assert_ok(r)
    assert "first txid" in r.out and "closed" in r.out
    assert "3/2/2" in r.out and "writer: none" in r.out


# -- live: following, interactivity, signals --------------------------------------------------
def test_tail_count_follows_a_live_writer(cluster5: LocalCluster) -> None:
    """tail --count 7 prints records of an open segment as they are written, then exits 0 after the 7th."""
    uri = cluster5.metadata_uri
    ns = ("--namespace", "cli-live")
    assert_ok(bk(uri, "stream", "create", "live", *ns))
    with running(uri, "stream", "tail", "live", *ns, "--count", "7") as tail, \
            running(uri, "stream", "write", "live", *ns) as writer:
        assert writer.stdin is not None
        positions = []
        for i in range(10):
            writer.stdin.write(b"rec %d\n" % i)
            writer.stdin.flush()
            positions.append(readline(writer).decode().strip())
            if i < 3:  # the writer still holds its segment open: the tail is following it
                assert readline(tail).decode() == f"{positions[i]}\trec {i}\n"
        writer.stdin.close()
        assert writer.wait(timeout=CLI_TIMEOUT_S) == 0
        assert tail.wait(timeout=CLI_TIMEOUT_S) == 0
        out, err = tail.stdout.read(), tail.stderr.read()  # type: ignore[union-attr]
    assert out.decode().splitlines() == [f"{positions[i]}\trec {i}" for i in range(3, 7)]
    assert err == b""


def test_write_prints_each_position_as_its_line_arrives(cluster5: LocalCluster) -> None:
    """write acknowledges and prints a line's position before the next line (or end of input) comes."""
    uri = cluster5.metadata_uri
    ns = ("--namespace", "cli-interactive")
    assert_ok(bk(uri, "stream", "create", "chat", *ns))
    with running(uri, "stream", "write", "chat", *ns, "--compression", "zstd") as w:
        assert w.stdin is not None
        printed = []
        for i in range(3):
            w.stdin.write(b"message %d\n" % i)
            w.stdin.flush()
            printed.append(Position.parse(readline(w).decode()))
        w.stdin.close()
        assert w.wait(timeout=CLI_TIMEOUT_S) == 0
    assert printed == sorted(printed)
    r = bk(uri, "stream", "tail", "chat", *ns, "--no-follow")
    assert_ok(r)
    assert tail_lines(r) == [(str(p), f"message {i}") for i, p in enumerate(printed)]


def test_tail_ctrl_c_exits_130_quietly(cluster5: LocalCluster) -> None:
    """SIGINT to a following tail exits 130 with nothing on stderr."""
    uri = cluster5.metadata_uri
    ns = ("--namespace", "cli-sigint")
    assert_ok(bk(uri, "stream", "create", "idle", *ns))
    assert_ok(bk(uri, "stream", "write", "idle", *ns, stdin=b"one\n"))
    with running(uri, "stream", "tail", "idle", *ns) as tail:
        assert readline(tail).endswith(b"\tone\n")  # it runs, past start-up: now it waits for more
        tail.send_signal(signal.SIGINT)
        try:
            rc = tail.wait(timeout=CLI_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            tail.send_signal(signal.SIGABRT)  # faulthandler: where each thread is
            tail.wait(timeout=CLI_TIMEOUT_S)
            stacks = tail.stderr.read().decode(errors="replace")  # type: ignore[union-attr]
            pytest.fail(f"the tail did not exit within {CLI_TIMEOUT_S} s of SIGINT; its threads:\n{stacks[-12000:]}")
        assert rc == 130
        out, err = tail.stdout.read(), tail.stderr.read()  # type: ignore[union-attr]
    assert (out, err) == (b"", b"")


def test_tail_into_a_closed_pipe_stops_quietly(cluster5: LocalCluster) -> None:
    """A following tail whose reader went away (`| head`) exits 141 with nothing on stderr."""
    uri = cluster5.metadata_uri
    ns = ("--namespace", "cli-pipe")
    assert_ok(bk(uri, "stream", "create", "p", *ns))
    assert_ok(bk(uri, "stream", "write", "p", *ns, stdin=b"first\n"))
    with running(uri, "stream", "tail", "p", *ns) as tail:
        assert tail.stdout is not None and tail.stderr is not None
        assert readline(tail).endswith(b"\tfirst\n")
        tail.stdout.close()
        assert_ok(bk(uri, "stream", "write", "p", *ns, stdin=b"second\n"))
        assert tail.wait(timeout=CLI_TIMEOUT_S) == 141
        err = tail.stderr.read()
    assert err == b""


# -- truncate, delete --------------------------------------------------------------------------
def test_truncate_before_deletes_whole_segments(cluster5: LocalCluster) -> None:
    """truncate --before removes the segments before the position's segment; tail then starts at that segment."""
    uri = cluster5.metadata_uri
    ns = ("--namespace", "cli-trunc")
    assert_ok(bk(uri, "stream", "create", "t", *ns))
    r = bk(uri, "stream", "write", "t", *ns, "--segment-max-records", "5",
           stdin=b"".join(b"%d\n" % i for i in range(12)))
    assert_ok(r)
    positions = [Position.parse(p) for p in r.out.splitlines()]
    assert len(describe(uri, "t", "cli-trunc")["segments"]) == 3
    r = bk(uri, "stream", "truncate", "t", *ns, "--before", str(positions[7]))
    assert_ok(r)
    assert "deleted 1 segment" in r.out
    d = describe(uri, "t", "cli-trunc")
    assert [s["seq"] for s in d["segments"]] == [positions[5].segment, positions[10].segment]
    got = tail_lines(bk(uri, "stream", "tail", "t", *ns, "--no-follow"))
    assert got == [(str(p), str(i)) for i, p in enumerate(positions) if i >= 5]


def test_delete_then_describe_is_stream_not_found(cluster5: LocalCluster) -> None:
    """delete removes the stream: list no longer names it and describe is one line naming StreamNotFoundError."""
    uri = cluster5.metadata_uri
    ns = ("--namespace", "cli-del")
    assert_ok(bk(uri, "stream", "create", "gone", *ns))
    assert_ok(bk(uri, "stream", "write", "gone", *ns, stdin=b"a\nb\n"))
    assert_ok(bk(uri, "stream", "delete", "gone", *ns))
    assert json.loads(bk(uri, "stream", "list", *ns, "--json").out) == []
    assert_one_line_error(bk(uri, "stream", "describe", "gone", *ns), mentions="StreamNotFoundError")


# -- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [
    ("describe", "nope"), ("describe", "nope", "--json"), ("write", "nope"), ("tail", "nope"),
    ("tail", "nope", "--no-follow"), ("truncate", "nope", "--before", "1:0:0"), ("delete", "nope"),
])
def test_unknown_stream_is_one_line_error(cluster5: LocalCluster, command: tuple[str, ...]) -> None:
    """Every command on a stream that does not exist is one line naming StreamNotFoundError, exit 1."""
    r = bk(cluster5.metadata_uri, "stream", *command, "--namespace", "cli-unknown", stdin=b"x\n")
    assert_one_line_error(r, mentions="StreamNotFoundError")
    assert r.returncode == 1


@pytest.mark.parametrize("option", [("tail", "--from", "yesterday"), ("tail", "--from", "1:2"),
                                    ("tail", "--from", "1:x:0"), ("truncate", "--before", "1:2")])
def test_bad_position_is_one_line_error(written: Written, option: tuple[str, ...]) -> None:
    """--from / --before that is not earliest, latest or SEQ:ENTRY:SLOT is one line and a non-zero exit."""
    command, *rest = option
    assert_one_line_error(bk(written.uri, "stream", command, "events", *written.ns, *rest), mentions="SEQ:ENTRY:SLOT")


def test_negative_count_is_a_usage_error(written: Written) -> None:
    """tail --count -1 is one line and exit 2."""
    r = bk(written.uri, "stream", "tail", "events", *written.ns, "--count", "-1")
    assert_one_line_error(r, mentions="--count")
    assert r.returncode == 2


def test_metadata_uri_from_the_environment_before_the_sub_command(written: Written) -> None:
    """BK_METADATA_URI, and --metadata-uri before `stream`, both reach the stream commands."""
    argv = [sys.executable, "-m", "bookkeeper.cli.main"]
    p = subprocess.run([*argv, "stream", "list", *written.ns, "--json"], cwd=REPO, env=_env(written.uri),
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=CLI_TIMEOUT_S)
    assert (p.returncode, json.loads(p.stdout)) == (0, ["events"]), p.stderr
    p = subprocess.run([*argv, "--metadata-uri", written.uri, "stream", "list", *written.ns, "--json"], cwd=REPO,
                       env=_env(), stdin=subprocess.DEVNULL, capture_output=True, timeout=CLI_TIMEOUT_S)
    assert (p.returncode, json.loads(p.stdout)) == (0, ["events"]), p.stderr
