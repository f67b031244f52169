"""The bookie wire protocol: op codes, flags, status codes and the frame codec.

The codec itself is Cython (`bookkeeper._ext.wire`); this package names its
constants so that client and bookie share one definition. Byte layout:
docs/protocol.md.
"""
from __future__ import annotations

import enum

from bookkeeper._ext.wire import (  # re-exported: the codec's one home
    ENTRY_HEADER_BYTES,
    MASTER_KEY_BYTES,
    PROTOCOL_VERSION,
    REQUEST_HEADER_BYTES,
    RESPONSE_HEADER_BYTES,
    FrameError,
    encode_request,
    encode_responses,
    entry_header,
    parse_requests,
    parse_responses,
)

__all__ = ["DEFAULT_MAX_FRAME_BYTES", "ENTRY_HEADER_BYTES", "MASTER_KEY_BYTES", "MAX_LEDGER_ID", "NO_KEY",
           "PROTOCOL_VERSION", "REQUEST_HEADER_BYTES", "RESPONSE_HEADER_BYTES", "Flag", "FrameError", "Op",
           "Status", "encode_request", "encode_responses", "entry_header", "parse_requests", "parse_responses",
           "shard_for_ledger"]

DEFAULT_MAX_FRAME_BYTES = 5 * 1024 * 1024
MAX_LEDGER_ID = 2**63 - 1  # ids past 10^10 - 1 live in metadata's 19-digit subtree (docs/metadata.md)
NO_KEY = bytes(MASTER_KEY_BYTES)


class Op(enum.IntEnum):
    ADD_ENTRY = 1
    READ_ENTRY = 2
    READ_LAC = 3
    GET_BOOKIE_INFO = 4
    WRITE_LAC = 5      # an idle writer's LAC (entry_id), advisory: kept in memory, never journaled
    START_TLS = 6      # the client's first frame when it wants TLS: answered OK, then the TLS handshake
    AUTH = 7           # one round of an authentication exchange (payload: u8 n, plug-in name, plug-in payload)
    WHOAMI = 8         # the connection's principal and roles, as JSON: what the client records as a ledger's creator


class Flag(enum.IntFlag):
    NONE = 0
    RECOVERY_ADD = 1   # ADD_ENTRY: accepted on a fenced ledger (ledger recovery rewrites)
    FENCE = 2          # READ_ENTRY / READ_LAC: fence the ledger (needs the master key)
    LONG_POLL = 4      # READ_ENTRY: wait up to aux ms for the entry to be added


class Status(enum.IntEnum):
    """Mirrors the codes of bookkeeper.errors (error_for_status)."""

    OK = 0
    NO_SUCH_LEDGER = 1
    NO_SUCH_ENTRY = 2
    FENCED = 3
    UNAUTHORIZED = 4
    BAD_REQUEST = 5
    TOO_LARGE = 6
    UNKNOWN_OP = 7
    READ_ONLY = 8
    SERVER_ERROR = 9
    TIMEOUT = 10
    AUTHENTICATION = 12  # not (or no longer) authenticated; the payload says why (UTF-8)
    FORBIDDEN = 13       # the principal lacks the op's role; the payload names both (UTF-8)


def shard_for_ledger(ledger_id: int, shards: int) -> int:
    """Which shard of a bookie owns a ledger: the one function both sides call.

    A 64-bit multiplicative hash (Fibonacci hashing) spreads sequential ledger ids
    and ids with common low bits evenly over the shards.
    """
    return (((ledger_id * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) >> 32) % shards
