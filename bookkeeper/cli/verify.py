"""`bk verify run|check|local`: check that a cluster keeps what it acknowledged (docs/operations.md,
"Checking a cluster").

`bk verify run` ends its load at --seconds or at the first SIGINT or SIGTERM, whichever comes
first, then reads everything back and checks it; a second signal aborts without a check (exit
130) once the fault step under way is healed; a third quits at once.

Exit codes: 0 no anomaly; 1 an anomaly (each printed with its kind, ledger, entry and history
line); 3 no anomaly, but a fault step's command failed (the run did not test what it was
asked to); 2 a usage error. `--json` prints one object: `ops`, `acked`, `anomalies` (each
`kind`, `ledger_id`, `entry_id`, `detail`, `line`), `longest_stall_s` and the other
VerifyReport fields.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bookkeeper.cli.common import UsageError, cli_table, client_settings, metadata_uri, out
from bookkeeper.errors import BKError
from bookkeeper.verify.checker import HistoryRecordError, VerifyReport, check_history
from bookkeeper.verify.history import HistoryFormatError, read_history
from bookkeeper.verify.nemesis import COMMAND_KINDS, DEFAULT_HOLD_S, CommandFaults, fault_schedule, parse_kinds
from bookkeeper.verify.workload import WorkloadOptions, WorkloadState, parse_ensembles, run_verify

EXIT_FAULT_FAILED = 3
EXIT_INCOMPLETE = 4  # nothing acknowledged, or something acknowledged never read back: nothing to judge
SHOWN_ANOMALIES = 50
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # the first ends the load early, the second aborts
# `local`'s pace: ZooKeeper, the bookies and the workload share this host's cores, and the
# faults' restarts need some (over 3 minutes it is still 540,000 adds, past the bar of 300,000).
LOCAL_RATE = 3000.0  # printed in the table; --json has them all


def exit_code(report: VerifyReport) -> int:
    """1 anomalies, 3 a fault command failed, 4 the history cannot prove anything (nothing
    acknowledged, or a ledger or stream never read back: an interrupted run), 0 clean."""
    if report.anomalies:
        return 1
    if report.fault_errors:
        return EXIT_FAULT_FAILED
    return EXIT_INCOMPLETE if report.acked == 0 or not report.complete else 0


def print_report(report: VerifyReport, *, as_json: bool) -> int:
    """The summary (or JSON) on stdout; the exit code."""
    if as_json:
        print(json.dumps(report.to_json()))
        return exit_code(report)
    t = cli_table("figure", "value", title="bk verify")
    rows = [("ops", report.ops), ("acknowledged", report.acked), ("ledgers", report.ledgers),
            ("takeovers", report.takeovers), ("stream records acknowledged", report.stream_records),
            ("fault steps", report.faults), ("longest stall", f"{report.longest_stall_s:.2f} s"
                                 + (f" ({report.longest_stall_proc} from {report.longest_stall_from_s:.1f} s)"
                                    if report.longest_stall_proc else "")),
            ("writer errors", report.writer_errors), ("anomalies", len(report.anomalies)),
            ("run", f"{report.seconds:.1f} s"), ("check", f"{report.check_seconds:.2f} s")]
    if report.history:
        rows.append(("history", report.history))
    for name, value in rows:
        t.add_row(name, str(value))
    out.print(t)
    for sample in report.writer_error_samples:
        out.print(f"writer error: {sample}")
    for err in report.fault_errors:
        out.print(f"fault step failed: {err}")
    if report.acked == 0:
        out.print("incomplete: nothing was acknowledged, so nothing was checked")
    for what in report.unchecked[:SHOWN_ANOMALIES]:
        out.print(f"incomplete: {what} (the run ended before its read-back: interrupted?)")
    if report.fault_steps:
        f = cli_table("step", "kind", "target", "injected", "healed", "longest stall", title="fault steps")
        for st in report.fault_steps:
            healed = "-" if st["healed_s"] is None else f"{st['healed_s']:.1f} s"
            f.add_row(str(st["step"]), str(st["kind"]), str(st["target"]), f"{st['inject_s']:.1f} s", healed,
                      f"{st['longest_stall_s']:.2f} s")
        out.print(f)
    if report.anomalies:
        a = cli_table("kind", "ledger", "entry", "line", "detail", title="anomalies")
        for an in report.anomalies[:SHOWN_ANOMALIES]:
            a.add_row(an.kind, str(an.ledger_id), str(an.entry_id), str(an.line), an.detail)
        out.print(a)
        if len(report.anomalies) > SHOWN_ANOMALIES:
            out.print(f"... and {len(report.anomalies) - SHOWN_ANOMALIES} more (--json lists all)")
    return exit_code(report)


def _range(text: str) -> tuple[float, float]:
    """`2-6` or `5` as (low, high) seconds."""
    try:
        lo, _, hi = text.partition("-")
        pair = (float(lo), float(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not SECONDS or LOW-HIGH") from None
    if not 0 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 <= LOW <= HIGH")
    return pair


def _options(args: argparse.Namespace, **more: Any) -> WorkloadOptions:
    try:
        return WorkloadOptions(seconds=args.seconds, writers=args.writers,
                               ensembles=tuple(parse_ensembles(args.ensembles)), tailers=args.tailers,
                               streams=args.streams, seed=args.seed, keep=args.keep, rate=args.rate,
                               **more).validate()
    except ValueError as e:
        raise UsageError(str(e)) from None


async def _ending_early_on_signal(run: Callable[[WorkloadState], Awaitable[VerifyReport]]) -> VerifyReport | None:
    """Run the workload; the first SIGINT or SIGTERM ends its load early, and what ran is read
    back and checked as at the end of --seconds (so a run can last as long as something else
    does, and Ctrl-C still gives a verdict). A second signal aborts once the fault step under
    way is healed: None, the check not done. A third quits at once (exit 130). A signal that
    arrives while the history is being checked is too late: the check finishes."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    state = WorkloadState()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            state.stopping.set()
            print("bk verify: ending the load now; reading back and checking (signal again to abort)",
                  file=sys.stderr, flush=True)
        elif signals == 2:
            print("bk verify: aborting once the fault step under way is healed (signal again to quit at once)",
                  file=sys.stderr, flush=True)
            main.cancel()
        else:  # the user insists: the history's unwritten tail and a heal under way are given up
            os._exit(130)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal)
    try:
        return await run(state)
    except asyncio.CancelledError:
        if signals >= 2:
            return None
        raise
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


