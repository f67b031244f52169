"""One error root and one registry keyed by the wire status code.

Why one registry: the bookie answers with a status code, the client turns it into
an exception, and both sides must agree on every code. `error_for_status` is the
only place a wire status becomes an exception.
"""
from __future__ import annotations


class BKError(Exception):
    """Root of every BookKeeper error. `retriable` says whether trying again may succeed."""

    code: int = 100
    retriable: bool = False


class ProtocolError(BKError):
    """A peer sent bytes that are not a valid frame, or an op it does not support."""

    code = 5


class NoSuchLedgerError(BKError):
    """The ledger does not exist (in metadata, or on the bookie asked)."""

    code = 1


class NoSuchEntryError(BKError):
    """The entry does not exist, or lies past the LAC of an open ledger."""

    code = 2


class LedgerFencedError(BKError):
    """The ledger was fenced by a recovery open: this writer can add no more."""

    code = 3


class UnauthorizedError(BKError):
    """Wrong password (master key) for the ledger."""

    code = 4


class TooLargeError(ProtocolError):
    """A frame or entry over the configured maximum size."""

    code = 6


class UnknownOpError(ProtocolError):
    """The bookie does not know the requested operation."""

    code = 7


class BookieReadOnlyError(BKError):
    """The bookie is read-only and refuses adds."""

    code = 8
    retriable = True


class BookieServerError(BKError):
    """The bookie failed internally (disk error, full disk); it keeps serving others."""

    code = 9
    retriable = True


class TimeoutError(BKError):  # noqa: A001 - the public name docs/api.md fixes
    """An operation did not complete within its timeout."""

    code = 10
    retriable = True


class BookieUnavailableError(BKError):
    """No connection to the bookie (refused, reset, closed)."""

    code = 11
    retriable = True


class AuthenticationError(BKError):
    """A peer could not be authenticated, or would not authenticate us: TLS refused (a plain
    peer where TLS is required, an untrusted or expired certificate, a certificate naming
    another bookie id) or the AUTH exchange failed (bad signature, expired token, unknown
    plug-in). The message names the bookie, the plug-in or TLS, and the reason."""

    code = 12


class AuthorizationError(BKError):
    """An authenticated principal lacks the role an operation needs; the message names the
    principal and the missing role."""

    code = 13


class NotEnoughBookiesError(BKError):
    """Fewer writable bookies are registered than the ensemble needs."""

    code = 20


class LedgerClosedError(BKError):
    """The ledger is closed: it takes no more adds."""

    code = 21


class DigestMismatchError(BKError):
    """An entry failed its checksum or MAC on read: it is never returned."""

    code = 22


class MetadataVersionError(BKError):
    """A compare-and-set on ledger metadata lost to a concurrent update."""

    code = 23
    retriable = True


class TooManyOutstandingAddsError(BKError):
    """add_entry_async at the max_outstanding_adds bound (await add_entry waits for room instead)."""

    code = 25
    retriable = True


class MetadataServiceError(BKError):
    """ZooKeeper could not be reached or failed the call (connection loss, session expiry)."""

    code = 26
    retriable = True


class ZooKeeperUnreachableError(MetadataServiceError):
    """No ZooKeeper server of the metadata URI answered: every address refused, was unreachable
    or did not answer a TCP connect in time, or one accepted TCP and started no session within
    the session timeout (hung). The message names each host:port and why (meta/zk_connect.py)."""

    code = 48


class MetadataAuthError(BKError):
    """ZooKeeper refused the metadata operation for want of credentials (none, or wrong ones:
    NoAuth, AuthFailed); the message says which and for which path. Not retriable: the same
    credentials fail the same way."""

    code = 49


class LedgerExistsError(BKError):
    """A ledger with that id already exists."""

    code = 24


class ConfigError(BKError):
    """Invalid configuration (bad key, bad value, missing metadata_uri)."""

    code = 30


class CookieMismatchError(BKError):
    """The bookie's directories do not match the cookie registered for its id."""

    code = 31


class StreamExistsError(BKError):
    """create_stream: a stream of that name already exists in the namespace."""

    code = 40


class StreamNotFoundError(BKError):
    """The stream does not exist in the namespace (or was deleted meanwhile)."""

    code = 41


class StreamLockLostError(LedgerFencedError):
    """This stream writer lost its lock (taken over, or its ZooKeeper session expired):
    it writes no more. A LedgerFencedError, as the stream's API promises the old writer."""

    code = 42


class InvalidPositionError(BKError, ValueError):
    """A string that is not a stream position SEQ:ENTRY:SLOT (bad input: a ValueError too)."""

    code = 43


class TxidOrderError(BKError, ValueError):
    """A given txid is not above the stream's last one: txids increase strictly."""

    code = 44


class InvalidStreamNameError(BKError, ValueError):
    """A namespace or stream name that cannot be a ZooKeeper node name."""

    code = 45


class WriterClosedError(BKError):
    """write() on a stream writer that was closed or failed earlier."""

    code = 46


class DataLossError(BKError):
    """A stream read (the Spark source) starts in records that retention or truncation deleted
    before it read them, and failOnDataLoss is true (the default)."""

    code = 47


_BY_STATUS: dict[int, type[BKError]] = {
    cls.code: cls
    for cls in (NoSuchLedgerError, NoSuchEntryError, LedgerFencedError, UnauthorizedError,
                ProtocolError, TooLargeError, UnknownOpError, BookieReadOnlyError,
                BookieServerError, TimeoutError, AuthenticationError, AuthorizationError)
}


def error_for_status(status: int, detail: str = "") -> BKError:
    """The exception a non-zero wire status stands for."""
    cls = _BY_STATUS.get(status, BookieServerError)
    return cls(detail or f"{cls.__name__} (status {status})")
