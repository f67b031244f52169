"""`bk`: the command line of bookies, ledgers and the local sandbox (docs/api.md section 2).

User errors print one line on stderr and exit non-zero; no traceback, and no log
lines from client commands unless -v is given. `--metadata-uri` (env
BK_METADATA_URI) is accepted before or after the sub-command.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from bookkeeper import extras
from bookkeeper.bookie.admin_client import AdminHTTPError, admin_error_text, admin_request, admin_trust, split_host_port
from bookkeeper.cli.common import UsageError, cli_table, client_settings, err, error_line, metadata_uri, out
from bookkeeper.cli.metadata import add_metadata_parsers
from bookkeeper.cli.security import add_security_parsers
from bookkeeper.cli.stream import add_stream_parsers
from bookkeeper.cli.sim import add_sim_parser
from bookkeeper.cli.verify import add_verify_parsers
from bookkeeper.cli.zk import add_zk_parsers
from bookkeeper.errors import BKError


def _with_client(fn: Callable[..., Coroutine[Any, Any, int]]) -> Callable[[argparse.Namespace], int]:
    """Run an async command body with a connected client on uvloop."""
    def run(args: argparse.Namespace) -> int:
        import uvloop

        from bookkeeper import BookKeeper

        async def main() -> int:
            async with await BookKeeper.connect(metadata_uri(args), **client_settings()) as bk:
                return await fn(bk, args)
        return uvloop.run(main())
    return run


# -- bookies ---------------------------------------------------------------------
@_with_client
async def cmd_bookies_list(bk: Any, args: argparse.Namespace) -> int:
    await bk.refresh_bookies()
    regs = await bk.metadata_call(lambda: bk.store.get_bookies(readonly=True)) if args.readonly else \
        await bk.metadata_call(bk.store.get_bookies)
    rows = [{"bookie_id": bid, "rack": info.get("rack", ""), "readonly": bool(info.get("readonly", args.readonly)),
             "shards": [{"host": s["host"], "port": s["port"]} for s in info.get("shards", [])]}
            for bid, info in sorted(regs.items())]
    if args.json:
        print(json.dumps(rows))
        return 0
    table = cli_table("bookie id", "rack", "readonly", "shards")
    for r in rows:
        table.add_row(r["bookie_id"], r["rack"], str(r["readonly"]),
                      " ".join(f"{s['host']}:{s['port']}" for s in r["shards"]))
    out.print(table)
    return 0


@_with_client
async def cmd_bookies_can_stop(bk: Any, args: argparse.Namespace) -> int:
    """Exit 0 if stopping the bookie leaves every open ledger's writer a replacement, else 1.

    Reads the metadata of every ledger, in one pipelined pass (largest_open_ensemble): an
    operator's check before a restart, not something to run in a loop.
    """
    from bookkeeper.client.core.placement import stop_refusal

    writable = set(await bk.metadata_call(bk.store.get_bookies))
    largest = await largest_open_ensemble(bk)
    reason = stop_refusal(args.bookie_id, writable, largest_open_ensemble=largest, min_writable=args.min_writable)
    if args.json:
        print(json.dumps({"bookie_id": args.bookie_id, "can_stop": reason is None, "reason": reason,
                          "other_writable": len(writable - {args.bookie_id}), "largest_open_ensemble": largest}))
    elif reason is None:
        print(f"{args.bookie_id} can stop: {len(writable - {args.bookie_id})} other writable bookie(s), "
              f"largest open ensemble {largest}")
    if reason is not None:
        error_line(f"bk: {reason}")
        return 1
    return 0


SCAN_BATCH = 1000  # ledgers whose metadata one pipelined read fetches (bounds what a scan holds)


async def largest_open_ensemble(bk: Any) -> int:
    """The largest ensemble of an open ledger (0: none open), from one pass over every ledger's
    metadata. Why this shape: there is no index of open ledgers, so each ledger is read once,
    but ids come a bucket at a time (BookKeeper.list_ledgers) and each batch of SCAN_BATCH is
    one pipelined read (ZkMetadataStore.read_ledgers): ~N/SCAN_BATCH round trips plus one per
    bucket instead of one per ledger, and at most a bucket's ids and a batch's metadata held."""
    largest = 0
    async with contextlib.aclosing(bk.list_ledgers()) as ids:
        batch: list[int] = []
        async for lid in ids:
            batch.append(lid)
            if len(batch) == SCAN_BATCH:
                largest = max(largest, await _largest_open(bk, batch))
                batch = []
    return max(largest, await _largest_open(bk, batch)) if batch else largest


async def _largest_open(bk: Any, ledger_ids: list[int]) -> int:
    mds = await bk.metadata_call(bk.store.read_ledgers, ledger_ids)  # None: deleted meanwhile
    return max((md.ensemble_size for md in mds if md is not None and not md.is_closed), default=0)


# -- ledgers ---------------------------------------------------------------------
def cmd_ledgers_list(args: argparse.Namespace) -> int:
    """Ledger ids >= --from, ascending, printed as they are listed: plain (one per line), the
    count alone (--count) or one JSON array (--json). Bad numbers are refused before connecting."""
    for option, value in (("--from", args.from_), ("--limit", args.limit)):
        if value is not None and value < 0:
            raise UsageError(f"{option} must be >= 0, got {value}")
    return _ledgers_list(args)


@_with_client
async def _ledgers_list(bk: Any, args: argparse.Namespace) -> int:
    async with contextlib.aclosing(_listed(bk, args)) as ids:
        if args.count:
            n = 0
            async for _ in ids:
                n += 1
            print(n)
        elif args.json:
            await _print_json_array(ids)
        else:
            async for lid in ids:
                sys.stdout.write(f"{lid}\n")
    return 0


async def _listed(bk: Any, args: argparse.Namespace) -> AsyncIterator[int]:
    """The ids `bk ledgers list` prints. Why streamed and closed early: BookKeeper.list_ledgers
    reads one bucket (<= 10^4 ids) at a time, so the first id comes after a few ZooKeeper reads
    at any size and memory stays flat; --limit (or a reader that went away, `| head`) ends the
    listing itself, so the buckets past it are never read."""
    if args.limit == 0:
        return
    async with contextlib.aclosing(bk.list_ledgers(start=args.from_)) as ids:
        n = 0
        async for lid in ids:
            yield lid
            n += 1
            if n == args.limit:
                return


async def _print_json_array(ids: AsyncIterator[int]) -> None:
    """One JSON array written as the ids come, one per line (`[`, `1,`, `2`, `]`; `[]` when
    empty): valid JSON for a parser that reads it whole, never all of it in memory here."""
    sep = "[\n"
    async for lid in ids:
        sys.stdout.write(f"{sep}{lid}")
        sep = ",\n"
    sys.stdout.write("[]\n" if sep == "[\n" else "\n]\n")


@_with_client
async def cmd_ledger_metadata(bk: Any, args: argparse.Namespace) -> int:
    md = await bk.ledger_metadata(args.ledger_id)
    print(json.dumps(md.to_json_dict(), indent=2))
    return 0


@_with_client
async def cmd_ledger_read(bk: Any, args: argparse.Namespace) -> int:
    password = None if args.password is None else args.password.encode()
    lh = await bk.open_ledger(args.ledger_id, password=password or b"", recovery=False,
                              verify_password=password is not None)
    last = lh.last_add_confirmed if args.to is None else args.to
    first = args.from_
    if last < first:
        return 0
    step = 1000
    for start in range(first, last + 1, step):
        for e in await lh.read(start, min(last, start + step - 1)):
            if args.json:
                print(json.dumps({"entry_id": e.entry_id, "data_b64": base64.b64encode(e.data).decode()}))
            else:
                print(f"{e.entry_id}\t{e.data.decode('utf-8', 'backslashreplace')}")
    return 0


@_with_client
async def cmd_ledger_delete(bk: Any, args: argparse.Namespace) -> int:
    await bk.delete_ledger(args.ledger_id)
    err.print(f"deleted ledger {args.ledger_id}")
    return 0


@_with_client
async def cmd_simpletest(bk: Any, args: argparse.Namespace) -> int:
    return await simpletest(bk, ensemble=args.ensemble, write_quorum=args.write_quorum,
                            ack_quorum=args.ack_quorum, entries=args.entries, entry_size=args.entry_size)


async def simpletest(bk: Any, *, ensemble: int, write_quorum: int, ack_quorum: int, entries: int,
                     entry_size: int = 100, quiet: bool = False, window: int = 10_000) -> int:
    """Create, write N entries (pipelined), read back, verify, delete. Non-zero on any mismatch."""
    if entries < 1:
        raise UsageError("--entries must be >= 1")
    lh = await bk.create_ledger(ensemble=ensemble, write_quorum=write_quorum, ack_quorum=ack_quorum,
                                password=b"simpletest")

    def payload(i: int) -> bytes:
        return f"{i:010d}".encode().ljust(entry_size, b".")[:max(entry_size, 10)]

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeRemainingColumn(), console=err, transient=True, disable=quiet)
    with progress:
        task = progress.add_task("write", total=entries)
        t0 = time.perf_counter()
        inflight: list[asyncio.Future[int]] = []
        for i in range(entries):
            inflight.append(lh.add_entry_async(payload(i)))
            if len(inflight) >= window:
                ids = await asyncio.gather(*inflight)
                if ids != list(range(ids[0], ids[0] + len(ids))):
                    err.print("[red]acknowledged ids are not contiguous[/]")
                    return 1
                inflight = []
                progress.update(task, completed=i + 1)
        await asyncio.gather(*inflight)
        write_s = time.perf_counter() - t0
        await lh.close()
        progress.update(task, completed=entries)
        rh = await bk.open_ledger(lh.ledger_id, password=b"simpletest")
        task = progress.add_task("read", total=entries)
        t1 = time.perf_counter()
        bad = 0
        for start in range(0, entries, 5000):
            got = await rh.read(start, min(entries - 1, start + 4999))
            bad += sum(1 for e in got if e.data != payload(e.entry_id))
            progress.update(task, completed=start + len(got))
        read_s = time.perf_counter() - t1
    await bk.delete_ledger(lh.ledger_id)
    if rh.last_add_confirmed != entries - 1 or bad:
        err.print(f"[red]simpletest failed[/]: lac={rh.last_add_confirmed} expected {entries - 1}, {bad} mismatches")
        return 1
    if not quiet:
        table = cli_table("ledger", "E/Qw/Qa", "entries", "write entries/s", "read entries/s")
        table.add_row(str(lh.ledger_id), f"{ensemble}/{write_quorum}/{ack_quorum}", str(entries),
                      f"{entries / write_s:,.0f}", f"{entries / read_s:,.0f}")
        out.print(table)
    return 0


# -- auto-recovery (docs/autorecovery.md) -------------------------------------------
def _urm(bk: Any) -> Any:
    from bookkeeper.meta.underreplication import UnderReplicationManager

    return UnderReplicationManager(bk.store)


def cmd_autorecovery_run(args: argparse.Namespace) -> int:
    """An auditor candidate and a replication worker in the foreground, until SIGTERM/SIGINT."""
    from bookkeeper.autorecovery import AutoRecoveryService
    from bookkeeper.client.config import ClientConfig
    from bookkeeper.meta.zk import ZkMetadataStore
    from bookkeeper.meta.zk_security import zk_security_from

    uri = metadata_uri(args)
    security = zk_security_from(ClientConfig(**client_settings()).validate())
    ZkMetadataStore(uri, create=False, security=security).close()  # a wrong URI or credential fails now
    logging.getLogger().setLevel(logging.INFO)
    service = AutoRecoveryService(uri, client_kwargs=client_settings(), lost_bookie_delay_s=args.lost_bookie_delay_s,
                                  open_ledger_rereplication_grace_s=args.open_ledger_grace_s,
                                  audit_interval_s=args.audit_interval_s)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    service.start()
    err.print(f"auto-recovery running (pid {os.getpid()}); SIGTERM or Ctrl-C stops it")
    while not stop.wait(0.5):
        pass
    service.stop()
    return 0


@_with_client
async def cmd_autorecovery_status(bk: Any, args: argparse.Namespace) -> int:
    """What ZooKeeper says: the flag, the auditor, the marks, the locks, absent bookies."""
    urm = _urm(bk)
    store = bk.store

    def look() -> dict[str, Any]:
        # The object every bookie's /api/v1/autorecovery/status answers, then what only this view adds.
        status = urm.status()
        candidates = urm.candidates()
        node = urm.candidate_info(candidates[0]) if candidates else None
        writable, readonly = store.bookie_ids(), store.bookie_ids(readonly=True)
        return {**status, "under_replicated": status["underreplicated"],
                "auditor_node": {"node": candidates[0], **node} if node else None,
                "candidates": len(candidates), "locked": urm.locked_count(),
                "bookies": {"writable": sorted(writable), "readonly": sorted(readonly),
                            "absent": sorted(set(store.list_cookies()) - writable - readonly)}}
    status = await bk.metadata_call(look)
    if args.json:
        print(json.dumps(status))
        return 0
    table = cli_table("", "")
    table.add_row("enabled", str(status["enabled"]))
    a = status["auditor_node"]
    table.add_row("auditor", f"{status['auditor']} ({a['node']} on {a.get('hostname')}, pid {a.get('pid')})"
                  if a else status["auditor"] or "none elected")
    table.add_row("candidates", str(status["candidates"]))
    table.add_row("under-replicated ledgers", str(status["under_replicated"]))
    table.add_row("ledgers being replicated", str(status["locked"]))
    for kind in ("writable", "readonly", "absent"):
        table.add_row(f"bookies {kind}", " ".join(status["bookies"][kind]) or "-")
    out.print(table)
    return 0


@_with_client
async def cmd_autorecovery_enable(bk: Any, args: argparse.Namespace) -> int:
    await bk.metadata_call(_urm(bk).set_enabled, args.autorecovery_cmd == "enable")
    print(f"auto-recovery {args.autorecovery_cmd}d")
    return 0


@_with_client
async def cmd_autorecovery_list(bk: Any, args: argparse.Namespace) -> int:
    """Under-replicated ledgers and the bookies each misses."""
    urm = _urm(bk)

    def marks() -> list[dict[str, Any]]:
        found = (urm.get_mark(lid) for lid in urm.marked_ledgers())
        return [m.to_json() for m in found if m is not None]
    rows = await bk.metadata_call(marks)
    if args.json:
        print(json.dumps(rows))
        return 0
    table = cli_table("ledger", "missing", "forced", "marked")
    for r in rows:
        table.add_row(str(r["ledger_id"]), " ".join(r["missing"]), " ".join(r["forced"]) or "-",
                      time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["marked_ms"] / 1000)))
    out.print(table)
    return 0


def _print_ledger(result: Any) -> None:
    what = "deleted meanwhile" if result.outcome.value == "gone" else "done"
    print(f"ledger {result.ledger_id}: {what} ({result.fragments} fragment(s), {result.entries} entries copied by "
          f"this command, {result.seconds:.2f} s)", flush=True)


def _print_note(message: str) -> None:
    print(message, flush=True)


def _check_bookie_id(bookie_id: str) -> None:
    """A bookie id is a znode name (docs/metadata.md): refuse what cannot be one, before any read."""
    if not bookie_id.strip() or "/" in bookie_id or bookie_id in ("readonly", ".", ".."):
        raise UsageError(f"not a bookie id: {bookie_id!r}")


@_with_client
async def cmd_recover(bk: Any, args: argparse.Namespace) -> int:
    """Move every copy a (dead) bookie holds to other bookies, printing each ledger."""
    from bookkeeper.autorecovery.operations import recover_bookie

    _check_bookie_id(args.bookie_id)
    summary = await recover_bookie(bk, args.bookie_id, grace_s=args.open_ledger_grace_s, timeout_s=args.timeout_s,
                                   on_ledger=_print_ledger, on_note=_print_note)
    print(f"recovered {args.bookie_id}: {summary.ledgers} ledger(s), {summary.fragments} fragment(s), "
          f"{summary.entries} entries copied in {summary.seconds:.1f} s; no ledger names it")
    return 0


@_with_client
async def cmd_decommission(bk: Any, args: argparse.Namespace) -> int:
    """Read-only, every copy moved, cookie deleted (docs/autorecovery.md, "Decommission")."""
    from bookkeeper.autorecovery.operations import decommission_bookie

    _check_bookie_id(args.bookie_id)
    cleared = await decommission_bookie(bk, args.bookie_id, grace_s=args.open_ledger_grace_s,
                                        readonly_timeout_s=args.readonly_timeout_s, timeout_s=args.timeout_s,
                                        on_ledger=_print_ledger, on_note=_print_note)
    print(f"decommissioned {args.bookie_id}: no ledger names it, its cookie is deleted")
    if not cleared:
        print(f"{args.bookie_id} is still running (read-only): stop it, then run `bk decommission {args.bookie_id}` "
              f"again to remove its decommissioning marker")
    return 0


def _host_port(text: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); anything else is a usage error."""
    try:
        return split_host_port(text)
    except ValueError:
        raise UsageError(f"--http wants HOST:PORT (the bookie's http_port), got {text!r}") from None