def cmd_run(args: argparse.Namespace) -> int:
    import uvloop

    opts = _options(args, takeovers=args.takeovers)
    faults, steps = None, []
    if args.faults:
        try:
            kinds = parse_kinds(args.fault_kinds)
        except ValueError as e:
            raise UsageError(str(e)) from None
        steps = fault_schedule(args.seed, kinds, seconds=args.seconds,
                               hold_s={k: args.fault_hold for k in kinds})
        faults = CommandFaults(args.faults, args.seed)
    history = Path(args.history) if args.history else None
    uri, client = metadata_uri(args), client_settings()
    report = uvloop.run(_ending_early_on_signal(lambda state: run_verify(
        uri, opts, history_path=history, faults=faults, fault_steps=steps, state=state, client=client)))
    if report is None:
        raise KeyboardInterrupt
    return print_report(report, as_json=args.json)


def cmd_check(args: argparse.Namespace) -> int:
    path = Path(args.history)
    if not path.is_file():
        raise UsageError(f"no history file {path}")
    started = time.monotonic()
    try:
        report = check_history(read_history(path))
    except (HistoryFormatError, HistoryRecordError) as e:
        raise UsageError(f"{path}: not a bk verify history: {e}") from None
    report.check_seconds = time.monotonic() - started
    report.history = str(path)
    return print_report(report, as_json=args.json)


def cmd_local(args: argparse.Namespace) -> int:
    import uvloop

    from bookkeeper.verify.local import run_local

    opts = _options(args, takeovers=not args.no_takeovers)
    try:
        kinds = parse_kinds(args.fault_kinds) if args.fault_kinds else None
        report = uvloop.run(run_local(opts, bookies=args.bookies, directory=Path(args.dir) if args.dir else None,
                                      kinds=kinds, ack_before_sync=args.test_ack_before_sync))
    except BKError:
        raise  # InvalidArgumentError is a ValueError too, but not the user's: bk reports it as an error
    except ValueError as e:
        raise UsageError(str(e)) from None
    return print_report(report, as_json=args.json)


