"""`mypy --strict` over the public modules (issue 22 item 6).

Reference: PEP 561 (the wheel ships `bookkeeper/py.typed`, so a user's type checker reads these
annotations). What users import directly: `bookkeeper` (its __init__'s names, defined in
`bookkeeper.client`, whose wire names come from `bookkeeper.proto`), the blocking twin
`bookkeeper.sync`, `bookkeeper.stream`, `bookkeeper.errors`, `bookkeeper.metrics`,
`bookkeeper.gevent`. The configuration is pyproject.toml's [tool.mypy]: strict, with the
rest of the package read for its types but not itself held to --strict yet.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

PUBLIC = ["bookkeeper/__init__.py", "bookkeeper/client", "bookkeeper/proto", "bookkeeper/sync.py", "bookkeeper/stream",
          "bookkeeper/errors.py", "bookkeeper/metrics.py", "bookkeeper/gevent.py", "bookkeeper/extras.py",
          "bookkeeper/security",  # auth plug-ins implement its protocols
          "bookkeeper/verify"]  # bk verify's history and checker: users read its reports


def test_the_public_modules_pass_mypy_strict(tmp_path: Path) -> None:
    """Exit 0 with no error line; a new untyped or wrongly typed public function fails it."""
    run = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), *PUBLIC],
                         cwd=REPO, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "Success: no issues found" in run.stdout, run.stdout


def test_mypy_catches_a_misuse_of_the_client_api(tmp_path: Path) -> None:
    """The check is real: a program that passes str as an entry and awaits an int fails it."""
    bad = tmp_path / "misuse.py"
    bad.write_text("from bookkeeper import BookKeeper\n\n\n"
                   "async def main(bk: BookKeeper) -> None:\n"
                   "    lh = await bk.create_ledger()\n"
                   "    entry_id: str = await lh.add_entry('not bytes')\n")
    run = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), str(bad)],
                         cwd=REPO, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
                         env={"MYPYPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 1, run.stdout
    assert 'Argument 1 to "add_entry" of "WriteHandle" has incompatible type "str"' in run.stdout, run.stdout
    assert 'Incompatible types in assignment (expression has type "int", variable has type "str")' in run.stdout
