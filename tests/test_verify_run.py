"""`bk verify local` end to end: a real ZooKeeper and real bookies under the workload (writers on
3/2/2 and 3/3/2 ledgers, a tailer, takeovers, a stream) and every local fault kind, then the
read-back and the check; the history checked again offline gives the same answer. With the
ack-before-sync test switch and whole ensembles killed -9, it must report lost entries: proof
that the checker can fail.

Reference: issue 24 items 4 and 5; docs/operations.md, "Checking a cluster".
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bookkeeper.cli.main import main
from bookkeeper.testing.cluster import LocalCluster
from bookkeeper.verify import read_history
from bookkeeper.verify.local import DEFAULT_KINDS, GAP_S, HOLD_S
from bookkeeper.verify.nemesis import fault_schedule

pytestmark = pytest.mark.runtime(90)

SEED = 8  # its schedule has every local kind in its first 17 s
SECONDS = 24.0


def bk_verify(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    """`bk verify ... --json` in this process (its cluster is stopped by the command itself,
    also on failure): exit code, the JSON report."""
    capsys.readouterr()  # what the test printed before
    code = main(["verify", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_local_run_under_every_fault_kind_has_no_anomaly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    planned = fault_schedule(SEED, list(DEFAULT_KINDS), seconds=SECONDS, hold_s=HOLD_S, gap_s=GAP_S)
    assert set(DEFAULT_KINDS) == {s.kind for s in planned[:5]}
    code, report = bk_verify(["local", "--bookies", "4", "--seconds", str(SECONDS), "--dir", str(tmp_path),
                              "--seed", str(SEED)], capsys)
    with capsys.disabled():
        print({k: report[k] for k in ("ops", "acked", "ledgers", "takeovers", "stream_records", "faults",
                                      "longest_stall_s", "longest_stall_proc", "longest_stall_from_s",
                                      "writer_errors", "writer_error_samples", "seconds", "check_seconds")})
    assert report["anomalies"] == [] and report["fault_errors"] == [] and code == 0, report
    assert report["acked"] > 1000 and report["ledgers"] >= 4 and report["takeovers"] >= 1
    assert report["stream_records"] > 0
    history = tmp_path / "history.jsonl"
    healed = {(r["kind"], r["phase"]) for r in read_history(history) if r["f"] == "fault" and r["type"] == "ok"}
    assert {(k, p) for k in DEFAULT_KINDS for p in ("inject", "heal")} <= healed
    procs = {r["proc"].split(".")[0] for r in read_history(history) if r["type"] == "ok"}
    assert {"w0", "w1", "r0", "takeover", "s0", "sr0", "final"} <= procs, procs
    code2, again = bk_verify(["check", str(history)], capsys)
    assert code2 == 0
    for key in ("ops", "acked", "anomalies", "longest_stall_s", "ledgers", "takeovers", "writer_errors"):
        assert again[key] == report[key], key


def test_ack_before_sync_loses_acknowledged_entries(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bookies that acknowledge before their journal syncs, whole ensembles killed -9: the run
    must exit non-zero and name lost entries by ledger and entry id."""
    code, report = bk_verify(["local", "--bookies", "4", "--seconds", "8", "--dir", str(tmp_path), "--seed", "1",
                              "--test-ack-before-sync", "--fault-kinds", "ensemble_kill", "--writers", "2",
                              "--streams", "0", "--tailers", "0", "--no-takeovers"], capsys)
    lost = [a for a in report["anomalies"] if a["kind"] == "lost"]
    with capsys.disabled():
        print(f"acked={report['acked']} lost={len(lost)} first={lost[:3]}")
    assert code == 1
    assert lost and all(isinstance(a["ledger_id"], int) and isinstance(a["entry_id"], int) for a in lost)


def test_run_drives_an_operators_fault_command(cluster5: LocalCluster, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`bk verify run --faults CMD` against a running cluster (the suite's shared one: these
    faults only write a log): CMD runs once per phase of each seeded step with the step in its
    environment; a failing CMD is reported (exit 3) and ends the schedule."""
    log = tmp_path / "faults.log"
    cmd = f'echo "$BK_VERIFY_STEP $BK_VERIFY_FAULT $BK_VERIFY_PHASE $BK_VERIFY_TARGET $BK_VERIFY_SEED" >> {log}'
    common = ["run", "--uri", cluster5.metadata_uri, "--seconds", "6", "--writers", "1", "--ensembles", "3/2/2",
              "--tailers", "0", "--streams", "0", "--seed", "3", "--fault-kinds", "kill,stop",
              "--fault-hold", "0.5-1"]
    code, report = bk_verify([*common, "--faults", cmd, "--history", str(tmp_path / "h.jsonl")], capsys)
    assert code == 0 and report["anomalies"] == [] and report["fault_errors"] == [], report
    lines = [line.split() for line in log.read_text().splitlines()]
    assert len(lines) >= 2 and len(lines) == 2 * report["faults"]
    assert [(s, p) for s, _, p, _, _ in lines] == [(str(n // 2), ("inject", "heal")[n % 2]) for n in range(len(lines))]
    assert {k for _, k, _, _, _ in lines} <= {"kill", "stop"} and {seed for *_, seed in lines} == {"3"}
    assert report["history"] == str(tmp_path / "h.jsonl")
    short = [*common[:4], "3", *common[5:]]
    code, report = bk_verify([*short, "--faults", "echo no such host >&2; exit 7"], capsys)
    assert code == 3 and report["anomalies"] == [] and report["faults"] == 1, report
    assert report["fault_errors"][0].startswith("step 0 ") and "exited with 7: no such host" in report["fault_errors"][0]
