"""Fault steps on a seeded schedule, run against a cluster while the workload writes.

Why a schedule fixed by the seed: a run that found an anomaly can be run again with the same
faults at the same offsets. Each step injects one fault, holds it, then heals it; the next
starts only after the heal. Who does the hurting is an executor: an operator's command
(`--faults CMD`, run with `sh -c` once per phase, environment BK_VERIFY_FAULT, BK_VERIFY_PHASE,
BK_VERIFY_STEP, BK_VERIFY_TARGET, BK_VERIFY_SEED) or the local cluster's own kinds
(local.py). A step whose command fails is recorded, healed, and ends the schedule: faults
silently not injected would make a clean run mean nothing.
"""
from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass
from typing import Protocol

from bookkeeper.verify.history import History

COMMAND_KINDS = ("kill", "stop", "partition")
DEFAULT_HOLD_S = (2.0, 6.0)
DEFAULT_GAP_S = (2.0, 5.0)
FIRST_AT_S = 2.0  # the writers have ledgers and entries on every bookie before the first fault
TARGET_RANGE = 1 << 20  # targets are integers the command maps onto hosts (target % hosts)
OUTPUT_CHARS = 400  # of a failed command's output, kept in the history


@dataclass(frozen=True, slots=True)
class FaultStep:
    step: int
    kind: str
    target: int
    at_s: float    # seconds after the workload started
    hold_s: float


class FaultError(Exception):
    """An executor could not inject or heal a fault."""


class FaultExecutor(Protocol):
    async def apply(self, step: FaultStep, phase: str) -> None:
        """Inject (phase "inject") or heal (phase "heal") one step; FaultError if it could not."""


def fault_schedule(seed: int, kinds: list[str], *, seconds: float,
                   hold_s: dict[str, tuple[float, float]] | None = None,
                   gap_s: tuple[float, float] = DEFAULT_GAP_S) -> list[FaultStep]:
    """Steps of the given kinds over `seconds`, each inject + hold + heal ending inside it.

    Kinds take turns in an order the seed shuffles (every kind comes before any comes twice);
    holds come from `hold_s[kind]` (default DEFAULT_HOLD_S), gaps between steps from `gap_s`.
    The same seed and arguments give the same list."""
    if not kinds:
        return []
    rng = random.Random(seed)
    holds = hold_s or {}
    steps: list[FaultStep] = []
    at = FIRST_AT_S
    order: list[str] = []
    while True:
        if not order:
            order = list(kinds)
            rng.shuffle(order)
        kind = order.pop()
        lo, hi = holds.get(kind, DEFAULT_HOLD_S)
        hold = round(rng.uniform(lo, hi), 2)
        if at + hold > seconds:
            return steps
        steps.append(FaultStep(len(steps), kind, rng.randrange(TARGET_RANGE), round(at, 2), hold))
        at += hold + rng.uniform(*gap_s)


def parse_kinds(text: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    """`kill,stop,partition` as a list; ValueError naming a kind not in `allowed`."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    if not kinds:
        raise ValueError("no fault kinds given")
    if allowed is not None:
        unknown = [k for k in kinds if k not in allowed]
        if unknown:
            raise ValueError(f"unknown fault kind(s) {', '.join(unknown)}: choose from {', '.join(allowed)}")
    return kinds


class CommandFaults:
    """Runs an operator's command per phase of each step (`sh -c CMD`)."""

    def __init__(self, command: str, seed: int, *, timeout_s: float = 120.0) -> None:
        self.command = command
        self.seed = seed
        self.timeout_s = timeout_s

    async def apply(self, step: FaultStep, phase: str) -> None:
        env = {**os.environ, "BK_VERIFY_FAULT": step.kind, "BK_VERIFY_PHASE": phase,
               "BK_VERIFY_STEP": str(step.step), "BK_VERIFY_TARGET": str(step.target),
               "BK_VERIFY_SEED": str(self.seed)}
        # Its own session: a Ctrl-C at the terminal (the whole foreground process group) is
        # bk verify's to act on (end the load, heal, check); it must not kill a heal under way.
        proc = await asyncio.create_subprocess_exec("sh", "-c", self.command, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                    start_new_session=True)
        try:
            async with asyncio.timeout(self.timeout_s):
                out, _ = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise FaultError(f"fault command did not finish within {self.timeout_s:.0f}s") from None
        finally:
            if proc.returncode is None:  # cancelled (Ctrl-C, the run's end): an inject must not outlive its heal
                proc.kill()
        if proc.returncode != 0:
            text = out.decode(errors="replace").strip()[-OUTPUT_CHARS:]
            raise FaultError(f"fault command exited with {proc.returncode}: {text}")


async def run_nemesis(history: History, steps: list[FaultStep], executor: FaultExecutor,
                      stopping: asyncio.Event) -> None:
    """Run the steps at their offsets (from history's start; a step that starts late, after a
    slow one, starts at once) until done, `stopping` is set, or a step fails. A step under way
    runs whole, held and healed, also when the run stops meanwhile: a fault cut short is not
    the fault planned (a session expiry needs its hold), and the read-back needs the cluster whole.
    Cancelled (Ctrl-C), it still heals the step under way before it ends: a ZooKeeper left
    stopped would hang every client waiting on it, and leave the operator's cluster hurt."""
    for step in steps:
        if stopping.is_set():
            return
        delay = step.at_s - history.elapsed_s
        if delay > 0 and await _stopped(stopping, delay):
            return
        ok = False
        try:
            ok = await _phase(history, executor, step, "inject")
            if ok:
                await asyncio.sleep(step.hold_s)
        finally:
            healed = await asyncio.shield(_phase(history, executor, step, "heal"))
        if not (ok and healed):
            return


async def _stopped(stopping: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds` or until `stopping` is set; whether it was set."""
    try:
        async with asyncio.timeout(seconds):  # not wait_for: 3.11's can swallow a cancellation
            await stopping.wait()
    except TimeoutError:
        return False
    return True


async def _phase(history: History, executor: FaultExecutor, step: FaultStep, phase: str) -> bool:
    fields = {"kind": step.kind, "phase": phase, "step": step.step, "target": step.target}
    history.record("nemesis", "invoke", "fault", **fields)
    try:
        await executor.apply(step, phase)
    except Exception as e:  # any failure of the executor ends the schedule, reported
        history.record("nemesis", "fail", "fault", error=f"{type(e).__name__}: {e}", **fields)
        return False
    history.record("nemesis", "ok", "fault", **fields)
    return True
