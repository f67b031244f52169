"""The docs' programs run as written, the sandbox's cluster shows the operator surface, and
README's layout names every package and compiled module (issue 27 items 1, 2 and 6).

A *whole program* is a ```python block of README.md or docs/*.md that has an `import` and runs
itself: it calls `asyncio.run(` or has `if __name__ == "__main__"`. Each one must be the exact
text of a file under examples/ (the doc shows the file verbatim, so the two cannot drift), and
each file of examples/ runs here as a subprocess with BK_METADATA_URI naming this module's
cluster: it must exit 0, print what it says it does, and write nothing on stderr (no traceback,
no warning). Every other python block is a fragment (a call or a definition shown as an
illustration): it must compile as a module, so no `await` outside a function, and a fragment
that imports must also define every name it uses (no undefined `uri`).

Not here: docs/spark.md and examples/spark_*.py, which tests/test_spark.py runs with the test
session's Spark settings.

The module's cluster is set up as `bk sandbox` sets up its own: an admin HTTP port and a rack
of its own per bookie.
"""
from __future__ import annotations

import builtins
import logging
import os
import re
import socket
import subprocess
import sys
import symtable
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bookkeeper import BookKeeper
from bookkeeper.testing.cluster import LocalCluster, choose_zk_port, free_port_block
from tests.conftest import run

pytestmark = pytest.mark.runtime(40)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SPARK_EXAMPLES = "spark_*.py"   # tests/test_spark.py runs them
DOCS_NOT_HERE = {"docs/spark.md"}
# What each example prints (a regex the whole stdout must match); a new example needs a line here.
PRINTS = {
    "client.py": r"ledger \d+: entries 0\.\.199 \[b'event 0', b'event 1', b'event 2'\]\n",
    "connect_settings.py": r"ClientConfig\(.*add_timeout_s=5\.0.*placement='rack_aware'.*\)\n",
    "streams.py": r"\d+:\d+:0 \d+ b'record'\n\d+:\d+:0 \d+ b'a'\n\d+:\d+:1 \d+ b'b'\n",
    "sync_client.py": r"ledger \d+: \[b'entry 0', b'entry 1', b'entry 2'\]\n",
}
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md"))
                                  if str(p.relative_to(ROOT)) not in DOCS_NOT_HERE)]


def python_blocks() -> Iterator[tuple[str, str]]:
    """(where: "FILE:LINE", text) of every ```python block of the docs."""
    for doc in doc_files():
        text = doc.read_text()
        for m in _FENCE.finditer(text):
            if m.group(1) == "python":
                yield f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", m.group(2)


def is_whole_program(block: str) -> bool:
    """An import, and a call of asyncio.run or a __main__ guard: a program that runs itself."""
    return bool(re.search(r"^(import|from) ", block, re.M)) and (
        "asyncio.run(" in block or re.search(r"^if __name__ == .__main__.:", block, re.M) is not None)


def undefined_names(block: str) -> set[str]:
    """Global names the block reads but neither assigns, imports, defines nor has as builtins."""
    top = symtable.symtable(block, "<block>", "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    missing: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for s in table.get_symbols():
            if s.is_referenced() and (table is top or s.is_global()) and s.get_name() not in defined:
                missing.add(s.get_name())
        for child in table.get_children():
            walk(child)
    walk(top)
    return missing - set(dir(builtins))


def example_files() -> list[Path]:
    spark = set(EXAMPLES.glob(SPARK_EXAMPLES))
    return sorted(p for p in EXAMPLES.glob("*.py") if p not in spark)


# -- the docs' blocks ------------------------------------------------------------------
def test_every_whole_program_of_the_docs_is_an_example_file() -> None:
    texts = {p.read_text(): p for p in EXAMPLES.glob("*.py")}
    wholes = [(where, block) for where, block in python_blocks() if is_whole_program(block)]
    assert wholes, "no whole program found: the block parser is broken"
    stray = [where for where, block in wholes if block not in texts]
    assert not stray, f"whole programs that are not the text of a file under examples/: {stray}"


def test_every_example_is_shown_in_a_doc() -> None:
    """An example no doc shows would be tested but never read: drop it or show it."""
    shown = {block for _where, block in python_blocks()}
    unshown = [p.name for p in example_files() if p.read_text() not in shown]
    assert not unshown, f"examples no doc shows verbatim: {unshown}"


def test_fragments_compile_and_define_what_they_use() -> None:
    broken = []
    for where, block in python_blocks():
        try:
            compile(block, where, "exec")
        except SyntaxError as e:
            broken.append(f"{where}: {e.msg}")
            continue
        if re.search(r"^(import|from) ", block, re.M) and (names := undefined_names(block)):
            broken.append(f"{where}: undefined {sorted(names)}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize(("block", "whole"), [
    ("import asyncio\nasync def main(): ...\nasyncio.run(main())\n", True),
    ("import sys\ndef main(): ...\nif __name__ == \"__main__\":\n    main()\n", True),
    ("bk = await BookKeeper.connect(uri)\n", False),                  # a call shown: a fragment
    ("import asyncio\nasyncio.gather()\n", False),                    # imports, does not run itself
    ("x = 1  # asyncio.run(main()) in a comment, no import\n", False),
])
def test_what_counts_as_a_whole_program(block: str, whole: bool) -> None:
    assert is_whole_program(block) is whole


