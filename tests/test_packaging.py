"""The package as users get it: `pip wheel .`, then plain pip into a fresh venv.

Reference: docs/api.md section 5 and issue 22 items 1 and 6. The wheel carries the compiled
extensions, LICENSE, NOTICE and py.typed, and declares its runtime dependencies (the client's;
the bookie's own in the [bookie] extra); two builds of one commit in different places are
byte-identical; a `bk` installed from it, started inside a source checkout whose tree is not
built, runs the installed package in the processes it spawns too.
"""
from __future__ import annotations

import email.parser
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from bookkeeper.testing.cluster import LocalCluster, free_port_block
from tests.conftest import REPO, SOURCE_DATE_EPOCH, source_files

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
    client = {r.split(";")[0].strip() for r in meta.get_all("Requires-Dist") if ";" not in r}
    for dep in ("uvloop", "kazoo", "crc32c", "hdrhistogram", "rich", "zstandard"):
        assert any(c.startswith(dep) for c in client), (dep, client)
    for dep in ("lmdb", "prometheus-client", "liburing==2024.5.3"):  # the bookie's own, not the client's
        assert not any(c.startswith(dep) for c in client), (dep, client)
        assert any(r.startswith(dep) and 'extra == "bookie"' in r for r in meta.get_all("Requires-Dist")), dep
    assert 'pyspark' in requires and 'extra == "spark"' in requires
    assert 'locust' in requires and 'extra == "loadtest"' in requires
    assert 'gevent' in requires and 'extra == "gevent"' in requires
    assert meta["Requires-Python"] == "<3.14,>=3.11"
    assert meta["License-Expression"] == "Apache-2.0"
    assert "bk = bookkeeper.cli.main:main" in entry_points
    assert "bookkeeper/py.typed" in names
    for notice in ("LICENSE", "NOTICE"):
        (path,) = [n for n in names if n.endswith(f".dist-info/licenses/{notice}")]
        with zipfile.ZipFile(built_wheel) as z:
            assert z.read(path) == (REPO / notice).read_bytes(), notice


def _source_copy(dest: Path) -> Path:
    """The checkout's source files (conftest.source_files) copied to dest."""
    for rel in source_files():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest / rel)
    return dest


def test_two_builds_of_one_commit_in_different_places_are_byte_identical(built_wheel: Path, tmp_path: Path) -> None:
    """Issue 22 item 1: a second `pip wheel` of the same sources, from another directory and in
    another isolated build environment (pip makes a new random one per build), gives a wheel
    with the same sha256 as the session's build from the checkout itself. Before the compiler's
    prefix maps (setup.py), the extensions' debug info held both directories. The sdist of the
    copy carries LICENSE and NOTICE."""
    src = _source_copy(tmp_path / "elsewhere" / "src")
    out = tmp_path / "wheel"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
                           capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
                           env={**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH})
    assert build.returncode == 0, build.stderr[-3000:]
    (again,) = out.glob("bookkeeper_py-*.whl")
    first, second = (hashlib.sha256(w.read_bytes()).hexdigest() for w in (built_wheel, again))
    print(f"wheel sha256: {first} ({built_wheel.parent}), {second} ({src})")
    assert first == second, _differing_members(built_wheel, again)

    sdist = subprocess.run([sys.executable, "-c", "from setuptools import build_meta as b; "
                            f"print(b.build_sdist({str(tmp_path / 'sdist')!r}))"], cwd=src, capture_output=True,
                           text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert sdist.returncode == 0, sdist.stderr[-3000:]
    with tarfile.open(tmp_path / "sdist" / sdist.stdout.split()[-1]) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert {"LICENSE", "NOTICE", "bookkeeper/py.typed", "setup.py", "ext/bookkeeper/_ext/uring.pyx"} <= members


def _differing_members(a: Path, b: Path) -> list[str]:
    """Names of the wheels' members whose bytes differ (the assertion's message)."""
    with zipfile.ZipFile(a) as za, zipfile.ZipFile(b) as zb:
        return [n for n in za.namelist() if n not in zb.namelist() or za.read(n) != zb.read(n)]


def test_a_client_install_lacks_the_bookie_then_the_bookie_extra_runs_one_from_an_unbuilt_checkout(
        built_wheel: Path, tmp_path: Path, make_cluster) -> None:
    """Fresh venv + plain pip (dependencies from the index). The wheel alone is a client: no
    lmdb, liburing or prometheus_client; `bk --version` names the package version first;
    `bk simpletest` works against a cluster; `bk bookie` refuses with one line naming the
    extra. Then `wheel[bookie]`, and from a directory holding the checkout's unbuilt
    `bookkeeper/` tree: a bookie whose shard processes must import the installed package
    (the tree here has no compiled extensions), and `bk simpletest` on it."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)

    def pip_install(spec: str) -> None:
        pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", spec], capture_output=True,
                             text=True, timeout=600, stdin=subprocess.DEVNULL)
        assert pip.returncode == 0, pip.stderr[-3000:]

    pip_install(str(built_wheel))
    bk = str(venv / "bin" / "bk")
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO / "bookkeeper", checkout / "bookkeeper",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))

    def run_bk(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([bk, *args], cwd=checkout, capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)

    missing = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.util as u; "
                              "print([m for m in ('lmdb', 'liburing', 'prometheus_client') if u.find_spec(m)])"],
                             capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert missing.stdout.strip() == "[]", missing.stdout + missing.stderr
    version = run_bk("--version")
    assert version.returncode == 0 and version.stdout.startswith("bookkeeper-py 0.1.0"), version
    cluster: LocalCluster = make_cluster(bookies=1)
    client_only = run_bk("--metadata-uri", cluster.metadata_uri, "simpletest", "-e", "1", "-w", "1", "-a", "1",
                         "-n", "50")
    assert client_only.returncode == 0, client_only.stdout + client_only.stderr
    (tmp_path / "empty.toml").write_text(f'metadata_uri = "{cluster.metadata_uri}"\n')
    refused = run_bk("bookie", "--conf", str(tmp_path / "empty.toml"))
    assert refused.returncode != 0 and "bookkeeper-py[bookie]" in refused.stderr, refused
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1, refused.stderr

    pip_install(f"{built_wheel}[bookie]")
    help_ = run_bk("--help")
    assert help_.returncode == 0 and "simpletest" in help_.stdout, help_.stderr

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
        test = run_bk("--metadata-uri", cluster.metadata_uri, "simpletest", "-e", "2", "-w", "2", "-a", "2",
                      "-n", "200")
        assert test.returncode == 0, test.stdout + test.stderr
    finally:
        bookie.terminate()
        try:
            bookie.wait(timeout=30)
        except subprocess.TimeoutExpired:
            bookie.kill()
            bookie.wait()
