"""`bk stream ...`: log streams from a shell (API.md section 6, docs/streams.md).

Every sub-command takes `--namespace NS` (default `default`). Output that scripts read:
`list --json` (a JSON array of names), `describe --json` (an object with `name` and
`segments`), `write` (one position per input line, in order), `tail` (`POSITION<TAB>DATA`,
or one JSON object per record with --json). `tail` flushes every record: it is read
through pipes while it follows a live writer.
"""
from __future__ import annotations

import argparse
import base64
import json
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from rich.table import Table

from bookkeeper.cli.common import metadata_uri, out
from bookkeeper.stream import Namespace, Position

WRITE_CHUNK = 1000  # stdin lines per write_batch


def _with_namespace(fn: Callable[..., Coroutine[Any, Any, int]]) -> Callable[[argparse.Namespace], int]:
    """Run an async command body with the namespace connected, on uvloop."""
    def run(args: argparse.Namespace) -> int:
        import uvloop

        async def main() -> int:
            async with await Namespace.connect(metadata_uri(args), args.namespace) as ns:
                return await fn(ns, args)
        return uvloop.run(main())
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
    table = Table("seq", "ledger", "state", "first txid", "last txid", "records", "bytes", title=f"stream {d['name']}")
    for s in d["segments"]:
        table.add_row(str(s["seq"]), str(s["ledger_id"]), s["state"], str(s["first_txid"]), str(s["last_txid"]),
                      f"{s['records']:,}", f"{s['bytes']:,}")
    out.print(table)
    out.print(f"namespace {d['namespace']}, {d['ensemble']}/{d['write_quorum']}/{d['ack_quorum']}, retention: "
              f"max age {d['retention_max_age_s'] or 'off'} s, max bytes {d['retention_max_bytes'] or 'off'}; "
              f"writer: {d['writer'] or 'none'}", soft_wrap=True)
    return 0


@_with_namespace
async def cmd_write(ns: Namespace, args: argparse.Namespace) -> int:
    """Each stdin line (without its line ending) is one record; positions print in order."""
    settings = {k: v for k, v in (("segment_max_records", args.segment_max_records),
                                  ("segment_max_bytes", args.segment_max_bytes)) if v is not None}
    async with await ns.open_writer(args.name, compression=args.compression, **settings) as w:
        chunk: list[bytes] = []
        for line in sys.stdin.buffer:
            chunk.append(line.removesuffix(b"\n").removesuffix(b"\r"))
            if len(chunk) == WRITE_CHUNK:
                _print_positions(await w.write_batch(chunk))
                chunk = []
        if chunk:
            _print_positions(await w.write_batch(chunk))
    return 0


def _print_positions(positions: list[Position]) -> None:
    sys.stdout.write("".join(f"{p}\n" for p in positions))
    sys.stdout.flush()


@_with_namespace
async def cmd_tail(ns: Namespace, args: argparse.Namespace) -> int:
    start: str | Position = args.start if args.start in ("earliest", "latest") else Position.parse(args.start)
    if args.count is not None and args.count <= 0:
        return 0
    n = 0
    async with await ns.open_reader(args.name, start, follow=not args.no_follow) as r:
        async for rec in r:
            if args.json:
                line = json.dumps({"position": str(rec.position), "txid": rec.txid,
                                   "data_b64": base64.b64encode(rec.data).decode()})
            else:
                line = f"{rec.position}\t{rec.data.decode('utf-8', 'backslashreplace')}"
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
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
        p.add_argument("--namespace", default="default", help="the streams' namespace (default: default)")
        if named:
            p.add_argument("name")
        p.set_defaults(func=fn)
        return p

    p = parser("create", cmd_create, "create a stream")
    p.add_argument("--retention-max-age-s", type=float, default=None)
    p.add_argument("--retention-max-bytes", type=int, default=None)
    p.add_argument("--ensemble", "-e", type=int, default=3)
    p.add_argument("--write-quorum", "-w", type=int, default=2)
    p.add_argument("--ack-quorum", "-a", type=int, default=2)
    parser("list", cmd_list, "stream names", named=False).add_argument("--json", action="store_true")
    parser("describe", cmd_describe, "segments, sizes and states").add_argument("--json", action="store_true")
    p = parser("write", cmd_write, "one record per stdin line; prints each record's position")
    p.add_argument("--segment-max-records", type=int, default=None)
    p.add_argument("--segment-max-bytes", type=int, default=None)
    p.add_argument("--compression", choices=["none", "zstd"], default="none")
    p = parser("tail", cmd_tail, "print records (POSITION<TAB>DATA), following the writer")
    p.add_argument("--from", dest="start", default="earliest", help="earliest | latest | SEQ:ENTRY:SLOT")
    p.add_argument("--count", type=int, default=None, help="stop after N records")
    p.add_argument("--no-follow", action="store_true", help="stop at the current end")
    p.add_argument("--json", action="store_true", help='one {"position", "txid", "data_b64"} object per line')
    parser("truncate", cmd_truncate, "delete whole segments before a position").add_argument(
        "--before", required=True, help="SEQ:ENTRY:SLOT: the segment holding it stays")
    parser("delete", cmd_delete, "delete a stream and its ledgers")
