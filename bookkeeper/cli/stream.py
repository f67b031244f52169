"""`bk stream ...`: log streams from a shell (docs/api.md section 6, docs/streams.md).

Every sub-command takes `--namespace NS` (default `default`). Output that scripts read:
`list --json` (a JSON array of names), `describe --json` (an object with `name` and
`segments`), `write` (one position per input line, in order), `tail` (`POSITION<TAB>DATA`,
or one JSON object per record with --json). `tail` flushes every record: it is read
through pipes while it follows a live writer. `write` reads stdin on a thread of its own
and writes whatever lines have arrived (up to WRITE_CHUNK per write_batch), so a person
typing, or a slow producer, sees each position as soon as its line is acknowledged instead
of after a thousand lines or end of input. A reader of stdout that goes away (`| head`)
ends the command quietly with exit 141, as SIGPIPE ends other tools.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import json
import os
import sys
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from bookkeeper.cli.common import UsageError, cli_table, client_settings, metadata_uri, out
from bookkeeper.stream import Namespace, Position

WRITE_CHUNK = 1000  # stdin lines per write_batch
READ_BYTES = 1 << 20  # one read of stdin
READ_AHEAD = 16  # reads of stdin queued while the writer is busy (bounds memory on a fast producer)
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell shows for a tool stopped by `| head`


class _StdoutClosed(Exception):
    """Whoever read stdout has gone: stop quietly."""


def _emit(text: str) -> None:
    """Write and flush stdout now (a pipe to a person or a test sees every line at once)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush is silent.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise _StdoutClosed from None


def _with_namespace(fn: Callable[..., Coroutine[Any, Any, int]]) -> Callable[[argparse.Namespace], int]:
    """Run an async command body with the namespace connected, on uvloop."""
    def run(args: argparse.Namespace) -> int:
        import uvloop

        async def main() -> int:
            async with await Namespace.connect(metadata_uri(args), args.namespace, **client_settings()) as ns:
                return await fn(ns, args)
        try:
            return uvloop.run(main())
        except _StdoutClosed:
            return EXIT_BROKEN_PIPE
    return run


@_with_namespace
async def cmd_create(ns: Namespace, args: argparse.Namespace) -> int:
    await ns.create_stream(args.name, retention_max_age_s=args.retention_max_age_s,
                           retention_max_bytes=args.retention_max_bytes, ensemble=args.ensemble,
                           write_quorum=args.write_quorum, ack_quorum=args.ack_quorum)
    out.print(f"created stream {args.name} in namespace {ns.name}")
    return 0


@_with_namespace
async def cmd_list(ns: Namespace, args: argparse.Namespace) -> int:
    names = await ns.list_streams()
    if args.json:
        print(json.dumps(names))
    else:
        for name in names:
            print(name)
    return 0


@_with_namespace
async def cmd_describe(ns: Namespace, args: argparse.Namespace) -> int:
    d = await ns.describe(args.name)
    if args.json:
        print(json.dumps(d))
        return 0
    table = cli_table("seq", "ledger", "state", "first txid", "last txid", "records", "bytes", title=f"stream {d['name']}")
    for s in d["segments"]:
        table.add_row(str(s["seq"]), str(s["ledger_id"]), s["state"], str(s["first_txid"]), str(s["last_txid"]),
                      f"{s['records']:,}", f"{s['bytes']:,}")
    out.print(table)
    age, size = d["retention_max_age_s"], d["retention_max_bytes"]
    out.print(f"namespace {d['namespace']}, E/Qw/Qa {d['ensemble']}/{d['write_quorum']}/{d['ack_quorum']}, "
              f"retention: max age {'off' if age is None else f'{age:g} s'}, "
              f"max bytes {'off' if size is None else f'{size:,}'}; writer: {d['writer'] or 'none'}", soft_wrap=True)
    return 0


def cmd_write(args: argparse.Namespace) -> int:
    """Each stdin line (without its line ending) is one record; positions print in order."""
    if sys.stdin is None:  # fd 0 was closed at start: the client's sockets may reuse it
        raise UsageError("stdin is closed: give the records on stdin, one per line")
    return _write(args)


@_with_namespace
async def _write(ns: Namespace, args: argparse.Namespace) -> int:
    settings = {k: v for k, v in (("segment_max_records", args.segment_max_records),
                                  ("segment_max_bytes", args.segment_max_bytes)) if v is not None}
    async with await ns.open_writer(args.name, compression=args.compression, **settings) as w:
        async for lines in stdin_lines(0):  # fd 0: sys.stdin may be None
            for start in range(0, len(lines), WRITE_CHUNK):
                positions = await w.write_batch(lines[start:start + WRITE_CHUNK])
                _emit("".join(f"{p}\n" for p in positions))
    return 0


