"""One error root and one registry of error codes.

Why one registry: the bookie answers with a status code, the client turns it into
an exception, and both sides must agree on every code. A wire error's code is its
`bookkeeper.proto.Status` (the wire's one definition); every class that sets a code
is registered when it is defined, and a second class claiming a code is refused
(TypeError at import). `error_for_status` is the only place a wire status becomes an
exception.
"""
from __future__ import annotations

from typing import Any

from bookkeeper.proto import Status

ROOT_CODE = 100
_REGISTRY: dict[int, type[BKError]] = {}


class BKError(Exception):
    """Root of every BookKeeper error. `retriable` says whether trying again may succeed."""

    code: int = ROOT_CODE
    retriable: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "code" not in cls.__dict__:
            return  # it shares its parent's code (a narrower case of the same error)
        owner = BKError if cls.code == ROOT_CODE else _REGISTRY.setdefault(cls.code, cls)
        if owner is not cls:
            raise TypeError(f"error code {cls.code} of {cls.__name__} is already {owner.__name__}'s: "
                            "each code names one error")


class ProtocolError(BKError):
    """A peer sent bytes that are not a valid frame, or an op it does not support."""

    code = int(Status.BAD_REQUEST)


class NoSuchLedgerError(BKError):
    """The ledger does not exist (in metadata, or on the bookie asked)."""

    code = int(Status.NO_SUCH_LEDGER)


class NoSuchEntryError(BKError):
    """The entry does not exist, or lies past the LAC of an open ledger."""

    code = int(Status.NO_SUCH_ENTRY)


class LedgerFencedError(BKError):
    """The ledger was fenced by a recovery open: this writer can add no more."""

    code = int(Status.FENCED)


class UnauthorizedError(BKError):
    """Wrong password (master key) for the ledger."""

    code = int(Status.UNAUTHORIZED)


class TooLargeError(ProtocolError):
    """A frame or entry over the configured maximum size."""

    code = int(Status.TOO_LARGE)


class UnknownOpError(ProtocolError):
    """The bookie does not know the requested operation."""

    code = int(Status.UNKNOWN_OP)


class BookieReadOnlyError(BKError):
    """The bookie is read-only and refuses adds."""

    code = int(Status.READ_ONLY)
    retriable = True


class BookieServerError(BKError):
    """The bookie failed internally (disk error, full disk); it keeps serving others."""

    code = int(Status.SERVER_ERROR)
    retriable = True


class TimeoutError(BKError):  # noqa: A001 - the public name docs/api.md fixes
    """An operation did not complete within its timeout."""

    code = int(Status.TIMEOUT)
    retriable = True


class BookieUnavailableError(BKError):
    """No connection to the bookie (refused, reset, closed)."""

    code = 11
    retriable = True


class ClientClosedError(BookieUnavailableError):
    """The client was closed: a request made after close() is refused, not sent (it made a
    new connection, and a sweeper task that ran until the loop ended)."""

    code = 35
    retriable = False


class AuthenticationError(BKError):
    """A peer could not be authenticated, or would not authenticate us: TLS refused (a plain
    peer where TLS is required, an untrusted or expired certificate, a certificate naming
    another bookie id) or the AUTH exchange failed (bad signature, expired token, unknown
    plug-in). The message names the bookie, the plug-in or TLS, and the reason."""

    code = int(Status.AUTHENTICATION)


class AuthorizationError(BKError):
    """An authenticated principal lacks the role an operation needs; the message names the
    principal and the missing role."""

    code = int(Status.FORBIDDEN)


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


class LedgerIdsExhaustedError(MetadataServiceError):
    """No ledger id is left to hand out: the block counter reached MAX_LEDGER_ID (2^63 - 1), or
    a layout-1 cluster's sequential counter wrapped at 2^31 (`bk metadata upgrade` lifts that).
    Loud by design: the alternative is an id handed out twice."""

    code = 50
    retriable = False


class MetadataLayoutError(BKError):
    """The cluster's metadata layout (`<root>/LAYOUT`) is not one this process can write: newer
    than it knows, or upgraded past the id allocator it was about to use. The message names
    the layout and what to do (`bk metadata upgrade`, or upgrade this client)."""

    code = 51


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


class MetadataFormatError(BKError):
    """Metadata that cannot be read: not JSON, corrupt, or of a format newer than this code
    (ledger or stream metadata, a security znode, an under-replication mark); the message
    names what. Not retriable: the same bytes fail the same way (upgrade, or repair them)."""

    code = 27


class InvalidArgumentError(BKError, ValueError):
    """A call's arguments cannot be served: quorum sizes out of order, an empty or inverted
    entry range, a ledger id out of range, a stream segment out of turn (bad input: a
    ValueError too)."""

    code = 28


class BookieStartError(BKError):
    """A bookie could not start: a directory is in use by another running bookie, or a shard
    exited or was not ready in time; the message names which."""

    code = 32


class InternalError(BKError):
    """An unexpected error (a defect) ended an operation: an ensemble change, a stream segment
    roll or an auto-recovery step raised something no BookKeeper error stands for, or
    ZooKeeper failed a multi-op in a way the code does not expect. The message names it; the
    log has its traceback. Please report it."""

    code = 34


class RecoveryError(BKError):
    """Recovery of a ledger could not finish: too few bookies answered the fence, or an entry
    was neither readable nor denied by enough of them. Retriable: the bookies may come back."""

    code = 33
    retriable = True


_BY_STATUS: dict[int, type[BKError]] = {status: _REGISTRY[status] for status in Status if status != Status.OK}


def error_for_status(status: int, detail: str = "") -> BKError:
    """The exception a non-zero wire status stands for."""
    cls = _BY_STATUS.get(status, BookieServerError)
    return cls(detail or f"{cls.__name__} (status {status})")
