"""`bk stream ...` against a real cluster, run as a subprocess (API.md section 6, CLI).

Checked: create / list (--json) / describe (--json shape and figures) / write (a position
per stdin line) / tail (--no-follow, --count while following a live writer, --from, --json) /
truncate --before / delete, namespaces, and the error contract: one line on stderr, non-zero
exit, no traceback, for a duplicate stream, a missing stream, a bad position.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import pytest

from bookkeeper.stream import Position
from bookkeeper.testing.cluster import LocalCluster
from tests.test_cli import REPO, Result, assert_ok, assert_one_line_error

pytestmark = pytest.mark.cluster


def bk(uri: str, *args: str, stdin: bytes = b"") -> Result:
    """`bk ARGS... --metadata-uri URI` with stdin, as a script runs it."""
    env = {k: v for k, v in os.environ.items() if k not in ("BK_METADATA_URI", "COLUMNS", "LINES")}
    p = subprocess.run([sys.executable, "-m", "bookkeeper.cli.main", *args, "--metadata-uri", uri], cwd=REPO,
                       env=env, input=stdin, capture_output=True, timeout=60)
    return Result(p.returncode, p.stdout, p.stderr)


def test_create_list_and_duplicate(cluster5: LocalCluster) -> None:
    """create makes a stream in its namespace only; list --json is an array of names; a second
    create of the same name is one line naming StreamExistsError."""
    uri = cluster5.metadata_uri
    assert_ok(bk(uri, "stream", "create", "orders", "--namespace", "cli-a"))
    assert_ok(bk(uri, "stream", "create", "audit", "--namespace", "cli-a", "-e", "2", "-w", "2", "-a", "1"))
    r = bk(uri, "stream", "list", "--namespace", "cli-a", "--json")
    assert_ok(r)
    assert json.loads(r.out) == ["audit", "orders"]
    assert json.loads(bk(uri, "stream", "list", "--namespace", "cli-empty", "--json").out) == []
    assert_one_line_error(bk(uri, "stream", "create", "orders", "--namespace", "cli-a"), mentions="StreamExistsError")
    assert_one_line_error(bk(uri, "stream", "create", "bad/name"), mentions="invalid stream name")


def test_write_tail_describe_truncate_delete(cluster5: LocalCluster) -> None:
    """write prints one parseable position per line; tail --no-follow prints them with the data
    (POSITION<TAB>DATA, and --json); describe --json shows the segments; truncate removes whole
    segments; delete removes the stream."""
    uri = cluster5.metadata_uri
    ns = ("--namespace", "cli-b")
    assert_ok(bk(uri, "stream", "create", "events", *ns))
    lines = [f"line {i}".encode() for i in range(23)] + ["h\u00e9llo".encode(), b"\xff raw", b"", b"crlf"]
    r = bk(uri, "stream", "write", "events", *ns, "--segment-max-records", "5",
           stdin=b"\n".join(lines[:-1]) + b"\n" + lines[-1] + b"\r\n")
    assert_ok(r)
    positions = [Position.parse(p) for p in r.out.splitlines()]
    assert len(positions) == len(lines) and positions == sorted(positions)
    assert len({p.segment for p in positions}) == 6

    r = bk(uri, "stream", "tail", "events", *ns, "--no-follow")
    assert_ok(r)
    got = [line.split("\t", 1) for line in r.stdout.decode("utf-8").splitlines()]
    assert [Position.parse(p) for p, _ in got] == positions
    assert [d for _, d in got] == [b.decode("utf-8", "backslashreplace") for b in lines]
    r = bk(uri, "stream", "tail", "events", *ns, "--no-follow", "--json", "--from", str(positions[20]))
    objs = [json.loads(line) for line in r.out.splitlines()]
    assert [base64.b64decode(o["data_b64"]) for o in objs] == lines[20:]
    assert [o["txid"] for o in objs] == list(range(20, len(lines)))

    r = bk(uri, "stream", "describe", "events", *ns, "--json")
    assert_ok(r)
    d = json.loads(r.out)
    assert d["name"] == "events" and [s["seq"] for s in d["segments"]] == sorted({p.segment for p in positions})
    assert [s["records"] for s in d["segments"]] == [5, 5, 5, 5, 5, 2]
    assert all(s["state"] == "closed" and s["bytes"] > 0 for s in d["segments"])
    assert {"seq", "ledger_id", "state", "first_txid", "last_txid", "records", "bytes"} <= set(d["segments"][0])
    assert d["segments"][0]["first_txid"] == 0 and d["segments"][-1]["last_txid"] == len(lines) - 1
    assert "events" in bk(uri, "stream", "describe", "events", *ns).out

    assert_ok(bk(uri, "stream", "truncate", "events", *ns, "--before", str(positions[12])))
    d = json.loads(bk(uri, "stream", "describe", "events", *ns, "--json").out)
    assert len(d["segments"]) == 4
    first = bk(uri, "stream", "tail", "events", *ns, "--no-follow").out.splitlines()[0]
    assert first.split("\t")[0] == str(positions[10])

    assert_ok(bk(uri, "stream", "delete", "events", *ns))
    for cmd in (("describe", "events"), ("tail", "events", "--no-follow"), ("delete", "events"),
                ("truncate", "events", "--before", "1:0:0")):
        assert_one_line_error(bk(uri, "stream", *cmd, *ns), mentions="StreamNotFoundError")
    assert_one_line_error(bk(uri, "stream", "write", "events", *ns, stdin=b"x\n"), mentions="StreamNotFoundError")


def test_tail_follows_a_live_writer_until_count(cluster5: LocalCluster) -> None:
    """tail --count N, started before the writer and following, prints the records in order and
    exits after N of the 10 written."""
    uri = cluster5.metadata_uri
    ns = ("--namespace", "cli-c")
    assert_ok(bk(uri, "stream", "create", "live", *ns))
    env = {k: v for k, v in os.environ.items() if k not in ("BK_METADATA_URI",)}
    tail = subprocess.Popen([sys.executable, "-m", "bookkeeper.cli.main", "stream", "tail", "live", *ns,
                             "--count", "7", "--metadata-uri", uri], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        r = bk(uri, "stream", "write", "live", *ns, stdin=b"".join(b"rec %d\n" % i for i in range(10)))
        assert_ok(r)
        out, err = tail.communicate(timeout=60)
    finally:
        tail.kill()
        tail.wait()
    assert tail.returncode == 0, err.decode()
    got = out.decode().splitlines()
    assert [line.split("\t")[1] for line in got] == [f"rec {i}" for i in range(7)]
    assert [line.split("\t")[0] for line in got] == r.out.splitlines()[:7]


def test_bad_positions_are_one_line_errors(cluster5: LocalCluster) -> None:
    """--from and --before that are not SEQ:ENTRY:SLOT give one line and a non-zero exit."""
    uri = cluster5.metadata_uri
    assert_ok(bk(uri, "stream", "create", "pos", "--namespace", "cli-d"))
    assert_one_line_error(bk(uri, "stream", "tail", "pos", "--namespace", "cli-d", "--from", "yesterday"),
                          mentions="SEQ:ENTRY:SLOT")
    assert_one_line_error(bk(uri, "stream", "truncate", "pos", "--namespace", "cli-d", "--before", "1:2"),
                          mentions="SEQ:ENTRY:SLOT")
