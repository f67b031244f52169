"""The package as users get it: `pip wheel .`, then plain pip into a fresh venv.

Reference: docs/api.md section 5. The wheel carries the compiled extensions and declares its
runtime dependencies; a `bk` installed from it, started inside a source checkout whose
tree is not built, runs the installed package in the processes it spawns too.
"""
from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from bookkeeper.testing.cluster import LocalCluster, free_port_block
from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.runtime(45)]
EXTENSIONS = ("wire", "journal", "client", "entrylog", "shardpath", "uring")


def test_wheel_holds_the_extensions_dependencies_extras_and_script(built_wheel: Path) -> None:
    """What pip needs to install a working bookie without a compiler or a lock file."""
    with zipfile.ZipFile(built_wheel) as z:
        names = z.namelist()
        meta = email.parser.Parser().parsestr(z.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
                                              .decode())
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    for ext in EXTENSIONS:
        assert any(n.startswith(f"bookkeeper/_ext/{ext}.") and n.endswith(".so") for n in names), ext
    assert not any(n.endswith((".pyx", ".c")) for n in names)
    requires = " ".join(meta.get_all("Requires-Dist"))
    for dep in ("uvloop", "kazoo", "lmdb", "crc32c", "prometheus-client", "hdrhistogram", "rich",
                "liburing==2024.5.3"):
        assert dep in requires, (dep, requires)
    assert 'pyspark' in requires and 'extra == "spark"' in requires
    assert 'locust' in requires and 'extra == "loadtest"' in requires
    assert meta["Requires-Python"] == "<3.14,>=3.11"
    assert "bk = bookkeeper.cli.main:main" in entry_points


def test_installed_bk_started_inside_an_unbuilt_checkout_runs_a_bookie_and_simpletest(
        built_wheel: Path, tmp_path: Path, make_cluster) -> None:
    """Fresh venv + plain pip (dependencies from the index), then, from a directory holding the
    checkout's unbuilt `bookkeeper/` tree: `bk --help`, a bookie whose shard processes must
    import the installed package (the tree here has no compiled extensions), `bk simpletest`."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(built_wheel)], capture_output=True,
                         text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert pip.returncode == 0, pip.stderr[-3000:]
    bk = str(venv / "bin" / "bk")
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO / "bookkeeper", checkout / "bookkeeper",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))

    def run_bk(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([bk, *args], cwd=checkout, capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)

    help_ = run_bk("--help")
    assert help_.returncode == 0 and "simpletest" in help_.stdout, help_.stderr

    cluster: LocalCluster = make_cluster(bookies=0)
    port = free_port_block(2)
    conf = tmp_path / "bookie.toml"
    conf.write_text(f'metadata_uri = "{cluster.metadata_uri}"\nbind_address = "127.0.0.1"\n'
                    f'advertised_address = "127.0.0.1"\nport = {port}\nshards = 2\n'
                    f'journal_dir = "{tmp_path / "journal"}"\nledger_dirs = ["{tmp_path / "ledgers"}"]\n'
                    f'journal_preallocate_bytes = 4194304\n')
    log = open(tmp_path / "bookie.log", "wb")
    bookie = subprocess.Popen([bk, "-v", "bookie", "--conf", str(conf)], cwd=checkout, stdout=log, stderr=log,
                              stdin=subprocess.DEVNULL, start_new_session=True,
                              env={**os.environ, "BK_PARENT_PID": str(os.getpid())})
    log.close()
    try:
        deadline = time.monotonic() + 60
        while f"127.0.0.1:{port}" not in cluster.registrations():
            assert bookie.poll() is None, (tmp_path / "bookie.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "bookie.log").read_text()[-3000:]
            time.sleep(0.1)
        test = run_bk("--metadata-uri", cluster.metadata_uri, "simpletest", "-e", "1", "-w", "1", "-a", "1",
                      "-n", "200")
        assert test.returncode == 0, test.stdout + test.stderr
    finally:
        bookie.terminate()
        try:
            bookie.wait(timeout=30)
        except subprocess.TimeoutExpired:
            bookie.kill()
            bookie.wait()
