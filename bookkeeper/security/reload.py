"""Files re-read while the process runs: one watcher for the TLS, token-key and authz files.

Why one: the three follow the same rules (issue 23): a changed file is picked up without a
restart; a bad new file keeps the previous value, is counted and logged once; the check is
cheap enough for an event loop (an `os.stat` per file, at most once per interval, nothing read
unless a stat changed). A change is any of mtime, size or inode: replacing a file by rename
(what Ansible, cert-manager and `mv` do) changes the inode even within one mtime tick.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")
Signature = tuple[tuple[int, int, int] | None, ...]

log = logging.getLogger("bookkeeper.security")


class LoadError(Exception):
    """A file could not be loaded: the message names the file and the reason."""


def signature(paths: Sequence[str]) -> Signature:
    """(mtime_ns, size, inode) of each file, None for one that cannot be stat'ed."""
    sig: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            sig.append(None)
        else:
            sig.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(sig)


def should_check(*, now: float, last_check: float, interval_s: float) -> bool:
    """True when `interval_s` has passed since the last stat (or the first load)."""
    return now - last_check >= interval_s


class Reloading(Generic[T]):
    """A value loaded from files, re-loaded when they change.

    `load()` builds the value or raises LoadError (or OSError/ValueError) with a reason naming
    the file; the first load's failure propagates (the caller turns it into ConfigError), a
    later one keeps the old value. A failure counts (and is logged, once) when the same files
    are still bad at the next check: a roll that replaces the certificate and, a moment later,
    its key is caught between the two now and then, and that is not a failure. A bad file is
    counted once, not at every interval; any further change is tried again.
    """

    def __init__(self, paths: Sequence[str], load: Callable[[], T], *, what: str,
                 reload_interval_s: float, now: float | None = None) -> None:
        if reload_interval_s <= 0:
            raise ValueError(f"reload_interval_s must be > 0, got {reload_interval_s}")
        self._paths = tuple(paths)
        self._load = load
        self._what = what
        self._interval_s = reload_interval_s
        self._sig = signature(self._paths)
        self._failed_sig: Signature | None = None  # files that failed once, not yet counted
        self.value: T = load()
        self._last_check = time.monotonic() if now is None else now
        self.reloads = 0
        self.reload_failures = 0
        self.last_error: str | None = None

    def maybe_reload(self, now: float | None = None) -> bool:
        """Stat the files if the interval has passed; reload when one changed. True if reloaded.

        `now` is monotonic seconds (time.monotonic() when None)."""
        now = time.monotonic() if now is None else now
        if not should_check(now=now, last_check=self._last_check, interval_s=self._interval_s):
            return False
        self._last_check = now
        sig = signature(self._paths)
        if sig == self._sig:
            return False
        try:
            value = self._load()
        except (LoadError, OSError, ValueError) as e:
            self._failed(sig, str(e))
            return False
        self._sig, self._failed_sig = sig, None
        self.value = value
        self.reloads += 1
        self.last_error = None
        return True

    def _failed(self, sig: Signature, reason: str) -> None:
        """First failure of these files: try them again at the next check; second: count it,
        log it, and leave them be until they change again."""
        if sig != self._failed_sig:
            self._failed_sig = sig
            return
        self._sig = sig
        self.reload_failures += 1
        self.last_error = reason
        log.warning("%s not reloaded, the previous one stays in use: %s", self._what, reason)


class ReloadCounters:
    """What a holder of a Reloading value tells /metrics about it: mixed into ReloadingTLS,
    TokenKeys and AuthzPolicy, whose `_reloading` is that value (None: nothing loaded)."""

    _reloading: Reloading[Any] | None

    @property
    def reloads(self) -> int:
        return self._reloading.reloads if self._reloading is not None else 0

    @property
    def reload_failures(self) -> int:
        return self._reloading.reload_failures if self._reloading is not None else 0

    @property
    def last_error(self) -> str | None:
        return self._reloading.last_error if self._reloading is not None else None
