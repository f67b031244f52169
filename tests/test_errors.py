"""The error registry (bookkeeper/errors.py, issue 25 item 1): one class per code, a second
claimant refused; the wire's statuses (bookkeeper.proto.Status) each map to exactly the class
whose code they are; no bare BKError is raised in the package; docs/api.md lists every class."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import bookkeeper.errors as errors
from bookkeeper.errors import BKError, BookieServerError, error_for_status
from bookkeeper.proto import Status

ROOT = Path(__file__).resolve().parents[1]


def _classes() -> list[type[BKError]]:
    return [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, BKError)]


def test_every_code_names_one_class_and_a_second_claimant_is_refused() -> None:
    codes = [c.code for c in _classes() if "code" in c.__dict__]
    assert len(codes) == len(set(codes)) == len(_classes())  # every class sets its own, the root too
    with pytest.raises(TypeError, match="error code 4 of Impostor is already UnauthorizedError's"):
        type("Impostor", (BKError,), {"code": 4})
    with pytest.raises(TypeError, match="already BKError's"):
        type("Root2", (BKError,), {"code": errors.ROOT_CODE})
    assert errors._REGISTRY[4] is errors.UnauthorizedError and errors.ROOT_CODE not in errors._REGISTRY
    narrower = type("Narrower", (errors.ConfigError,), {})  # no code of its own: its parent's
    assert narrower.code == errors.ConfigError.code and errors._REGISTRY[narrower.code] is errors.ConfigError


def test_each_wire_status_becomes_the_class_whose_code_it_is() -> None:
    for status in Status:
        if status == Status.OK:
            continue
        err = error_for_status(status, "detail")
        assert err.code == status and type(err).code == int(status) and str(err) == "detail", status
        assert type(err.code) is int  # a plain int for users, whatever Status is
    assert isinstance(error_for_status(250), BookieServerError)  # a status this code does not know


def test_no_bare_bkerror_is_made_in_the_package() -> None:
    """Each case has its class: no `BKError(...)` is made anywhere under bookkeeper/ (nor in
    the Cython), raised or kept to raise later."""
    bare = [f"{p.relative_to(ROOT)}:{n}" for p in [*(ROOT / "bookkeeper").rglob("*.py"), *(ROOT / "ext").rglob("*.pyx")]
            for n, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"(?<![\w.])BKError\(", line) and not line.startswith("class ")]
    assert not bare, bare


def test_docs_api_lists_every_error_class_with_its_code() -> None:
    table = re.split(r"\n#{2,3} ", (ROOT / "docs" / "api.md").read_text().split("### Errors", 1)[1], maxsplit=1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| (\d+) \|", table, re.M))
    assert {c.__name__: str(c.code) for c in _classes()} == rows
