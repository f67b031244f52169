"""`bk --version`: what is installed and what this machine offers the journal.

Lives in: the `bk` command. First line: the distribution's version (bookkeeper-py); then the
commit when the package runs from a git checkout (an installed wheel has none: omitted), the
Python, liburing, and whether io_uring works here (the bookie's own probe, in a child
process: the library's failures can kill the process that meets them).
"""
from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import tempfile
from pathlib import Path

import bookkeeper

DISTRIBUTION = "bookkeeper-py"
GIT_TIMEOUT_S = 5.0


def distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def source_commit() -> str | None:
    """The commit of the checkout the package runs from (plus a note when files differ from
    it), None when it does not run from one or git cannot say."""
    root = Path(bookkeeper.__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, stdin=subprocess.DEVNULL)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=GIT_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def version_lines() -> list[str]:
    """The lines `bk --version` prints, the distribution's version first."""
    from bookkeeper.bookie.journal.syncer import probe_io_uring

    lines = [f"{DISTRIBUTION} {distribution_version(DISTRIBUTION) or 'unknown (not installed)'}"]
    commit = source_commit()
    if commit is not None:
        lines.append(f"commit {commit}")
    lines.append(f"Python {platform.python_version()} ({platform.python_implementation()})")
    lines.append(f"liburing {distribution_version('liburing') or 'not installed (the [bookie] extra)'}")
    with tempfile.TemporaryDirectory(prefix="bk-version-") as probe_dir:
        reason = probe_io_uring(probe_dir)
    lines.append("io_uring available" if reason is None else f"io_uring unavailable: {reason}")
    return lines
