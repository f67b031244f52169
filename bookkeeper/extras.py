"""Which optional parts of the distribution are installed.

Why: `pip install bookkeeper-py` is a client (it never pulls the bookie's journal ring, index
store or metrics library); the bookie's own dependencies come with the `[bookie]` extra. A
command that needs an extra that is missing says so in one line, naming what to install,
instead of failing deep inside with an ImportError.
"""
from __future__ import annotations

import importlib.util

from bookkeeper.errors import ConfigError

#: extra -> the modules it brings (import names).
EXTRAS: dict[str, tuple[str, ...]] = {
    "bookie": ("liburing", "lmdb", "prometheus_client"),
    "gevent": ("gevent",),
    "spark": ("pyspark", "pyarrow"),
    "loadtest": ("locust",),
}


def missing(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported here."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def require(extra: str, *, what: str) -> None:
    """Raise ConfigError naming the pip requirement if any module of `extra` is missing."""
    absent = missing(extra)
    if absent:
        raise ConfigError(f"{what} needs the [{extra}] extra ({', '.join(absent)} not installed): "
                          f"pip install 'bookkeeper-py[{extra}]'")
