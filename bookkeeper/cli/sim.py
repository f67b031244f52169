"""`bk sim`: the deterministic simulator (docs/simulation.md).

`bk sim --seed N --ops M` runs one seeded cluster in virtual time and prints what it did;
on a violated invariant it exits 1 with the invariant, the seed, the commit, the trace's
last lines and the command that replays it. `--seeds A..B` runs a range (stops at the first
violation), `--bench` the default profile (3/2/2, 5 bookies, faults on) with CPU per
simulated add, `--list-mutations` the known-wrong rules `--mutation` swaps in.
Exit codes: 0 every run held, 1 a violation, 2 a usage error.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

from bookkeeper.cli.common import UsageError, cli_table, out
from bookkeeper.cli.version import source_commit


def _seeds(text: str) -> range:
    lo, sep, hi = text.partition("..")
    try:
        first, last = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds are A..B (integers), got {text!r}") from None
    if last < first:
        raise argparse.ArgumentTypeError(f"empty seed range {text!r}")
    return range(first, last + 1)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def add_sim_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("sim", parents=[common], help="run the deterministic cluster simulator")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--seed", type=int, default=None, help="the run's seed (default 1)")
    which.add_argument("--seeds", type=_seeds, default=None, metavar="RANGE", help="seeds A..B (inclusive), run in turn; stops at a violation")
    p.add_argument("--ops", type=_positive, default=2000, metavar="M", help="adds the writers make (default 2000)")
    p.add_argument("--mutation", default=None, metavar="NAME", help="swap in a known-wrong rule (--list-mutations)")
    p.add_argument("--trace", default=None, metavar="FILE", help="write the whole trace here")
    p.add_argument("--no-faults", action="store_true", help="no injected faults")
    p.add_argument("--bench", action="store_true", help="the default profile (3/2/2, 5 bookies): CPU per simulated add")
    p.add_argument("--json", action="store_true", help="one JSON object per run instead of tables")
    p.add_argument("--list-mutations", action="store_true", help="print the mutations and exit")
    p.set_defaults(func=cmd_sim)


def cmd_sim(args: argparse.Namespace) -> int:
    from bookkeeper.testing.sim import MUTATIONS, SimConfig, run

    if args.list_mutations:
        for name, what in MUTATIONS.items():
            print(f"{name:36} {what}")
        return 0
    if args.mutation is not None and args.mutation not in MUTATIONS:
        raise UsageError(f"no mutation {args.mutation!r}; bk sim --list-mutations names them")
    seeds = args.seeds if args.seeds is not None else [args.seed if args.seed is not None else 1]
    if args.trace and len(seeds) > 1:
        raise UsageError("--trace takes one run: give --seed, not --seeds")
    make = SimConfig.default if args.bench else SimConfig.from_seed
    logging.disable(logging.CRITICAL)  # the bookies' and clients' logs of injected faults are the trace's
    commit = source_commit() or "unknown"
    total_cpu = total_acked = 0.0
    try:
        for seed in seeds:
            cfg = make(seed, args.ops, faults=not args.no_faults)
            started = time.process_time()
            result = run(cfg, mutation=args.mutation, trace_file=Path(args.trace) if args.trace else None)
            cpu = time.process_time() - started
            total_cpu += cpu
            total_acked += result.acked
            report = _report(result, cpu, commit, args)
            if args.json:
                print(json.dumps(report, sort_keys=True))
            else:
                _print(report, result)
            if result.violation is not None:
                return 1
    finally:
        logging.disable(logging.NOTSET)
    if len(seeds) > 1 and not args.json:
        print(f"{len(seeds)} seeds held: {int(total_acked)} adds acknowledged, "
            f"{total_acked / total_cpu if total_cpu else 0:,.0f} per CPU-second")
    return 0


def _report(result: Any, cpu: float, commit: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = result.config
    replay = (f"bk sim --seed {cfg.seed} --ops {cfg.ops}" + (" --bench" if args.bench else "")
              + (" --no-faults" if not cfg.faults else "") + (f" --mutation {args.mutation}" if args.mutation else "")
              + " --trace sim.trace")
    report: dict[str, Any] = {
        "seed": cfg.seed, "ops": cfg.ops, "commit": commit, "config": cfg.describe(), "mutation": args.mutation,
        "acked": result.acked, "adds": result.adds, "ledgers": result.ledgers, "closed": result.closed,
        "recoveries": result.recoveries, "reads": result.reads, "tails": result.tails, "deleted": result.deleted,
        "stream_records_acked": result.stream_acked, "faults": result.faults,
        "simulated_s": round(result.sim_seconds, 6), "cpu_s": round(cpu, 3),
        "cpu_us_per_add": round(cpu / result.acked * 1e6, 1) if result.acked else None,
        "checks": result.stats.get("checks", 0), "violation": None, "replay": replay,
    }
    if result.violation is not None:
        report["violation"] = {"invariant": result.violation.invariant, "detail": result.violation.detail,
                               "trace_tail": result.trace_tail}
    return report


def _print(report: dict[str, Any], result: Any) -> None:
    t = cli_table("figure", "value", title=f"bk sim seed {report['seed']}")
    faults = ", ".join(f"{k} {v}" for k, v in sorted(report["faults"].items())) or "none"
    for row in (("config", report["config"]), ("mutation", report["mutation"] or "none"),
                ("adds acknowledged", f"{report['acked']} of {report['adds']}"),
                ("ledgers (closed by writer)", f"{report['ledgers']} ({report['closed']})"),
                ("recoveries", report["recoveries"]), ("reads", report["reads"]),
                ("tails (to a close)", report["tails"]),
                ("ledgers deleted (checked first)", report["deleted"]),
                ("stream records acknowledged", report["stream_records_acked"]), ("faults", faults),
                ("simulated time", f"{report['simulated_s']:.3f} s"),
                ("CPU", f"{report['cpu_s']:.2f} s ({report['cpu_us_per_add']} us per acknowledged add)"),
                ("invariant checks", report["checks"])):
        t.add_row(str(row[0]), str(row[1]))
    out.print(t)
    v = report["violation"]
    if v is None:
        print("every invariant held")
        return
    print(f"VIOLATION {v['invariant']}: {v['detail']}")
    print(f"seed {report['seed']}, ops {report['ops']}, commit {report['commit']}")
    print("last trace lines:")
    for line in v["trace_tail"]:
        print(f"  {line}")
    print(f"reproduce: {report['replay']}")
