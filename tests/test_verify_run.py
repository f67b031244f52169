"""`bk verify local` end to end: a real ZooKeeper and real bookies under the workload (writers on
3/2/2 and 3/3/2 ledgers, a tailer, takeovers, a stream) and every local fault kind, then the
read-back and the check; the history checked again offline gives the same answer. With the
ack-before-sync test switch and whole ensembles killed -9, it must report lost entries: proof
that the checker can fail.

Reference: issue 24 items 4 and 5; docs/operations.md, "Checking a cluster".
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bookkeeper.cli.main import main
from bookkeeper.testing.cluster import LocalCluster
from bookkeeper.testing.waiting import wait_until
from bookkeeper.verify import read_history
from bookkeeper.verify.history import has_acknowledged_add
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


def _run_until_signalled(cluster: LocalCluster, history: Path,
                         signals: tuple[signal.Signals, ...]) -> subprocess.CompletedProcess[str]:
    """`bk verify run --seconds 600` as its own process, sent `signals` back to back once its
    history holds an acknowledged add (two different ones: the kernel would merge two SIGINTs
    sent before the first is taken, and a pause would let a short read-back finish first)."""
    bk = str(Path(sys.executable).parent / "bk")
    proc = subprocess.Popen([bk, "verify", "run", "--uri", cluster.metadata_uri, "--seconds", "600", "--writers", "1",
                             "--ensembles", "3/2/2", "--tailers", "1", "--streams", "0", "--rate", "200",
                             "--history", str(history), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until("an acknowledged add in the history", lambda: has_acknowledged_add(history), timeout_s=60,
                   every_s=0.2)
        for sig in signals:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_run_ends_its_load_at_the_first_sigint_and_still_checks(cluster5: LocalCluster, tmp_path: Path) -> None:
    """A run with --seconds 600 sent SIGINT once its writer has an acknowledged add: the load
    ends there, everything is read back and checked (exit 0, nothing unchecked), minutes early."""
    run = _run_until_signalled(cluster5, tmp_path / "h.jsonl", (signal.SIGINT,))
    report = json.loads(run.stdout)
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    assert "ending the load now" in run.stderr
    assert report["acked"] > 0 and report["anomalies"] == [] and report["unchecked"] == [], report
    assert report["seconds"] < 120, report["seconds"]


def test_a_second_signal_aborts_without_the_check(cluster5: LocalCluster, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """SIGTERM then SIGINT: no report, exit 130; the history it leaves names what was never read back
    (bk verify check exits 4, incomplete), not a false `lost`."""
    history = tmp_path / "h.jsonl"
    run = _run_until_signalled(cluster5, history, (signal.SIGTERM, signal.SIGINT))
    assert run.returncode == 130 and run.stdout == "", (run.returncode, run.stdout, run.stderr[-3000:])
    code, report = bk_verify(["check", str(history)], capsys)
    assert code == 4 and report["unchecked"] and report["anomalies"] == [], report


def test_a_terminal_ctrl_c_twice_during_a_heal_lets_the_heal_finish(cluster5: LocalCluster, tmp_path: Path) -> None:
    """Signals to bk verify's whole process group, as a terminal's Ctrl-C sends them, while a
    fault step's heal runs: the fault command (its own session) gets none, and the abort (two
    signals) waits for the heal to end before exiting 130."""
    log = tmp_path / "faults.log"
    cmd = (f'echo "$BK_VERIFY_PHASE start" >> {log}; [ "$BK_VERIFY_PHASE" = heal ] && sleep 2; '
           f'echo "$BK_VERIFY_PHASE end" >> {log}')
    bk = str(Path(sys.executable).parent / "bk")
    proc = subprocess.Popen([bk, "verify", "run", "--uri", cluster5.metadata_uri, "--seconds", "600", "--writers", "1",
                             "--ensembles", "3/2/2", "--tailers", "0", "--streams", "0", "--rate", "200", "--seed", "3",
                             "--faults", cmd, "--fault-kinds", "kill", "--fault-hold", "0.2", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_until("a heal under way", lambda: log.exists() and "heal start" in log.read_text(), timeout_s=90,
                   every_s=0.05)
        os.killpg(proc.pid, signal.SIGINT)
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert log.read_text().splitlines()[-2:] == ["heal start", "heal end"], log.read_text()