def _admin_request(http: str, path: str, *, method: str = "GET", timeout_s: float) -> Any:
    """One request to a bookie's admin HTTP (--http HOST:PORT) with bk's trust settings:
    BK_TLS_CA_FILE (https unless BK_TLS=off), BK_AUTH_TOKEN (a bearer token, or file:/path),
    BK_TLS_CERT_FILE/BK_TLS_KEY_FILE (mtls). Its JSON answer; an error answer is an
    AdminHTTPError, an unreachable bookie a BookieUnavailableError (one line each)."""
    _host_port(http)  # a bad address is a usage error (exit 2) before anything is sent
    return admin_request(http, method, path, timeout_s=timeout_s, **admin_trust(client_settings()))


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):,.1f} MiB"


def cmd_bookie_info(args: argparse.Namespace) -> int:
    """GET /api/v1/bookie/info: ledgers held, each dir's room and the journal pool's bytes."""
    info = _admin_request(args.http, "/api/v1/bookie/info", timeout_s=args.timeout_s)
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"bookie {info['bookie_id']}: {info['ledgers']} ledger(s)")
    for d in info["dirs"]:  # plain lines, not a table: a path is never wrapped or cut
        pool = f", journal pool {_mib(d.get('pool_bytes', 0))}" if d["kind"] == "journal" else ""
        print(f"{d['kind']:<8} {d['path']}: {_mib(d['free_bytes'])} free of {_mib(d['total_bytes'])}{pool}, "
              f"usage {d['usage']:.1%}{' (full: read-only threshold)' if d['full'] else ''}")
    print("usage counts the journal pool (trimmed files kept for reuse, the spare) as free: the bookie gives it "
          "back when the disk needs the room")
    return 0