def _workload_args(p: argparse.ArgumentParser, *, default_rate: float | None) -> None:
    p.add_argument("--seconds", type=float, required=True, metavar="S",
                   help="how long the workload writes (bk verify run: SIGINT or SIGTERM ends it sooner, "
                        "then the check runs; a second one aborts)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="fixes the fault schedule and the choices (default 0)")
    p.add_argument("--writers", type=int, default=4, metavar="N", help="ledger writers (default 4)")
    p.add_argument("--ensembles", default="3/2/2,3/3/2", metavar="ENSEMBLES",
                   help="the writers' quorums E/Qw/Qa, comma-separated, taking turns (default 3/2/2,3/3/2)")
    p.add_argument("--tailers", type=int, default=1, metavar="N", help="tailing readers (default 1)")
    p.add_argument("--streams", type=int, default=1, metavar="N", help="streams, each a writer and a reader (default 1)")
    p.add_argument("--rate", type=float, default=default_rate, metavar="N",
                   help=f"adds per second over all writers (default {default_rate or 'as fast as acknowledged'})")
    p.add_argument("--keep", action="store_true", help="keep the ledgers and streams made (default: deleted at the end)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the tables")


def add_verify_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    """`bk verify run|check|local`."""
    s = sub.add_parser("verify", parents=[common], help="check that a cluster keeps what it acknowledged")
    vsub = s.add_subparsers(dest="verify_command", required=True)

    p = vsub.add_parser("run", parents=[common], help="the workload against a cluster, then the check")
    p.add_argument("--uri", dest="metadata_uri", default=argparse.SUPPRESS, metavar="URI",
                   help="the cluster's metadata URI (as --metadata-uri; env BK_METADATA_URI)")
    _workload_args(p, default_rate=None)
    p.add_argument("--takeovers", action="store_true", help="recovery-open writers' ledgers mid-write")
    p.add_argument("--faults", default=None, metavar="CMD",
                   help="run `sh -c CMD` to inject and heal each fault step (env BK_VERIFY_FAULT, BK_VERIFY_PHASE, "
                        "BK_VERIFY_STEP, BK_VERIFY_TARGET, BK_VERIFY_SEED)")
    p.add_argument("--fault-kinds", default=",".join(COMMAND_KINDS), metavar="KINDS",
                   help="the kinds, comma-separated, the schedule takes turns with (default kill,stop,partition)")
    p.add_argument("--fault-hold", type=_range, default=DEFAULT_HOLD_S, metavar="SECONDS",
                   help="seconds each fault is held, LOW-HIGH or one value (default 2-6)")
    p.add_argument("--history", default=None, metavar="FILE", help="keep the JSONL history here (default: a temporary file, removed after the check)")
    p.set_defaults(func=cmd_run)

    p = vsub.add_parser("check", parents=[common], help="check a history file offline")
    p.add_argument("history", metavar="HISTORY", help="a history written by bk verify run or local")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the tables")
    p.set_defaults(func=cmd_check)

    p = vsub.add_parser("local", parents=[common], help="ZooKeeper + N local bookies under the workload and local faults")
    p.add_argument("--bookies", type=int, default=5, metavar="N", help="bookies (default 5)")
    p.add_argument("--dir", default=None, metavar="D", help="cluster and history.jsonl here (default: a temporary dir)")
    _workload_args(p, default_rate=LOCAL_RATE)
    p.add_argument("--fault-kinds", default=None, metavar="KINDS",
                   help="local kinds: kill, hang, restart, session_expiry, zk_restart, ensemble_kill "
                        "(default: all but ensemble_kill, which --test-ack-before-sync adds)")
    p.add_argument("--no-takeovers", action="store_true", help="no recovery opens mid-write")
    p.add_argument("--test-ack-before-sync", action="store_true",
                   help="TEST ONLY: bookies acknowledge before their journal syncs (BK_TEST_SWITCHES): must lose entries")
    p.set_defaults(func=cmd_local)
