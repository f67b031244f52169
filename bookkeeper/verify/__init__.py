"""`bk verify`: a Jepsen-style workload against a cluster, its JSONL history, and the checker.

Modules: history.py (the record format, payloads and digests), checker.py (pure: history ->
VerifyReport), workload.py (writers, tailers, takeovers, streams, the final read-back),
nemesis.py (seeded fault steps; an operator's command as executor), local.py (a LocalCluster
and its built-in fault kinds). docs/operations.md, "Checking a cluster", is the user's guide.
"""
from __future__ import annotations

from bookkeeper.verify.checker import ANOMALY_KINDS, Anomaly, VerifyReport, check_history
from bookkeeper.verify.history import History, read_history
from bookkeeper.verify.nemesis import CommandFaults, FaultStep, fault_schedule
from bookkeeper.verify.workload import WorkloadOptions, WorkloadState, parse_ensembles, run_verify

__all__ = ["ANOMALY_KINDS", "Anomaly", "CommandFaults", "FaultStep", "History", "VerifyReport", "WorkloadOptions",
           "WorkloadState", "check_history", "fault_schedule", "parse_ensembles", "read_history", "run_verify"]