# What a GC pass reports (POST /api/v1/bookie/gc), in the order `bk bookie gc` prints it.
GC_COUNTS = (("ledgers_deleted", "ledgers deleted"), ("logs_compacted", "entry logs compacted"),
             ("logs_deleted", "entry logs deleted"), ("entries_copied", "entries copied"))
GC_BYTES = (("bytes_copied", "bytes copied"), ("bytes_reclaimed", "bytes reclaimed"))


def gc_table(result: dict[str, Any]) -> Table:
    """A GC pass's answer as one row per figure: seven figures side by side cut their headers at
    80 columns; a column of names and one of values fits any terminal."""
    table = cli_table("figure", "value", show_header=False)
    for key, name in GC_COUNTS:
        table.add_row(name, f"{result.get(key, 0):,}")
    for key, name in GC_BYTES:
        table.add_row(name, f"{result.get(key, 0):,} ({_mib(result.get(key, 0))})")
    table.add_row("duration", f"{result.get('duration_s', 0.0):.2f} s")
    return table


EXIT_GC_BUSY = 3  # `bk bookie gc`: a forced pass already runs there (HTTP 409); a script may retry later


def cmd_bookie_gc(args: argparse.Namespace) -> int:
    """POST /api/v1/bookie/gc on a bookie's admin HTTP, wait, print what was reclaimed. A
    bookie already running a forced pass answers 409: one line, exit EXIT_GC_BUSY."""
    try:
        result = _admin_request(args.http, "/api/v1/bookie/gc", method="POST", timeout_s=args.timeout_s)
    except AdminHTTPError as e:
        if e.status != 409:  # 409: a pass is running already (one at a time)
            raise
        error_line(f"bk: bookie at {args.http}: {e.reason}")
        return EXIT_GC_BUSY
    if args.json:
        print(json.dumps(result))
        return 0
    out.print(gc_table(result))
    if result.get("shards_failed"):
        error_line(f"bk: shard(s) {result['shards_failed']} did not answer")
        return 1
    return 0