async def stdin_lines(fd: int) -> AsyncIterator[list[bytes]]:
    """Lists of the complete lines read so far from `fd`, each without its line ending, until
    end of input (a last line without a newline is a line too).

    A daemon thread does the blocking reads (os.read: a pipe, a terminal or a file alike, and
    no lock of sys.stdin held should the process exit while it waits); the event loop keeps
    serving the writer meanwhile, and a bounded queue holds the thread back from a producer
    faster than the writer.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes | OSError] = asyncio.Queue(READ_AHEAD)

    def read_all() -> None:
        while True:
            try:
                data: bytes | OSError = os.read(fd, READ_BYTES)
            except OSError as e:
                data = e
            try:
                asyncio.run_coroutine_threadsafe(queue.put(data), loop).result()
            except (RuntimeError, concurrent.futures.CancelledError):
                return  # the command ended first and its loop is closing: nobody to hand it to
            if not data or isinstance(data, OSError):
                return
    threading.Thread(target=read_all, name="stdin-reader", daemon=True).start()
    partial, eof = b"", False
    while not eof:
        chunks: list[bytes] = []
        item = await queue.get()
        while True:
            if isinstance(item, OSError):
                raise UsageError(f"cannot read stdin: {item.strerror or item}")
            chunks.append(item)
            eof = item == b""
            if eof or queue.empty():
                break
            item = queue.get_nowait()
        lines = (partial + b"".join(chunks)).split(b"\n")
        partial = lines.pop()
        if eof and partial:
            lines.append(partial)
        if lines:
            yield [line[:-1] if line.endswith(b"\r") else line for line in lines]


@_with_namespace
async def cmd_tail(ns: Namespace, args: argparse.Namespace) -> int:
    """Print records from --from on: until --count of them, the current end (--no-follow) or Ctrl-C."""
    start: str | Position = args.start if args.start in ("earliest", "latest") else Position.parse(args.start)
    if args.count is not None and args.count < 0:
        raise UsageError(f"--count must be >= 0, got {args.count}")
    n = 0
    async with await ns.open_reader(args.name, start, follow=not args.no_follow) as r:
        if args.count == 0:
            return 0
        async for rec in r:
            if args.json:
                line = json.dumps({"position": str(rec.position), "txid": rec.txid,
                                   "data_b64": base64.b64encode(rec.data).decode()})
            else:
                line = f"{rec.position}\t{rec.data.decode('utf-8', 'backslashreplace')}"
            _emit(line + "\n")
            n += 1
            if args.count is not None and n >= args.count:
                break
    return 0


@_with_namespace
async def cmd_truncate(ns: Namespace, args: argparse.Namespace) -> int:
    deleted = await ns.truncate(args.name, before=Position.parse(args.before))
    out.print(f"deleted {len(deleted)} segment(s){': ' + ', '.join(map(str, deleted)) if deleted else ''}")
    return 0


@_with_namespace
async def cmd_delete(ns: Namespace, args: argparse.Namespace) -> int:
    await ns.delete_stream(args.name)
    out.print(f"deleted stream {args.name}")
    return 0


def add_stream_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    """`bk stream create|list|describe|write|tail|truncate|delete`."""
    s = sub.add_parser("stream", parents=[common], help="log streams (docs/streams.md)")
    ssub = s.add_subparsers(dest="stream_command", required=True)

    def parser(name: str, fn: Callable[[argparse.Namespace], int], help_: str, *, named: bool = True) -> Any:
        p = ssub.add_parser(name, parents=[common], help=help_)
        p.add_argument("--namespace", default="default", metavar="NS", help="the streams' namespace (default: default)")
        if named:
            p.add_argument("name", metavar="NAME", help="the stream's name")
        p.set_defaults(func=fn)
        return p

    p = parser("create", cmd_create, "create a stream")
    p.add_argument("--retention-max-age-s", type=float, default=None, metavar="SECONDS",
                   help="delete whole segments older than this (default: kept)")
    p.add_argument("--retention-max-bytes", type=int, default=None, metavar="BYTES",
                   help="delete the oldest whole segments beyond this size (default: kept)")
    p.add_argument("--ensemble", "-e", type=int, default=3, metavar="E", help="bookies per segment (default 3)")
    p.add_argument("--write-quorum", "-w", type=int, default=2, metavar="QW", help="copies of each entry (default 2)")
    p.add_argument("--ack-quorum", "-a", type=int, default=2, metavar="QA",
                   help="acknowledgements a write waits for (default 2)")
    parser("list", cmd_list, "stream names", named=False).add_argument(
        "--json", action="store_true", help="a JSON array of names")
    parser("describe", cmd_describe, "segments, sizes and states").add_argument(
        "--json", action="store_true", help='one object: "name", the settings, "segments"')
    p = parser("write", cmd_write, "one record per stdin line; prints each record's position")
    p.add_argument("--segment-max-records", type=int, default=None, metavar="N",
                   help="roll to a new segment after N records")
    p.add_argument("--segment-max-bytes", type=int, default=None, metavar="BYTES",
                   help="roll to a new segment after this many bytes")
    p.add_argument("--compression", choices=["none", "zstd"], default="none",
                   help="compress record sets (default none)")
    p = parser("tail", cmd_tail, "print records (POSITION<TAB>DATA), following the writer")
    p.add_argument("--from", dest="start", default="earliest", metavar="START",
                   help="earliest | latest | SEQ:ENTRY:SLOT (default earliest)")
    p.add_argument("--count", type=int, default=None, metavar="N", help="stop after N records")
    p.add_argument("--no-follow", action="store_true", help="stop at the current end")
    p.add_argument("--json", action="store_true", help='one {"position", "txid", "data_b64"} object per line')
    parser("truncate", cmd_truncate, "delete whole segments before a position").add_argument(
        "--before", required=True, metavar="POSITION", help="SEQ:ENTRY:SLOT: the segment holding it stays")
    parser("delete", cmd_delete, "delete a stream and its ledgers")
