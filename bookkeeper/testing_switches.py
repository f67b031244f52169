"""Test-only switches: deliberate faults a test turns on through the environment, never a config.

Lives in: any process that honours one. Today the bookie: its supervisor refuses unknown
names at start, warns and shows the switches on in /metrics; its shards act on them.

Why they exist: a checker that has never failed proves nothing. `bk verify` must be seen to
report lost entries when a bookie really loses acknowledged ones, so a bookie can be told to
acknowledge adds before its journal has written them (`ack_before_sync`); a kill -9 then loses
that acknowledged tail for real.

Why only the environment: a config key can be left in a file, rendered by an Ansible role or
copied to production, and `BookieConfig` refuses unknown keys, so no file can name these.
`BK_TEST_SWITCHES` (comma-separated names) is read once at process start, and an unknown name
stops the process at start: a mistyped switch must not leave a test silently proving nothing.

The other switch of this kind, `BK_FUZZ_NO_LENGTH_CHECK=1`, is read by the Cython frame
decoder at import (ext/bookkeeper/_ext/wire.pyx) for the fuzz targets.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from bookkeeper.errors import ConfigError

ENV = "BK_TEST_SWITCHES"
ACK_BEFORE_SYNC = "ack_before_sync"
# How long an acknowledged block waits in memory before the journal writes it. Long enough that
# a kill -9 right after the last acknowledgement always finds it unwritten, even on a loaded
# machine; short enough that a writer still makes progress (one block per hold).
ACK_BEFORE_SYNC_HOLD_S = 0.5

# name -> what it breaks: the warning a process logs when the switch is on.
KNOWN: dict[str, str] = {
    ACK_BEFORE_SYNC: f"adds are acknowledged before the journal writes them (each block is held "
                     f"{ACK_BEFORE_SYNC_HOLD_S} s in memory first): a kill -9 LOSES ACKNOWLEDGED ENTRIES",
}


def parse_switches(value: str | None) -> frozenset[str]:
    """The switch names of a BK_TEST_SWITCHES value; blanks and empty items are ignored.

    | value                       | result                        |
    |-----------------------------|-------------------------------|
    | None, "", " , "             | no switch                     |
    | "ack_before_sync"           | {"ack_before_sync"}           |
    | " ack_before_sync ,"        | {"ack_before_sync"}           |
    | "ack_before_sync,nope"      | ConfigError naming "nope" and the known names |
    """
    names = frozenset(name.strip() for name in (value or "").split(",") if name.strip())
    unknown = sorted(names - KNOWN.keys())
    if unknown:
        raise ConfigError(f"{ENV} names unknown test switch(es): {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(KNOWN))}")
    return names


def switches_from_env(environ: Mapping[str, str] = os.environ) -> frozenset[str]:
    """The test switches this process was started with (ConfigError for an unknown name)."""
    return parse_switches(environ.get(ENV))


def warn_switches(log: logging.Logger, names: frozenset[str], where: str) -> None:
    """One WARNING per switch on: whoever reads the log must see that this process breaks a
    guarantee on purpose."""
    for name in sorted(names):
        log.warning("%s: TEST SWITCH %s is on (%s): %s; never for data anyone needs", where, name, ENV, KNOWN[name])