# -- servers -----------------------------------------------------------------------
def cmd_bookie(args: argparse.Namespace) -> int:
    if not args.conf:
        raise UsageError("bk bookie needs --conf FILE.toml (or a sub-command: gc, info)")
    extras.require("bookie", what="bk bookie")
    from bookkeeper.bookie.supervisor import run_bookie
    from bookkeeper.config import BookieConfig

    logging.getLogger().setLevel(logging.INFO)
    overrides = {"metadata_uri": getattr(args, "metadata_uri", None)}
    cfg = BookieConfig.load(args.conf, **overrides)
    return run_bookie(cfg)


SANDBOX_ZK_PORT = 2181  # ZooKeeper's usual port: programs written for the default URI reach the sandbox as is


def zk_port_note(*, asked: int | None, took: int, usual: int = SANDBOX_ZK_PORT) -> str | None:
    """What the sandbox says about ZooKeeper's port: nothing when it took the port asked for
    (--zk-port) or the usual one; else which port it took, and why not the usual one."""
    if asked is not None or took == usual:
        return None
    return (f"ZooKeeper's usual port {usual} is in use (another ZooKeeper or sandbox?): "
            f"took port {took}; use the URI printed below")


def _sandbox_dir(arg: str | None) -> Path:
    """--dir, emptied if it is an earlier sandbox (a sandbox starts fresh: new ports, new bookie
    ids), refused if it holds anything else; a new temporary directory without --dir."""
    directory = Path(arg) if arg else Path(tempfile.mkdtemp(prefix="bk-sandbox-"))
    marker = directory / ".bk-sandbox"
    if directory.exists() and any(directory.iterdir()):
        if not marker.exists():
            raise UsageError(f"{directory} is not empty and is not a sandbox directory: refusing to overwrite it")
        shutil.rmtree(directory)
    directory.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return directory


