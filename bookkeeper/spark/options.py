"""The Spark source's options, validated once on the driver (docs/api.md section 7).

Why a frozen dataclass: the readers are pickled to executors; what crosses that boundary
is this value and partition descriptions, never a connection or an event loop.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from bookkeeper.errors import ConfigError
from bookkeeper.meta.ledger_metadata import DigestType
from bookkeeper.spark.planning import LedgerSpec, parse_ledgers
from bookkeeper.stream import Position

DEFAULT_MAX_ENTRIES = 100_000
BATCH_BYTES = 8 * 1024 * 1024   # an Arrow batch (and a range read) holds about this much payload
BATCH_ROWS_MAX = 8192


def _bool(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise ConfigError(f"option {name} must be true or false, not {text!r}")
    return value == "true"


def _positive(name: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"option {name} must be a positive integer, not {text!r}") from None
    if value <= 0:
        raise ConfigError(f"option {name} must be a positive integer, not {text!r}")
    return value


def _offset(name: str, text: str | None, default: str) -> str | Position:
    value = (text or default).strip()
    return value if value in ("earliest", "latest") else Position.parse(value)


@dataclass(frozen=True, slots=True)
class SourceOptions:
    """Everything a planner or a partition reader needs, picklable."""

    metadata_uri: str
    password: bytes = b""
    digest: DigestType = DigestType.CRC32C
    ledgers: LedgerSpec | None = None
    stream: str | None = None
    namespace: str = "default"
    max_entries_per_partition: int = DEFAULT_MAX_ENTRIES
    include_open: bool = False
    starting: str | Position = "earliest"
    ending: str | Position = "latest"
    max_records_per_trigger: int | None = None
    pushdown_filters: bool = False
    fail_on_data_loss: bool = True
    skip_unreadable: bool = False

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        """Spark's option map (keys case-insensitive) to validated options; ConfigError names the bad one."""
        o = {k.lower(): v for k, v in options.items()}
        uri = o.get("metadata_uri")
        if not uri:
            raise ConfigError("option metadata_uri is required (zk://host:port/ledgers)")
        if ("ledgers" in o) == ("stream" in o):
            raise ConfigError("give exactly one of the options ledgers (ids and ranges, e.g. '1,2,10-20') "
                              "and stream (a stream name)")
        digest = o.get("digest", "crc32c").strip().upper()
        if digest not in DigestType.__members__:
            raise ConfigError(f"option digest must be one of crc32c, mac, dummy, not {o['digest']!r}")
        return cls(metadata_uri=uri, password=o.get("password", "").encode(), digest=DigestType[digest],
                   ledgers=parse_ledgers(o["ledgers"]) if "ledgers" in o else None, stream=o.get("stream"),
                   namespace=o.get("namespace", "default"),
                   max_entries_per_partition=_positive("max_entries_per_partition",
                                                       o.get("max_entries_per_partition")) or DEFAULT_MAX_ENTRIES,
                   include_open=_bool("include_open", o.get("include_open", "false")),
                   starting=_offset("startingOffsets", o.get("startingoffsets"), "earliest"),
                   ending=_offset("endingOffsets", o.get("endingoffsets"), "latest"),
                   max_records_per_trigger=_positive("maxRecordsPerTrigger", o.get("maxrecordspertrigger")),
                   pushdown_filters=_bool("pushdown_filters", o.get("pushdown_filters", "false")),
                   fail_on_data_loss=_bool("failOnDataLoss", o.get("failondataloss", "true")),
                   skip_unreadable=_bool("skipUnreadable", o.get("skipunreadable", "false")))


def chunk_entries(planned_bytes: int, entries: int) -> int:
    """Entries per range read and Arrow batch: about BATCH_BYTES of payload, at most BATCH_ROWS_MAX
    rows, at least one. Bounds a partition reader's memory whatever the ledger's size."""
    per_entry = max(1, planned_bytes // max(1, entries))
    return max(1, min(BATCH_ROWS_MAX, BATCH_BYTES // per_entry))
