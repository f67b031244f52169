"""The docs stand alone: every relative link in the repo's Markdown resolves (the file, and the
heading of a `#anchor`, by GitHub's slug rules); docs/api.md names every bookie config key and
its Apache aliases, every client setting, every `bk` sub-command with its flags, every admin
HTTP route, every bookie metric and every error class; every page under docs/ that a file
names exists, every "docs/api.md section N" cited is a section of it, every "docs/design.md
invariant N" an invariant of it; and no file refers to the contract files that lived outside
the repo.

Reference: issue 22 item 4. No cluster, no network: the lists checked come from the code
(dataclass fields, the alias table, the argparse tree, the metric table, the error module),
never from a hand-kept copy, so a key or command added without its docs fails here.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import subprocess
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

from bookkeeper import errors, metrics
from bookkeeper.bookie import admin
from bookkeeper.bookie.metrics import PREFIX, SHARD_METRICS
from bookkeeper.cli.main import build_parser
from bookkeeper.client.config import ClientConfig
from bookkeeper.config import ALIASES, BookieConfig

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"
DESIGN = ROOT / "docs" / "design.md"
_SKIP_DIRS = {".git", "build", "dist", "__pycache__", ".pytest_cache", "sandbox", "loadtest-out"}
# Flags every sub-command inherits (documented once, for `bk` as a whole) and argparse's own.
_COMMON_FLAGS = {"--metadata-uri", "--verbose", "-v", "--help", "-h"}
_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
_SCHEME = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")


def repo_files() -> list[Path]:
    """The files a clone has (tracked, or new and not ignored); a walk where git is not there."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=ROOT, capture_output=True, check=True).stdout
        paths = (ROOT / p for p in listed.decode().split("\0") if p)
    except (OSError, subprocess.CalledProcessError):
        paths = (p for p in ROOT.rglob("*") if not _SKIP_DIRS & set(p.relative_to(ROOT).parts)
                 and not p.relative_to(ROOT).parts[0].startswith(".venv"))
    return sorted(p for p in paths if p.is_file() and p.suffix not in (".so", ".c"))


def markdown_files() -> list[Path]:
    return [p for p in repo_files() if p.suffix == ".md"]


def prose_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    fence = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = _FENCE.match(line)
        if m and (fence is None or m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence)):
            fence = m.group(1) if fence is None else None
            continue
        if fence is None:
            yield number, line


def links(path: Path) -> Iterator[tuple[int, str]]:
    """Link targets outside code: inline links and images, and reference definitions."""
    for number, line in prose_lines(path):
        text = _CODE_SPAN.sub(lambda m: "x" * len(m.group(0)), line)
        for m in _INLINE_LINK.finditer(text):
            yield number, m.group(1)
        ref = _REF_LINK.match(text)
        if ref:
            yield number, ref.group(1)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lower-cased, everything but letters,
    digits, `_`, `-` and spaces dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a Markdown file: heading slugs (a repeated one gets -1, -2, ...) and HTML ids."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _number, line in prose_lines(path):
        out.update(_HTML_ANCHOR.findall(line))
        m = _HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def broken_link(source: Path, target: str) -> str | None:
    """Why a link of `source` does not resolve, or None if it does."""
    path_part, _, fragment = urllib.parse.unquote(target).partition("#")
    dest = (source.parent / path_part).resolve() if path_part else source
    if not dest.exists():
        return "no such file"
    if fragment and dest.is_file() and dest.suffix == ".md" and fragment not in anchors(dest):
        return f"no heading #{fragment} in {dest.name}"
    return None


def section(path: Path, number: int) -> str:
    """The text of `## N. ...` up to the next level-2 heading."""
    text = path.read_text(encoding="utf-8")
    m = re.search(rf"^## {number}\. .*?(?=^## |\Z)", text, re.M | re.S)
    assert m, f"{path.relative_to(ROOT)} has no section '## {number}. ...'"
    return m.group(0)