def _announce_sandbox(cluster: Any, uri_file: Path) -> None:
    """stdout, for people and scripts alike: a line per bookie (its id, rack, shard addresses and
    admin HTTP, as it registered them), `metadata_uri=URI` (what the Makefile and scripts read)
    and `export BK_METADATA_URI=URI` (what the examples and `bk` read); the URI also goes to
    uri_file."""
    regs = cluster.registrations()
    admin = []
    for b in cluster.bookies:
        reg = regs[b.bookie_id]
        shards = ",".join(f"{s['host']}:{s['port']}" for s in reg["shards"])
        admin.append(f"127.0.0.1:{reg['http_port']}")
        print(f"bookie {b.bookie_id} rack={reg['rack']} shards={shards} admin=http://{admin[-1]}")
    uri = cluster.metadata_uri
    uri_file.write_text(uri + "\n")
    print(f"metadata_uri={uri}")
    print(f"export BK_METADATA_URI={uri}", flush=True)
    err.print(f"sandbox is up; Ctrl-C stops it. In another shell: export BK_METADATA_URI=$(cat {uri_file}), "
              f"then bk bookies list, curl http://{admin[0]}/metrics, bk bookie gc --http {admin[0]}",
              soft_wrap=True, markup=False)


def cmd_sandbox(args: argparse.Namespace) -> int:
    extras.require("bookie", what="bk sandbox")
    import uvloop

    from bookkeeper import BookKeeper
    from bookkeeper.testing.cluster import LocalCluster

    directory = _sandbox_dir(args.dir)
    # Distinct racks, so rack-aware placement (the client's default) has what it asks for, and an
    # admin HTTP port per bookie (/metrics, /api/v1/..., bk bookie gc --http).
    cluster = LocalCluster(directory, bookies=args.bookies, shards=args.shards, zk_port=args.zk_port,
                           prefer_zk_port=None if args.zk_port else SANDBOX_ZK_PORT, http_ports=True, racks=True,
                           journal_sync=args.journal_sync)
    stop = False

    def on_signal(*_: Any) -> None:
        nonlocal stop
        stop = True
    # Ctrl-C and SIGTERM only raise a flag: the cleanup below always runs to the end, however
    # many signals arrive (a KeyboardInterrupt inside it would orphan the bookies).
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    note = zk_port_note(asked=args.zk_port, took=cluster.zk.port)
    if note:
        err.print(note, soft_wrap=True, markup=False)
    err.print(f"starting ZooKeeper on port {cluster.zk.port} and {args.bookies} bookies under {directory} ...",
              markup=False)
    uri_file = directory / "metadata_uri"
    cluster.start()
    try:
        async def smoke() -> int:
            async with await BookKeeper.connect(cluster.metadata_uri) as bk:
                return await simpletest(bk, ensemble=min(3, args.bookies), write_quorum=min(2, args.bookies),
                                        ack_quorum=min(2, args.bookies), entries=1000, quiet=True)
        if stop:
            return 130
        if uvloop.run(smoke()) != 0:
            err.print("[red]smoke test failed[/]")
            return 1
        err.print("smoke test passed: wrote and read back a ledger of 1000 entries")
        _announce_sandbox(cluster, uri_file)
        while not stop:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        err.print("stopping sandbox ...")
        uri_file.unlink(missing_ok=True)  # while it exists, the sandbox it names is up
        cluster.stop()
    return 0


# -- bench -------------------------------------------------------------------------
def _handle_driver(args: argparse.Namespace) -> str:
    """client and cluster drive write handles: every driver but raw (a bookie-only load generator)."""
    if args.driver == "raw":
        raise UsageError(f"--driver raw applies to bench bookie only; {args.bench} takes client, callback or batch")
    return args.driver or "client"


def _check_neighbour(args: argparse.Namespace) -> None:
    """bench neighbour's own numbers, refused before a cluster is started."""
    if args.bulk_rate < 0:
        raise UsageError(f"--bulk-rate must be >= 0 (0: 40% of the measured peak), got {args.bulk_rate}")
    if args.bulk_size < 1:
        raise UsageError(f"--bulk-size must be >= 1, got {args.bulk_size}")