@pytest.mark.parametrize(("block", "missing"), [
    ("import os\nprint(os.sep)\n", set()),
    ("from bookkeeper import BookKeeper\nBookKeeper.connect(uri)\n", {"uri"}),
    ("import asyncio\nasync def main():\n    await bk.close()\n", {"bk"}),
    ("import asyncio\nasync def main(uri):\n    return [u for u in uri]\n", set()),
])
def test_undefined_names_are_found(block: str, missing: set[str]) -> None:
    assert undefined_names(block) == missing


# -- the examples against a sandbox-like cluster -------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("examples"), bookies=3, shards=1, http_ports=True, racks=True)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def test_every_example_states_what_it_prints() -> None:
    assert sorted(p.name for p in example_files()) == sorted(PRINTS)


@pytest.mark.parametrize("name", sorted(PRINTS))
def test_example_runs_as_written(name: str, cluster: LocalCluster, tmp_path: Path) -> None:
    """`python examples/NAME.py` with BK_METADATA_URI set, from another directory, as a user runs it."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "BK_METADATA_URI": cluster.metadata_uri}, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stdout
    assert re.fullmatch(PRINTS[name], proc.stdout, re.S), proc.stdout


# -- the cluster side of the sandbox ---------------------------------------------------
def test_every_bookie_has_an_admin_port_and_a_rack_of_its_own(cluster: LocalCluster) -> None:
    regs = cluster.registrations()
    assert [regs[b.bookie_id]["rack"] for b in cluster.bookies] == ["/rack-1", "/rack-2", "/rack-3"]
    ports = [b.http_port for b in cluster.bookies]
    assert len(set(ports)) == 3 and 0 not in ports
    assert [regs[b.bookie_id]["http_port"] for b in cluster.bookies] == ports
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200 and b"bookkeeper_" in r.read()


def test_zookeeper_takes_the_preferred_port_only_when_it_is_free() -> None:
    port = free_port_block()
    assert choose_zk_port(zk_port=None, prefer_zk_port=port) == port
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        other = choose_zk_port(zk_port=None, prefer_zk_port=port)
        assert other != port and 10_000 <= other < 65_536
        assert choose_zk_port(zk_port=port, prefer_zk_port=None) == port  # asked for: starting says it is taken
    with pytest.raises(ValueError, match="not both"):
        choose_zk_port(zk_port=port, prefer_zk_port=port)


def test_one_rack_cluster_says_degraded_placement_once_at_info(make_cluster, caplog: pytest.LogCaptureFixture) -> None:
    """LocalCluster's defaults (what the tests use) are one rack and no admin HTTP; a client on
    such a cluster degrades every ensemble, counts each, and says so once, at INFO."""
    c = make_cluster(bookies=2, shards=1)
    assert [(b.http_port, b.rack) for b in c.bookies] == [(0, "/default-rack")] * 2
    caplog.set_level(logging.INFO, logger="bookkeeper")

    async def main() -> int:
        async with await BookKeeper.connect(c.metadata_uri) as bk:
            for _ in range(3):
                await (await bk.create_ledger(ensemble=2, write_quorum=2, ack_quorum=2)).close()
            return bk.stats["placement_degraded"]
    assert run(main()) == 3
    said = [r for r in caplog.records if r.getMessage().startswith("placement degraded")]
    assert [r.levelno for r in said] == [logging.INFO]


# -- README's layout -------------------------------------------------------------------
def test_readme_layout_names_every_package_and_compiled_module() -> None:
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"[\w.]+/?", layout))
    packages = {f"{p.name}/" for p in (ROOT / "bookkeeper").iterdir() if (p / "__init__.py").exists()}
    modules = {p.name for p in (ROOT / "bookkeeper").glob("*.py") if p.name != "__init__.py"}
    compiled = {p.name for p in (ROOT / "ext" / "bookkeeper" / "_ext").glob("*.pyx")}
    assert len(compiled) >= 6 and "client/" in packages
    missing = sorted((packages | modules | compiled) - named)
    assert not missing, f"README's layout does not name {missing}"