def missing_names(names: list[str], text: str, *, whole: bool = True) -> list[str]:
    """Names that do not appear in a code span of text: as the whole span (`name`), or with
    whole=False as a word of one (`GET /heartbeat`)."""
    spans = [m.group(2).strip() for m in _CODE_SPAN.finditer(text)]
    if whole:
        return [n for n in names if n not in set(spans)]
    joined = "\n".join(spans)
    return [n for n in names if not re.search(rf"(?<![\w/]){re.escape(n)}(?![\w/])", joined)]


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[
        tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser of the `bk` tree with its command path, the root (path ()) first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def flags(parser: argparse.ArgumentParser) -> list[str]:
    """A parser's own long options (and its positional choices, e.g. `bk bench`'s families)."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        if action.option_strings:
            out += [s for s in action.option_strings if s.startswith("--") and s not in _COMMON_FLAGS]
        elif action.choices:
            out += [str(c) for c in action.choices]
    return out


def rows_of(command: tuple[str, ...], text: str) -> list[str]:
    """The lines of `text` holding a code span that starts with `bk <command>`."""
    start = re.compile(r"`bk " + re.escape(" ".join(command)) + r"(?=[\s`\[|])")
    return [line for line in text.splitlines() if start.search(line)]


# -- links --------------------------------------------------------------------------------
def test_github_slug_follows_githubs_rules() -> None:
    """The slugs the link check relies on, against anchors GitHub gives these headings."""
    assert github_slug("WRITE_LAC (5): explicit LAC") == "write_lac-5-explicit-lac"
    assert github_slug("The `bk` command") == "the-bk-command"
    assert github_slug("Closing, and why two recoveries agree") == "closing-and-why-two-recoveries-agree"
    assert github_slug("10. Running it for long") == "10-running-it-for-long"
    assert github_slug("Known limits → what is true") == "known-limits--what-is-true"


def test_every_relative_link_in_the_markdown_resolves() -> None:
    """Every relative link (README.md, docs/, each package README) names a file that exists and,
    with `#anchor`, a heading of it."""
    files = markdown_files()
    assert ROOT / "README.md" in files and API in files and DESIGN in files
    broken = [f"{md.relative_to(ROOT)}:{number}: ({target}) {why}"
              for md in files for number, target in links(md)
              if not _SCHEME.match(target) and (why := broken_link(md, target))]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_link_check_finds_a_broken_file_and_a_broken_anchor(tmp_path: Path) -> None:
    """The check above can fail: a missing file and a missing heading are both reported,
    links inside code are not links."""
    page = tmp_path / "page.md"
    page.write_text("# Title\n## A `code` heading\n[ok](#a-code-heading) [self](page.md#title)\n"
                    "[gone](nothere.md) [bad](#no-such-heading)\n```\n[in code](nothere2.md)\n```\n"
                    "`[span](nothere3.md)`\n", encoding="utf-8")
    found = {target: broken_link(page, target) for _n, target in links(page)}
    assert found == {"#a-code-heading": None, "page.md#title": None, "nothere.md": "no such file",
                     "#no-such-heading": "no heading #no-such-heading in page.md"}


def test_no_file_refers_to_the_contract_files_outside_the_repo() -> None:
    """A clone has no contract files beside it: nothing may point at them (what
    `grep -r` for their two names finds; the pattern is built so this file is not a hit)."""
    pattern = re.compile("|".join(name + ".md" for name in ("API", "DESIGN")).encode())
    hits = [str(p.relative_to(ROOT)) for p in repo_files() if pattern.search(p.read_bytes())]
    assert not hits, f"files that refer to the contract files outside the repo: {hits}"


def test_every_docs_page_a_file_names_exists() -> None:
    """Code and docs cite pages as `docs/<name>.md`: each such page is in the repo."""
    named = re.compile(rb"(?<![\w/.])docs/[\w./-]+?\.md\b")
    missing = sorted({f"{p.relative_to(ROOT)}: {m.group(0).decode()}" for p in repo_files()
                      for m in named.finditer(p.read_bytes()) if not (ROOT / m.group(0).decode()).is_file()})
    assert not missing, "pages named but not in docs/:\n" + "\n".join(missing)


def test_cited_api_sections_and_design_invariants_exist() -> None:
    """"docs/api.md section N" and "docs/design.md invariant(s) N[-M]" name what those pages hold."""
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", API.read_text(encoding="utf-8"), re.M)}
    invariants = {int(n) for n in re.findall(r"^### Invariant (\d+):", DESIGN.read_text(encoding="utf-8"), re.M)}
    cite_section = re.compile(rb"docs/api\.md,? sections? (\d+)")
    cite_invariant = re.compile(rb"docs/design\.md(?:'s)? invariants? (\d+)(?:\s*(?:-|to)\s*(\d+))?")
    bad = []
    for p in repo_files():
        data = p.read_bytes()
        bad += [f"{p.relative_to(ROOT)}: api section {int(n)}" for n in cite_section.findall(data)
                if int(n) not in sections]
        bad += [f"{p.relative_to(ROOT)}: design invariant {int(n)}" for first, last in cite_invariant.findall(data)
                for n in {first, last or first} if int(n) not in invariants]
    assert sections >= set(range(1, 11)), f"docs/api.md sections: {sorted(sections)}"
    assert not bad, "citations of what docs/api.md and docs/design.md do not hold:\n" + "\n".join(bad)


# -- docs/api.md names the whole surface ----------------------------------------------------
def test_every_bookie_config_key_and_apache_alias_is_in_section_4() -> None:
    """Every field of BookieConfig and every Apache alias the loader accepts."""
    names = [f.name for f in dataclasses.fields(BookieConfig)] + sorted(ALIASES)
    missing = missing_names(names, section(API, 4))
    assert not missing, f"bookie config keys missing from docs/api.md section 4: {missing}"


def test_every_client_setting_is_in_section_3() -> None:
    """Every field of ClientConfig (the keyword arguments of connect)."""
    missing = missing_names([f.name for f in dataclasses.fields(ClientConfig)], section(API, 3))
    assert not missing, f"client settings missing from docs/api.md section 3: {missing}"


def test_every_bk_command_and_its_flags_are_in_section_2() -> None:
    """Every command of the argparse tree (`bk stream tail`, `bk bookie gc`, ...) has a line in
    section 2 starting with `bk <command>`, and its own flags are on that line; `bk`'s own
    flags and the ones every command takes are in the section."""
    text = section(API, 2)
    missing = []
    for path, parser in commands(build_parser()):
        if not path:
            missing += [f"bk {flag}" for flag in [*flags(parser), "--metadata-uri", "--verbose"]
                        if flag not in text]
            continue
        if parser.get_default("func") is None:
            continue  # a group (`bk stream`): its commands are checked
        rows = "\n".join(rows_of(path, text))
        if not rows:
            missing.append(f"bk {' '.join(path)}")
        missing += [f"bk {' '.join(path)} {flag}" for flag in flags(parser) if rows and flag not in rows]
    assert not missing, f"bk commands or flags missing from docs/api.md section 2: {missing}"


def test_the_command_walk_sees_nested_commands() -> None:
    """The walk above reaches the nested commands (so a new one cannot slip past it)."""
    paths = {" ".join(path) for path, _ in commands(build_parser())}
    assert {"stream tail", "autorecovery status", "bookie gc", "bookies can-stop", "ledger read"} <= paths


def test_every_admin_route_metric_and_error_class_is_in_api_md() -> None:
    """The admin HTTP routes, every metric a bookie exposes (the shards' table, counters with
    `_total`, and the supervisor's own), every client metric bookkeeper.metrics.register
    exports, and every error class of bookkeeper.errors."""
    source = inspect.getsource(admin)
    routes = sorted(set(re.findall(r"\"(/(?:heartbeat|metrics|api/v1/[\w/]+))\"", source)))
    names = [PREFIX + name + ("_total" if kind == "counter" else "") for name, (kind, _) in SHARD_METRICS.items()]
    names += [PREFIX + name for name in re.findall(r"PREFIX \+ \"(\w+)\"", source)]
    names += [metrics.CLIENT_PREFIX + name + ("_total" if kind == "counter" else "")
              for name, (kind, _) in metrics.CLIENT_METRICS.items()]
    classes = [name for name, obj in vars(errors).items()
               if isinstance(obj, type) and issubclass(obj, errors.BKError)]
    text = API.read_text(encoding="utf-8")
    assert len(routes) >= 5 and len(names) > len(SHARD_METRICS) + len(metrics.CLIENT_METRICS) and len(classes) > 20
    missing = missing_names(routes, text, whole=False) + missing_names(names + classes, text)
    assert not missing, f"missing from docs/api.md: {missing}"


def test_every_spark_option_is_in_section_7() -> None:
    """Every option the Spark source reads (SourceOptions.parse, read as text: importing
    bookkeeper.spark imports pyspark), compared without case as Spark does."""
    source = (ROOT / "bookkeeper" / "spark" / "options.py").read_text(encoding="utf-8")
    read = set(re.findall(r"o\.get\(\"(\w+)\"", source)) | set(re.findall(r"\"(\w+)\" in o\b", source))
    documented = {name.lower() for name in re.findall(r"^\| `(\w+)` \|", section(API, 7), re.M)}
    assert len(read) >= 10, read
    assert not read - documented, f"Spark options missing from docs/api.md section 7: {sorted(read - documented)}"