def cmd_bench(args: argparse.Namespace) -> int:
    """Run one benchmark family; a table for people, one JSON object with --json."""
    if args.bench == "ledgers":
        from bookkeeper.bench.ledgers import run_ledgers_cli
        return run_ledgers_cli(args)
    from bookkeeper.bench import self_rss
    from bookkeeper.bench.cluster import bookie_bench, cluster_bench, read_bench
    from bookkeeper.bench.journal import SIZES, run_journal
    from bookkeeper.bench.limits import run_limits

    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bk-bench-", dir=directory))
    sizes = tuple(args.size) if args.size else None
    window = args.window or (4000 if args.bench == "cluster" else 1000)
    with err.status(f"bk bench {args.bench} ...", spinner="dots") if not args.json else _null():
        try:
            if args.bench == "limits":
                results = run_limits(str(work), args.seconds)
            elif args.bench == "journal":
                results = run_journal(str(work), args.seconds, sync=args.sync, sizes=sizes or SIZES,
                                      window=window, reuse_files=args.journal_reuse_files)
            elif args.bench == "bookie" and args.in_shard:
                from bookkeeper.bench.shard import in_shard_bench
                results = [in_shard_bench(str(work), shards=s, size=(sizes or (100,))[0], seconds=args.seconds / 2,
                                          window=window, sync=args.sync) for s in (args.shards or [1, 2])]
            elif args.bench == "bookie":
                results = [r for s in (args.shards or [2])
                           for r in bookie_bench(str(work), shards=s, size=(sizes or (100,))[0],
                                                 seconds=args.seconds / len(args.shards or [2]),
                                                 window=window,
                                                 open_loop_rate=args.rate, sync=args.sync,
                                                 driver=args.driver or "raw")]
            elif args.bench == "client":
                from bookkeeper.bench.client import client_bench
                results = client_bench(size=(sizes or (100,))[0], seconds=args.seconds / 2, window=window,
                                       driver=_handle_driver(args))
            elif args.bench == "spark":
                from bookkeeper.bench.spark import spark_bench
                results = spark_bench(str(work), sync=args.sync, scale=args.scale)
            elif args.bench == "stream":
                from bookkeeper.bench.stream import stream_bench
                results = stream_bench(str(work), size=(sizes or (100,))[0], seconds=args.seconds, batch=args.batch,
                                       sync=args.sync)
            elif args.bench == "neighbour":
                from bookkeeper.bench.neighbour import neighbour_bench
                _check_neighbour(args)
                results = neighbour_bench(str(work), seconds=args.seconds, bulk_rate=args.bulk_rate,
                                          bulk_size=args.bulk_size, sync=args.sync)
            elif args.bench == "cluster":
                results = cluster_bench(str(work), size=(sizes or (100,))[0], seconds=args.seconds * 0.6,
                                        window=window, sync=args.sync, driver=_handle_driver(args), tls=args.tls,
                                        sizes=sizes)
            else:
                results = [read_bench(str(work), size=(sizes or (4096,))[0], entries=args.entries, sync=args.sync)]
        finally:
            shutil.rmtree(work, ignore_errors=True)
    first = results[0].to_json()
    if args.json:
        print(json.dumps({**first, "bench": args.bench, "results": [r.to_json() for r in results],
                          "client_peak_rss_mb": self_rss()}))
        return 0
    table = cli_table("benchmark", "ops/s", "MB/s", "p50 ms", "p99 ms", "p99.9 ms")
    for r in results:
        table.add_row(r.name, f"{r.ops_per_s:,.0f}", f"{r.mb_per_s:,.2f}", str(r.latency["p50"]),
                      str(r.latency["p99"]), str(r.latency["p999"]))
    out.print(table)
    for r in results:
        notes = {k: v for k, v in r.extra.items() if k != "peak_rss_mb"}
        out.print(f"{r.name}: " + ", ".join(f"{k}={v}" for k, v in notes.items()), soft_wrap=True)
        if "peak_rss_mb" in r.extra:
            out.print(f"peak RSS (MiB) {r.name}: " + ", ".join(f"{k}={v}" for k, v in r.extra["peak_rss_mb"].items()),
                      soft_wrap=True)
    out.print("peak RSS (MiB) " + ", ".join(f"{k}={v}" for k, v in self_rss().items()))
    return 0


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# -- parser ------------------------------------------------------------------------
# Every option and positional has help text and a metavar that names what it takes (ENTRY_ID,
# SECONDS, N), not argparse's upper-cased dest (`--from FROM_`): tests/test_cli.py walks the tree.
def _add_sandbox_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("sandbox", parents=[common], help="local cluster: ZooKeeper + N bookies, foreground")
    s.add_argument("--bookies", type=int, default=3, metavar="N", help="bookies to start (default 3)")
    s.add_argument("--shards", type=int, default=None, metavar="N",
                   help="shard processes per bookie (default: the usable cores)")
    s.add_argument("--dir", default=None, metavar="DIR",
                   help="where everything goes: empty, or an earlier sandbox (wiped); default a new temporary dir")
    s.add_argument("--zk-port", type=int, default=None, metavar="PORT",
                   help=f"ZooKeeper's port (default {SANDBOX_ZK_PORT} when free, else a free one, said on stderr)")
    s.add_argument("--journal-sync", choices=["io_uring", "thread"], default="io_uring",
                   help="the bookies' journal syncer (default io_uring)")
    s.set_defaults(func=cmd_sandbox)


def _add_bookie_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """`bookie --conf F` runs a bookie; `bookie gc|info --http HOST:PORT` act on a running one."""
    s = sub.add_parser("bookie", parents=[common], help="run one bookie (--conf), or act on a running one")
    s.add_argument("--conf", default=None, metavar="FILE.toml", help="the bookie's configuration (docs/api.md section 4)")
    s.set_defaults(func=cmd_bookie)
    bsub = s.add_subparsers(dest="bookie_cmd", required=False)
    for name, fn, what, timeout_s in (
            ("gc", cmd_bookie_gc, "run a GC pass on a bookie, print what it reclaimed", 3600.0),
            ("info", cmd_bookie_info, "a bookie's ledgers, disks and journal pool", 30.0)):
        s = bsub.add_parser(name, parents=[common], help=what)
        s.add_argument("--http", required=True, metavar="HOST:PORT", help="the bookie's admin HTTP (http_port)")
        s.add_argument("--timeout-s", type=float, default=timeout_s, metavar="SECONDS",
                       help=f"how long to wait for the answer (default {timeout_s:g})")
        s.add_argument("--json", action="store_true", help="print the endpoint's JSON answer")
        s.set_defaults(func=fn)


def _add_bookies_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("bookies", parents=[common], help="registered bookies")
    bsub = s.add_subparsers(dest="bookies_cmd", required=True)
    s = bsub.add_parser("list", parents=[common], help="registered bookies with rack and shard addresses")
    s.add_argument("--readonly", action="store_true", help="the read-only bookies instead of the writable ones")
    s.add_argument("--json", action="store_true", help='an array of {"bookie_id", "rack", "readonly", "shards"}')
    s.set_defaults(func=cmd_bookies_list)
    s = bsub.add_parser("can-stop", parents=[common],
                        help="exit 0 if stopping BOOKIE_ID leaves every open ledger a replacement bookie")
    s.add_argument("bookie_id", metavar="BOOKIE_ID", help="the bookie to stop (host:port, as registered)")
    s.add_argument("--min-writable", type=int, default=1, metavar="N",
                   help="other writable bookies needed at least (default 1)")
    s.add_argument("--json", action="store_true", help="one JSON object with the answer and the reason")
    s.set_defaults(func=cmd_bookies_can_stop)


def _add_ledger_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("ledgers", parents=[common], help="ledger listing")
    lsub = s.add_subparsers(dest="ledgers_cmd", required=True)
    s = lsub.add_parser("list", parents=[common], help="ledger ids in ascending order, one per line, streamed")
    s.add_argument("--from", dest="from_", type=int, default=0, metavar="ID",
                   help="start at the first ledger id >= ID (default 0)")
    s.add_argument("--limit", type=int, default=None, metavar="N",
                   help="at most N ids; the listing stops there (default: all)")
    s.add_argument("--count", action="store_true",
                   help="print only how many ids there are (after --from and --limit)")
    s.add_argument("--json", action="store_true",
                   help="one JSON array, written as it is listed (one id per line)")
    s.set_defaults(func=cmd_ledgers_list)

    s = sub.add_parser("ledger", parents=[common], help="one ledger: metadata, entries, deletion")
    lsub = s.add_subparsers(dest="ledger_cmd", required=True)
    for name, fn, what in (("metadata", cmd_ledger_metadata, "the ledger's metadata as JSON"),
                           ("read", cmd_ledger_read, "entries, one ENTRY_ID<TAB>DATA line each"),
                           ("delete", cmd_ledger_delete, "delete the ledger (bookies reclaim it at their next GC)")):
        s = lsub.add_parser(name, parents=[common], help=what)
        s.add_argument("ledger_id", type=int, metavar="LEDGER_ID", help="the ledger's id")
        s.set_defaults(func=fn)
        if name != "read":
            continue
        s.add_argument("--from", dest="from_", type=int, default=0, metavar="ENTRY_ID",
                       help="first entry, inclusive (default 0)")
        s.add_argument("--to", type=int, default=None, metavar="ENTRY_ID",
                       help="last entry, inclusive (default: the last add confirmed)")
        s.add_argument("--password", default=None,
                       help="needed for MAC-digest ledgers; CRC32C ledgers are read without it (admin read)")
        s.add_argument("--json", action="store_true", help='one {"entry_id", "data_b64"} object per line')


def _add_bench_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    families = ["limits", "journal", "bookie", "cluster", "read", "client", "stream", "spark", "ledgers", "neighbour"]
    s = sub.add_parser("bench", parents=[common], help="benchmarks (figures printed, see docs/performance.md)")
    s.add_argument("bench", choices=families, metavar="FAMILY", help=" | ".join(families))
    s.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    s.add_argument("--dir", default=".", help="where data goes: put it on the device under test")
    s.add_argument("--seconds", type=float, default=20.0, help="how long to measure (default 20)")
    s.add_argument("--sync", choices=["io_uring", "thread"], default="io_uring",
                   help="the journal's syncer (default io_uring)")
    s.add_argument("--size", type=int, action="append", metavar="BYTES", help="entry bytes (repeatable for journal)")
    s.add_argument("--shards", type=int, action="append", choices=[1, 2, 3, 4], metavar="N",
                   help="bookie: shards, 1 to 4; repeat to compare")
    s.add_argument("--window", type=int, default=None, metavar="N",
                   help="closed loop: adds (journal: records) in flight; default 1000, cluster 4000 (its peak "
                        "needs the depth: one client feeding three bookies)")
    s.add_argument("--rate", type=float, default=0.0, metavar="ADDS_PER_S",
                   help="bookie: open loop at this many adds/s")
    s.add_argument("--driver", choices=["raw", "client", "callback", "batch"], default=None,
                   help="bookie (default raw): send from the client's Cython pipe (raw, lighter than a shard); "
                        "bookie, client, cluster (default client): through write handles with a future per add "
                        "(client), a callback per add (callback) or add_entries_async batches (batch)")
    s.add_argument("--tls", action="store_true",
                   help="cluster: plain, TLS and mTLS clients in one run at each --size (default 100, 1024, "
                        "65536), with CPU per add and handshake times")
    s.add_argument("--in-shard", action="store_true",
                   help="bookie: drive each shard's storage path in-process (no network, no client)")
    s.add_argument("--journal-reuse-files", type=int, default=4, metavar="N",
                   help="journal: trimmed files kept for reuse (every roll trims, as a checkpoint that keeps "
                        "up); 0: every roll takes a new zero-filled file")
    s.add_argument("--entries", type=int, default=50_000, metavar="N", help="read: entries in the cold ledger")
    s.add_argument("--batch", type=int, default=1000, metavar="N", help="stream: records per write_batch")
    s.add_argument("--scale", type=float, default=1.0, metavar="X",
                   help="spark: multiplies the ledgers' entry counts")
    s.add_argument("--bulk-rate", type=float, default=0.0, metavar="ADDS_PER_S",
                   help="neighbour: the bulk writer's open-loop rate (default 40%% of its measured peak)")
    s.add_argument("--bulk-size", type=int, default=1024, metavar="BYTES",
                   help="neighbour: the bulk writer's entry bytes (default 1024)")
    s.add_argument("--ledgers", default="10,100,1000,10000", metavar="COUNTS",
                   help="ledgers: the ledger counts to run the phases at (default 10,100,1000,10000)")
    s.add_argument("--metadata", type=int, default=0, metavar="N",
                   help="ledgers: also time a GC pass and a listing over N ledgers' metadata (e.g. 1000000)")
    s.set_defaults(func=cmd_bench)


def _add_autorecovery_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    """`autorecovery run|status|enable|disable|list`, `recover`, `decommission` (docs/autorecovery.md)."""
    s = sub.add_parser("autorecovery", parents=[common], help="auditor and replication workers (docs/autorecovery.md)")
    asub = s.add_subparsers(dest="autorecovery_cmd", required=True)
    s = asub.add_parser("run", parents=[common], help="an auditor candidate and a replication worker, foreground")
    s.add_argument("--lost-bookie-delay-s", type=float, default=30.0, metavar="SECONDS",
                   help="how long a bookie is gone before its ledgers are marked (default 30)")
    s.add_argument("--open-ledger-grace-s", type=float, default=30.0, metavar="SECONDS",
                   help="an open ledger's writer gets this long to replace the bookie itself (default 30)")
    s.add_argument("--audit-interval-s", type=float, default=5.0, metavar="SECONDS",
                   help="how often the auditor checks every ledger (default 5)")
    s.set_defaults(func=cmd_autorecovery_run)
    s = asub.add_parser("status", parents=[common], help="flag, auditor, under-replicated count, absent bookies")
    s.add_argument("--json", action="store_true", help="one JSON object (docs/api.md section 2)")
    s.set_defaults(func=cmd_autorecovery_status)
    for name in ("enable", "disable"):
        s = asub.add_parser(name, parents=[common], help=f"{name} marking and re-replication cluster-wide")
        s.set_defaults(func=cmd_autorecovery_enable)
    s = asub.add_parser("list", parents=[common], help="under-replicated ledgers")
    s.add_argument("--json", action="store_true", help='an array of {"ledger_id", "missing", "forced", "marked_ms"}')
    s.set_defaults(func=cmd_autorecovery_list)

    for name, fn, what in (("recover", cmd_recover, "move every copy a bookie holds to other bookies"),
                           ("decommission", cmd_decommission,
                            "read-only, move every copy, delete its cookie (live or stopped bookie)")):
        s = sub.add_parser(name, parents=[common], help=what)
        s.add_argument("bookie_id", metavar="BOOKIE_ID", help="the bookie (host:port, as registered)")
        s.add_argument("--open-ledger-grace-s", type=float, default=30.0, metavar="SECONDS",
                       help="an open ledger's writer gets this long to move off the bookie before it is fenced")
        s.add_argument("--timeout-s", type=float, default=3600.0, metavar="SECONDS",
                       help="give up when ledgers still name the bookie after this long (default 3600)")
        if name == "decommission":
            s.add_argument("--readonly-timeout-s", type=float, default=60.0, metavar="SECONDS",
                           help="how long a live bookie gets to turn read-only")
        s.set_defaults(func=fn)


def _add_simpletest_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("simpletest", parents=[common], help="write and read back a ledger")
    s.add_argument("--ensemble", "-e", type=int, default=3, metavar="E", help="bookies of the ledger (default 3)")
    s.add_argument("--write-quorum", "-w", type=int, default=2, metavar="QW",
                   help="copies of each entry (default 2)")
    s.add_argument("--ack-quorum", "-a", type=int, default=2, metavar="QA",
                   help="acknowledgements an add waits for (default 2)")
    s.add_argument("--entries", "-n", type=int, default=100, metavar="N", help="entries to write (default 100)")
    s.add_argument("--entry-size", type=int, default=100, metavar="BYTES", help="bytes per entry (default 100)")
    s.set_defaults(func=cmd_simpletest)


class _VersionAction(argparse.Action):
    """--version: print the version report (bookkeeper/cli/version.py) and exit 0."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from bookkeeper.cli.version import version_lines

        print("\n".join(version_lines()))
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--metadata-uri", default=argparse.SUPPRESS, metavar="URI",
                        help="zk://host:port/ledgers (env BK_METADATA_URI)")
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log to stderr")

    p = argparse.ArgumentParser(prog="bk", description="BookKeeper in Python", parents=[common])
    p.add_argument("--version", action=_VersionAction,
                   help="package version, commit, Python, liburing, io_uring here; then exit")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_sandbox_parser, _add_bookie_parser, _add_bookies_parsers, _add_ledger_parsers, _add_bench_parser,
                _add_autorecovery_parsers, add_stream_parsers, add_security_parsers, add_zk_parsers,
                add_metadata_parsers, add_verify_parsers, add_sim_parser, _add_simpletest_parser):
        add(sub, common)
    return p


def _standard_fds() -> None:
    """Open /dev/null on whichever of fds 0-2 is closed (`bk ... <&-`): else the first socket the
    event loop opens gets fd 0-2, and libuv aborts when it closes it (uv__close asserts fd > 2)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            got = os.open(os.devnull, os.O_RDWR)
            if got != fd:  # a lower fd was closed too and took it: that one is handled first
                os.dup2(got, fd)
                os.close(got)


def main(argv: list[str] | None = None) -> int:
    _standard_fds()
    args = build_parser().parse_args(argv)
    verbose = getattr(args, "verbose", False)
    logging.basicConfig(level=logging.INFO if verbose else logging.CRITICAL, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "sandbox" and args.shards is None:
        from bookkeeper.config import default_shards
        args.shards = default_shards()
    try:
        return args.func(args)
    except UsageError as e:
        error_line(f"bk: {e}")
        return 2
    except BKError as e:
        error_line(f"bk: {type(e).__name__}: {e}")
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of stdout has gone (`bk ledger read ... | head`): exit as a shell pipeline
        # member does, quietly; Python flushes stdout again at exit, so point it at /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
