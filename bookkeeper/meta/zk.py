"""ZooKeeper metadata store (kazoo): the one place that knows the znode layout.

Layout under the root (default /ledgers), see docs/metadata.md:
  INSTANCEID                      cluster instance id, written once
  security                        JSON: the public key ledger passwords are sealed to, the
                                  read-only principal's digest id (meta/zk_security.py)
  available/<bookie_id>           ephemeral: JSON registration (rack, shards)
  available/readonly/<bookie_id>  ephemeral: same, for read-only bookies
  cookies/<bookie_id>             JSON cookie: which directories this bookie id owns
  decommissioning/<bookie_id>     an operator asked this bookie to turn read-only for good
  LAYOUT                          JSON {"layout": N}: the metadata layout version (absent: 1)
  idblocks                        layout 2: the next ledger id not yet reserved (decimal)
  idgen/ID-<seq>                  layout 1: transient sequential nodes, one per ledger id;
                                  retired (read-only ACL) from layout 2 on
  underreplication/...            auto-recovery: marks, locks, election (meta/underreplication.py)
  <2 digits>/<4 digits>/L<4 digits>  ledger metadata of ids < 10^10, by the 10-digit id
  <3>/<4>/<4>/<4>/L<4 digits>        ledger metadata of ids >= 10^10, by the 19-digit id

With credentials (ZkSecurity.auth) every znode it writes carries the ACL of
meta/zk_security.py (kazoo's default_acl, so ensure_path's parents too), and ZooKeeper's
NoAuth / AuthFailed become MetadataAuthError naming the operation, the path and the user
(GuardedKazooClient: the one place they are mapped).

Thread-safety: kazoo is thread-safe. The asyncio client calls the blocking methods from an
executor, so a slow ZooKeeper never blocks the event loop; a ledger's create, read, write,
watch and delete it sends through kazoo's async API instead (the `*_async` methods return a
Pending, which the client awaits without a thread: BookKeeper.metadata_request).
"""
from __future__ import annotations

import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from kazoo.client import KazooClient, TransactionRequest
from kazoo.exceptions import (AuthFailedError, BadVersionError, KazooException, NoAuthError, NodeExistsError,
                              NoNodeError, NotEmptyError, RolledBackError, RuntimeInconsistency, ZookeeperError)
from kazoo.hosts import collect_hosts
from kazoo.protocol.states import WatchedEvent
from kazoo.security import ACL, Permissions, make_acl

from bookkeeper.errors import (
    BKError,
    ConfigError,
    InvalidArgumentError,
    LedgerExistsError,
    LedgerIdsExhaustedError,
    MetadataAuthError,
    MetadataLayoutError,
    MetadataServiceError,
    MetadataVersionError,
    NoSuchLedgerError,
)
from bookkeeper.meta.ledger_metadata import LedgerMetadata
from bookkeeper.meta.sealing import SealError, key_id, load_private_key, public_bytes, seal, unseal
from bookkeeper.meta.zk_connect import start_client
from bookkeeper.meta.zk_security import (SecurityDoc, ZkSecurity, auth_failed_message, kazoo_options,
                                         no_auth_message, node_acls)
from bookkeeper.proto import MAX_LEDGER_ID

log = logging.getLogger(__name__)


T = TypeVar("T")
SCHEMES = ("zk://", "zk+tls://")
# How long close() waits for kazoo's stop(): past it the session is left to end on its own.
CLOSE_TIMEOUT_S = 15.0


def parse_metadata_uri(uri: str) -> tuple[str, str]:
    """'zk://h1:p1,h2:p2/ledgers' -> ('h1:p1,h2:p2', '/ledgers'); zk+tls:// alike (uses_tls)."""
    scheme = next((s for s in SCHEMES if uri.startswith(s)), None)
    if scheme is None:
        raise ConfigError(f"metadata URI must start with zk:// (or zk+tls:// for ZooKeeper's TLS port), got {uri!r}")
    rest = uri[len(scheme):]
    hosts, _, path = rest.partition("/")
    if not hosts:
        raise ConfigError(f"metadata URI names no ZooKeeper host: {uri!r}")
    try:
        collect_hosts(hosts)  # kazoo's own parse, so a bad host:port is an error here, not a traceback later
    except ValueError as e:
        raise ConfigError(f"metadata URI has a bad host:port list {hosts!r}: {e}") from None
    root = "/" + path.strip("/") if path.strip("/") else "/ledgers"
    return hosts, root


def uses_tls(uri: str) -> bool:
    """Whether the URI names ZooKeeper's secure client port (zk+tls://)."""
    return uri.startswith("zk+tls://")


def metadata_auth_error(error: NoAuthError | AuthFailedError, op: str, path: str,
                        security: ZkSecurity) -> MetadataAuthError:
    """kazoo's NoAuth / AuthFailed as the MetadataAuthError that says which (the one mapping)."""
    if isinstance(error, AuthFailedError):
        return MetadataAuthError(auth_failed_message(security))
    return MetadataAuthError(no_auth_message(op, path, security))


class GuardedKazooClient(KazooClient):  # type: ignore[misc]  # kazoo is untyped
    """kazoo's client whose synchronous calls raise MetadataAuthError instead of NoAuthError and
    AuthFailedError, so every caller (this module, under-replication, streams, kazoo's own
    recipes) reports a refusal the same way. Async calls and multi-op results map with
    metadata_auth_error."""

    def __init__(self, *args: Any, security: ZkSecurity, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.security = security

    def transaction(self) -> TransactionRequest:
        return _GuardedTransaction(self)


_MULTI_OPS = {"Create": "create", "Delete": "delete", "SetData": "write", "CheckVersion": "check"}


class _GuardedTransaction(TransactionRequest):  # type: ignore[misc]  # kazoo is untyped
    """A multi-op refused for want of credentials raises instead of returning NoAuthError among
    its results (the other results are all RolledBackError then: nothing happened)."""

    def commit(self) -> list[Any]:
        results: list[Any] = super().commit()
        for op, result in zip(self.operations, results):
            if isinstance(result, (NoAuthError, AuthFailedError)):
                what = _MULTI_OPS.get(type(op).__name__, type(op).__name__)
                raise metadata_auth_error(result, f"{what} (in a multi-op)", op.path, self.client.security)
        return results


class Pending(Generic[T]):
    """One request sent through kazoo's async API (or a few, pipelined: ZooKeeper answers a
    session's requests in order), and `finish`, which makes the caller's answer of their
    replies, reading each with reply() and mapping kazoo's errors to ours.

    Why: a blocking kazoo call per ledger create, read, write or delete held an executor
    thread for a round trip, and cost two thread hand-offs more than the reply's own: of a
    create's client CPU, ~60% was spent outside the event loop's thread. The synchronous
    methods are result() of the same requests, so each request's meaning is written once."""

    __slots__ = ("_finish", "_replies")

    def __init__(self, finish: Callable[..., T], *replies: Any) -> None:
        self._finish = finish
        self._replies = replies

    def result(self) -> T:
        """The answer, waiting for the replies (any thread: kazoo's connection thread sets them)."""
        return self._finish(*self._replies)

    def then(self, done: Callable[[T | None, BaseException | None], None]) -> None:
        """done(answer, None) or done(None, error) once the last reply has come, on kazoo's
        completion thread (finish runs there too: it must not block on kazoo), or on the
        connection thread once the client is stopping."""
        def settle(_last: Any) -> None:
            try:
                value = self._finish(*self._replies)
            except BaseException as e:  # noqa: BLE001 - handed to done, which raises it where awaited
                done(None, e)
            else:
                done(value, None)
        if self._replies:
            self._replies[-1].rawlink(settle)
        else:
            settle(None)  # nothing was sent (every op refused before): the answer is at hand


def _guard(name: str, op: str) -> None:
    method = getattr(KazooClient, name)

    @functools.wraps(method)
    def call(self: GuardedKazooClient, path: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, path, *args, **kwargs)
        except (NoAuthError, AuthFailedError) as e:
            raise metadata_auth_error(e, op, path, self.security) from None
    setattr(GuardedKazooClient, name, call)


for _name, _op in (("create", "create"), ("ensure_path", "create"), ("get", "read"), ("get_children", "list"),
                   ("set", "write"), ("delete", "delete"), ("exists", "stat"), ("get_acls", "read the ACL of"),
                   ("set_acls", "set the ACL of")):
    _guard(_name, _op)


LEGACY_MAX_ID = 10**10 - 1  # the largest id the 10-digit paths hold
BUCKET_SPAN = 10_000  # ledgers per bucket: the leaf's 4 digits
# The digit widths of the levels above a bucket's leaves, per subtree, in id order: ids below
# 10^10 (Apache BookKeeper's HierarchicalLedgerManager: 2/4/L4), then the rest
# (LongHierarchicalLedgerManager: 3/4/4/4/L4 of the 19-digit id). A level's names differ in
# length between the two, so each lister tells them apart and nothing ever moves.
SUBTREES = ((2, 4), (3, 4, 4, 4))
SUPPORTED_LAYOUT = 2  # the newest metadata layout this code reads and writes (docs/metadata.md)
FIRST_BLOCK, MAX_BLOCK = 64, 4096  # ids a client reserves at once: doubling from the first to the max
MULTI_OP_BYTES = 256 * 1024  # metadata bytes per multi-op: a quarter of ZooKeeper's default jute.maxbuffer
RETIRED_IDGEN = (b"retired by `bk metadata upgrade` (layout 2): ledger ids come from idblocks; "
                 b"a client creating under idgen predates that layout and must be upgraded")


def retired_acls(acls: list[ACL] | None) -> list[ACL]:
    """The ACL of a retired idgen: whoever could write it keeps read and admin only (no create:
    an old client's allocation fails), or, on an open tree (acls None), everyone does."""
    if not acls:
        return [make_acl("world", "anyone", read=True, admin=True)]
    return [ACL(a.perms & (Permissions.READ | Permissions.ADMIN), a.id) for a in acls]


def ledger_path(root: str, ledger_id: int) -> str:
    """Hierarchical path of a ledger's metadata: 2/4/L4 digits below 10^10 (as Apache BookKeeper's
    HierarchicalLedgerManager), 3/4/4/4/L4 of the 19-digit id above (its LongHierarchical one)."""
    if not 0 <= ledger_id <= MAX_LEDGER_ID:
        raise InvalidArgumentError(f"ledger id out of range: {ledger_id}")
    if ledger_id <= LEGACY_MAX_ID:
        s = f"{ledger_id:010d}"
        return f"{root}/{s[0:2]}/{s[2:6]}/L{s[6:10]}"
    s = f"{ledger_id:019d}"
    return f"{root}/{s[0:3]}/{s[3:7]}/{s[7:11]}/{s[11:15]}/L{s[15:19]}"


def _digits_below(root: str, bucket: str) -> str:
    return "".join(bucket[len(root) + 1:].split("/"))


def bucket_base(root: str, bucket: str) -> int:
    """The smallest id a bucket path (from ledger_buckets) can hold."""
    return int(_digits_below(root, bucket)) * BUCKET_SPAN


class _IdBlock:
    """The ids this store reserved and has not handed out: [next, end). Thread-safe: creates
    come from the client's loop and from executor threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.next = self.end = 0
        self.size = FIRST_BLOCK

    def take(self) -> int | None:
        """An id, or None when the block is used up or being refilled: the refill holds the lock
        through a ZooKeeper round trip, and the event loop's caller must not wait for it."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            if self.next >= self.end:
                return None
            self.next += 1
            return self.next - 1
        finally:
            self.lock.release()


class ZkMetadataStore:
    """Ledger metadata, bookie registrations, cookies and id allocation in ZooKeeper."""

    def __init__(self, uri: str, *, session_timeout_ms: int = 10_000, connect_timeout_s: float = 2.0,
                 create: bool = True, security: ZkSecurity | None = None, client: Any = None) -> None:
        """Connect; create=True (bookies) lays out a new cluster's znodes, create=False (clients)
        refuses a path that holds no cluster: a mistyped root must not look like an empty cluster.
        security: credentials (and ACLs on what this store writes), TLS files for a zk+tls://
        URI, the seal key of a bookie (which publishes its public key when the cluster has none).

        ZooKeeperUnreachableError when no server answers (meta/zk_connect.py): at once when every
        address refuses or is unreachable, after connect_timeout_s per address that does not
        answer a TCP connect, after the session timeout when one accepts TCP and starts no session.
        MetadataAuthError when the cluster's ACLs refuse these credentials (or their absence).
        client: a started kazoo-compatible client to use instead of connecting (the simulator's
        znode-level ZooKeeper, bookkeeper/testing/sim); the URI then only names the root.
        """
        self.uri = uri
        self.hosts, self.root = parse_metadata_uri(uri)
        self.security = security or ZkSecurity()
        self.doc = SecurityDoc()
        self._private_key: X25519PrivateKey | None = None
        self._ids = _IdBlock()
        self.layout = 1  # read below: ensure_layout (bookies) or _check_cluster (clients)
        self._injected = client is not None
        self.zk: KazooClient = client if client is not None else start_client(
            self.hosts, session_timeout_s=session_timeout_ms / 1000.0, connect_timeout_s=connect_timeout_s,
            client_factory=functools.partial(GuardedKazooClient, security=self.security,
                                             **kazoo_options(self.security, tls=uses_tls(uri))))
        try:
            self.zk.DataWatch(self.security_path, self._on_security)
            if create:
                self.ensure_layout()
                if self.security.seal_key_file:
                    self.publish_seal_key(public_bytes(self.private_key()))
            else:
                self._check_cluster()
        except BaseException:
            self.close()
            raise

    def _check_cluster(self) -> None:
        """A read (not a stat: ZooKeeper checks no ACL for exists) of INSTANCEID, so that a client
        the cluster's ACLs do not admit is told at connect, not at its first ledger."""
        try:
            self.zk.get(f"{self.root}/INSTANCEID")
        except NoNodeError:
            raise ConfigError(f"no BookKeeper cluster at {self.uri}: {self.root}/INSTANCEID does not exist "
                          f"(check the path, or start a bookie first)") from None
        self.layout = self.layout_version()

    def close(self) -> None:
        """End the session, waiting at most CLOSE_TIMEOUT_S. Why bounded: kazoo's stop() joins its
        callback threads, and a watch recipe (DataWatch, ChildrenWatch) re-reading its node on
        the closing session's last events retries without end in one of them when the session
        was not connected at that moment; a close that never returns kept a Ctrl-C'd `bk stream
        tail` from exiting. kazoo's threads are daemons: what is left ends with the process.
        An injected client (the simulator's) has no threads: it stops here, on this thread."""
        if self._injected:
            self.zk.stop()
            self.zk.close()
            return
        failed: list[BaseException] = []

        def stop() -> None:
            try:
                try:
                    self.zk.stop()
                finally:
                    self.zk.close()
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                failed.append(e)
        stopper = threading.Thread(target=stop, name="zk-close", daemon=True)
        stopper.start()
        stopper.join(CLOSE_TIMEOUT_S)
        if stopper.is_alive():
            log.warning("ZooKeeper session to %s did not close within %.0f s; left to end on its own",
                        self.hosts, CLOSE_TIMEOUT_S)
        elif failed:
            raise failed[0]

    @property
    def connected(self) -> bool:
        return bool(self.zk.connected)

    # -- security: ACLs, the seal key -----------------------------------------------
    @property
    def security_path(self) -> str:
        return f"{self.root}/security"

    def _on_security(self, data: bytes | None, _stat: Any, _event: Any = None) -> None:
        """The security znode now (kazoo's DataWatch: at once, then at every change): the key new
        passwords are sealed to, and the ACL of what this store creates from here on."""
        self._adopt(SecurityDoc.from_json(data))

    def _adopt(self, doc: SecurityDoc) -> None:
        self.doc = doc
        self.zk.default_acl = node_acls(doc.readonly) if self.security.auth else None

    def update_security(self, change: Callable[[SecurityDoc], SecurityDoc]) -> SecurityDoc:
        """Compare-and-set the security znode (created if absent) with change(current)."""
        while True:
            try:
                data, stat = self.zk.get(self.security_path)
            except NoNodeError:
                new = change(SecurityDoc())
                try:
                    self.zk.create(self.security_path, new.to_json(), makepath=True)
                except NodeExistsError:
                    continue
                self._adopt(new)
                return new
            current = SecurityDoc.from_json(data)
            new = change(current)
            if new == current:
                return current
            try:
                self.zk.set(self.security_path, new.to_json(), version=stat.version)
            except BadVersionError:
                continue
            self._adopt(new)
            return new

    def publish_seal_key(self, public_key: bytes) -> None:
        """Make public_key the one clients seal ledger passwords to, unless the cluster has one:
        a different one is an error (bookies must share the private key), never replaced."""
        def change(doc: SecurityDoc) -> SecurityDoc:
            if doc.seal_public_key is None:
                return SecurityDoc(seal_public_key=public_key, readonly=doc.readonly)
            if doc.seal_public_key != public_key:
                raise SealError(f"the cluster seals ledger passwords to key {key_id(doc.seal_public_key)} "
                                f"({self.security_path}), but password_seal_key_file holds key {key_id(public_key)}: "
                                f"every bookie needs the same private key")
            return doc
        self.update_security(change)

    def private_key(self) -> X25519PrivateKey:
        """The seal key of security.seal_key_file (read once)."""
        if not self.security.seal_key_file:
            raise SealError("no password_seal_key_file: this process cannot open sealed ledger passwords")
        if self._private_key is None:
            self._private_key = load_private_key(self.security.seal_key_file)
        return self._private_key

    def _stored(self, md: LedgerMetadata) -> bytes:
        """The znode bytes of md: its password sealed when the cluster has a public key."""
        key = self.doc.seal_public_key
        if md.password is not None and key is not None:
            md = md.replace(sealed_password=seal(key, md.password, md.ledger_id), password=None)
        return md.serialize()

    def ledger_password(self, md: LedgerMetadata) -> bytes:
        """The ledger's password from its metadata: unsealed with this store's private key (a
        SealError naming what is missing otherwise), or a clear one a format-1 ledger kept."""
        if md.password is not None:
            return md.password
        if md.sealed_password is None:
            raise SealError(f"ledger {md.ledger_id} has no stored password (created before it was kept)")
        if not self.security.seal_key_file:
            raise SealError(f"ledger {md.ledger_id}: its password is sealed and this process holds no private key "
                            f"(set password_seal_key_file to the cluster's seal key)")
        return unseal(self.private_key(), md.sealed_password, md.ledger_id)

    # -- layout ------------------------------------------------------------
    def ensure_layout(self) -> None:
        """The cluster's znodes; a new cluster starts at the newest layout (its INSTANCEID,
        LAYOUT and id counter made in one multi-op), an existing one keeps its own until an
        operator runs `bk metadata upgrade` (old clients may still be running)."""
        for sub in ("available/readonly", "cookies", "decommissioning"):
            self.zk.ensure_path(f"{self.root}/{sub}")
        if self.zk.exists(f"{self.root}/INSTANCEID") is None:
            tx = self.zk.transaction()
            tx.create(f"{self.root}/INSTANCEID", uuid.uuid4().hex.encode())
            tx.create(self.layout_path, self._layout_doc(SUPPORTED_LAYOUT))
            tx.create(self.idblocks_path, b"0")
            tx.create(self.idgen_path, RETIRED_IDGEN, acl=retired_acls(self.zk.default_acl))
            results = tx.commit()
            if not any(isinstance(r, Exception) for r in results):
                self.layout = SUPPORTED_LAYOUT
                return
            if not any(isinstance(r, NodeExistsError) for r in results):
                raise MetadataLayoutError(f"could not lay out a new cluster at {self.root}: {results}")
        self.zk.ensure_path(self.idgen_path)
        self.layout = self.layout_version()

    def instance_id(self) -> str:
        return self.zk.get(f"{self.root}/INSTANCEID")[0].decode()

    # -- the layout version and the id allocator --------------------------------------
    @property
    def layout_path(self) -> str:
        return f"{self.root}/LAYOUT"

    @property
    def idblocks_path(self) -> str:
        return f"{self.root}/idblocks"

    @property
    def idgen_path(self) -> str:
        return f"{self.root}/idgen"

    @staticmethod
    def _layout_doc(version: int) -> bytes:
        return json.dumps({"layout": version, "allocator": "blocks" if version >= 2 else "sequential"}).encode()

    def layout_version(self) -> int:
        """The cluster's metadata layout (1 when LAYOUT is absent: a cluster made before it).
        MetadataLayoutError for a layout newer than this code: it would write what the
        cluster's other members no longer read."""
        try:
            data, _ = self.zk.get(self.layout_path)
        except NoNodeError:
            return 1
        try:
            version = int(json.loads(data)["layout"])
        except (ValueError, KeyError, TypeError):
            raise MetadataLayoutError(f"{self.layout_path} holds no layout version: {data[:80]!r}") from None
        if version > SUPPORTED_LAYOUT:
            raise MetadataLayoutError(f"the cluster's metadata layout is {version}; this version of bookkeeper "
                                      f"knows up to {SUPPORTED_LAYOUT}: upgrade it")
        return version

    def allocate_ledger_id(self) -> int:
        """A cluster-unique ledger id, never handed out before. Layout 2: from this store's
        block, reserving the next block when it is used up (one compare-and-set on idblocks
        per block: a create costs ~1 ZooKeeper write, its metadata's); the ids left in a
        block when the store closes are skipped, never reused. Layout 1: a sequential znode,
        made and deleted (two writes), until its 32-bit counter wraps."""
        lid = self.take_ledger_id()
        if lid is not None:
            return lid
        if self.layout < 2:
            return self._sequential_id()
        block = self._ids
        with block.lock:
            if block.next >= block.end:
                block.next, block.end = self._reserve(block.size)
                block.size = min(block.size * 2, MAX_BLOCK)
            block.next += 1
            return block.next - 1

    def take_ledger_id(self) -> int | None:
        """An id from this store's reserved block without a ZooKeeper call, or None."""
        return self._ids.take()

    def _reserve(self, size: int) -> tuple[int, int]:
        """Reserve [first, first + size) on idblocks (compare-and-set; capped at MAX_LEDGER_ID)."""
        while True:
            data, stat = self.zk.get(self.idblocks_path)
            first = int(data)
            if first > MAX_LEDGER_ID:
                raise LedgerIdsExhaustedError(f"every ledger id up to {MAX_LEDGER_ID} was handed out "
                                              f"({self.idblocks_path} = {first})")
            end = min(first + size, MAX_LEDGER_ID + 1)
            try:
                self.zk.set(self.idblocks_path, str(end).encode(), version=stat.version)
            except BadVersionError:
                continue  # another client reserved meanwhile
            return first, end

    def _sequential_id(self) -> int:
        """Layout 1's allocation. The counter is a signed 32-bit int: past 2^31 - 1 it wraps
        and `ID--2147483648` would parse as an id already handed out, so that is an error."""
        try:
            path = self.zk.create(f"{self.idgen_path}/ID-", b"", sequence=True)
        except MetadataAuthError:
            if self.layout_version() >= 2:  # upgraded while this store ran: switch allocators
                self.layout = self.layout_version()
                return self.allocate_ledger_id()
            raise
        self.zk.delete_async(path)  # its reply is not waited for: the id is ours either way
        name = path.rsplit("/", 1)[1]
        if name.startswith("ID--"):
            raise LedgerIdsExhaustedError(f"layout 1's id counter ({self.idgen_path}) wrapped past 2^31 - 1: "
                                          f"run `bk metadata upgrade` (ids then come from {self.idblocks_path})")
        return int(name[3:])

    def layout_status(self) -> dict[str, Any]:
        """What `bk metadata status` prints."""
        layout = self.layout_version()
        if layout >= 2:
            next_id = int(self.zk.get(self.idblocks_path)[0])
        else:
            stat = self.zk.exists(self.idgen_path)
            next_id = stat.cversion if stat is not None else 0
        return {"layout": layout, "supported": SUPPORTED_LAYOUT,
                "allocator": "blocks" if layout >= 2 else "sequential", "next_id": next_id}

    def upgrade_layout(self) -> dict[str, Any]:
        """Move a layout-1 cluster to layout 2; a no-op at 2 (and safe to run again after a
        crash part way). Order: idgen is retired first (read-only ACL: an old client's
        create fails NoAuth from then on, naming the upgrade), then the counter starts past
        every id idgen can have handed out (its cversion bounds its sequence numbers) and
        every id in use, and LAYOUT is written with it in one multi-op."""
        if self.layout_version() >= 2:
            return self.layout_status()
        self.zk.ensure_path(self.idgen_path)
        if self.zk.get(self.idgen_path)[0] != RETIRED_IDGEN:  # a second run after a crash: already set,
            self.zk.set(self.idgen_path, RETIRED_IDGEN)        # and the retired ACL refuses the write
        self.zk.set_acls(self.idgen_path, retired_acls(self.zk.get_acls(self.idgen_path)[0] if self.security.auth
                                                       else None))
        stat = self.zk.exists(self.idgen_path)
        sequenced = stat.cversion if stat.cversion >= 0 else 2**31
        first = max(sequenced, self.max_ledger_id() + 1)
        tx = self.zk.transaction()
        try:
            data, counter = self.zk.get(self.idblocks_path)
            tx.set_data(self.idblocks_path, str(max(first, int(data))).encode(), version=counter.version)
        except NoNodeError:
            tx.create(self.idblocks_path, str(first).encode())
        tx.create(self.layout_path, self._layout_doc(2))
        results = tx.commit()
        if any(isinstance(r, Exception) for r in results) and self.layout_version() < 2:
            raise MetadataVersionError(f"the upgrade's multi-op failed ({results}); run it again")
        self.layout = 2
        return self.layout_status()

    def max_ledger_id(self) -> int:
        """The largest id with metadata (-1: none): the last bucket of the last subtree that
        has one, read from the end (a few listings, not a walk)."""
        for widths in reversed(SUBTREES):
            for bucket in self._buckets_of(widths, reverse=True):
                ids = self.bucket_ledger_ids(bucket)
                if ids:
                    return ids[-1]
        return -1

    # -- bookies -----------------------------------------------------------
    def _bookie_node(self, bookie_id: str, readonly: bool) -> str:
        return f"{self.root}/available/{'readonly/' if readonly else ''}{bookie_id}"

    def register_bookie(self, bookie_id: str, info: dict[str, Any], *, readonly: bool = False,
                        wait_stale_s: float = 0.0) -> None:
        """Create this bookie's ephemeral registration.

        A registration left by a previous incarnation (kill -9: its session has not
        expired yet) is taken over: the caller already proved, by the cookie, that it
        owns this bookie id and its disks.
        """
        path = self._bookie_node(bookie_id, readonly)
        data = json.dumps(info, sort_keys=True).encode()
        deadline = time.monotonic() + wait_stale_s
        while True:
            try:
                self.zk.create(path, data, ephemeral=True)
                return
            except NodeExistsError:
                stat = self.zk.exists(path)
                if stat is not None and stat.ephemeralOwner == self.zk.client_id[0]:
                    self.zk.set(path, data)
                    return
                if time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                log.warning("taking over stale registration of %s (session %x)", bookie_id,
                            stat.ephemeralOwner if stat else 0)
                try:
                    self.zk.delete(path)
                except NoNodeError:
                    pass

    def unregister_bookie(self, bookie_id: str, *, readonly: bool = False, timeout_s: float = 5.0) -> None:
        """Remove the registration; bounded, since it runs on the way down."""
        path = self._bookie_node(bookie_id, readonly)
        try:
            self.zk.delete_async(path).get(timeout=timeout_s)
        except NoNodeError:
            pass
        except (NoAuthError, AuthFailedError) as e:
            raise metadata_auth_error(e, "delete", path, self.security) from None

    def watch_bookies(self, changed: Callable[[], bool]) -> None:
        """Call changed() from kazoo's thread whenever the registered bookies may have changed: a
        child added or removed under available/ or available/readonly (registrations are
        ephemeral nodes, so a restart or a read-only switch is a removal and an addition), or a
        session state change (a watch may have missed events meanwhile). It is called once at
        once; when it returns False the watches and the listener are dropped."""
        for path in (f"{self.root}/available", f"{self.root}/available/readonly"):
            self.zk.ChildrenWatch(path, lambda _children: changed())

        def on_state(_state: Any) -> bool:
            return not changed()  # kazoo removes a listener that returns True
        self.zk.add_listener(on_state)

    def get_bookies(self, *, readonly: bool = False) -> dict[str, dict[str, Any]]:
        """Registered bookies (writable, or read-only) -> registration info."""
        base = f"{self.root}/available" + ("/readonly" if readonly else "")
        out: dict[str, dict[str, Any]] = {}
        for child in self.zk.get_children(base):
            if child == "readonly":
                continue
            try:
                data, _ = self.zk.get(f"{base}/{child}")
            except NoNodeError:
                continue
            out[child] = json.loads(data)
        return out

    # -- cookies -----------------------------------------------------------
    def get_cookie(self, bookie_id: str) -> tuple[dict[str, Any], int] | None:
        try:
            data, stat = self.zk.get(f"{self.root}/cookies/{bookie_id}")
        except NoNodeError:
            return None
        return json.loads(data), stat.version

    def create_cookie(self, bookie_id: str, cookie: dict[str, Any]) -> None:
        self.zk.create(f"{self.root}/cookies/{bookie_id}", json.dumps(cookie, sort_keys=True).encode())

    def delete_cookie(self, bookie_id: str) -> None:
        """Forget a bookie id for good (decommission): it may start again only on empty disks."""
        try:
            self.zk.delete(f"{self.root}/cookies/{bookie_id}")
        except NoNodeError:
            pass

    def list_cookies(self) -> list[str]:
        """Every bookie id that ever started and was not decommissioned."""
        try:
            return sorted(self.zk.get_children(f"{self.root}/cookies"))
        except NoNodeError:
            return []

    # -- decommissioning ---------------------------------------------------------
    def decommissioning_path(self, bookie_id: str) -> str:
        """Present while an operator decommissions this bookie: the bookie watches it and stays
        read-only (across restarts) while it exists."""
        return f"{self.root}/decommissioning/{bookie_id}"

    def set_decommissioning(self, bookie_id: str) -> None:
        try:
            self.zk.create(self.decommissioning_path(bookie_id), b"", makepath=True)
        except NodeExistsError:
            pass

    def clear_decommissioning(self, bookie_id: str) -> None:
        try:
            self.zk.delete(self.decommissioning_path(bookie_id))
        except NoNodeError:
            pass

    # -- ledger ids and metadata ---------------------------------------------
    def _reply(self, result: Any, op: str, path: str) -> Any:
        """A kazoo async result's value (waiting for it), NoAuth / AuthFailed mapped as the
        guarded synchronous calls map them."""
        try:
            return result.get()
        except (NoAuthError, AuthFailedError) as e:
            raise metadata_auth_error(e, op, path, self.security) from None

    @property
    def pipelined(self) -> bool:
        """Whether the `*_async` requests can be awaited without a thread (kazoo's client). The
        simulator's client answers at once; its round trip's time is the simulated executor's,
        so the asyncio client runs result() there (bookkeeper/testing/sim)."""
        return not self._injected

    def create_ledger(self, md: LedgerMetadata) -> LedgerMetadata:
        return self.create_ledger_async(md).result()

    def create_ledger_async(self, md: LedgerMetadata) -> Pending[LedgerMetadata]:
        """Store a new ledger's metadata, recording this store's principal as its creator (unless
        md names one) and sealing its password when the cluster has a key; the snapshot returned
        keeps the password as the creator gave it."""
        if not md.creator:
            md = md.replace(creator=self.security.principal)
        path = ledger_path(self.root, md.ledger_id)

        def finish(created: Any) -> LedgerMetadata:
            try:
                self._reply(created, "create", path)
            except NodeExistsError as e:
                raise LedgerExistsError(f"ledger {md.ledger_id} already exists") from e
            return md.replace(version=0)
        return Pending(finish, self.zk.create_async(path, self._stored(md), makepath=True))

    def read_ledger(self, ledger_id: int) -> LedgerMetadata:
        return self.read_ledger_async(ledger_id).result()

    def read_ledger_async(self, ledger_id: int) -> Pending[LedgerMetadata]:
        path = ledger_path(self.root, ledger_id)

        def finish(got: Any) -> LedgerMetadata:
            try:
                data, stat = self._reply(got, "read", path)
            except NoNodeError as e:
                raise NoSuchLedgerError(f"ledger {ledger_id} does not exist") from e
            return LedgerMetadata.deserialize(data, version=stat.version)
        return Pending(finish, self.zk.get_async(path))

    def watch_ledger(self, ledger_id: int, fired: Callable[[Any], None]) -> int | None:
        return self.watch_ledger_async(ledger_id, fired).result()

    def watch_ledger_async(self, ledger_id: int, fired: Callable[[Any], None]) -> Pending[int | None]:
        """The ledger's metadata version (None: no such ledger), with a one-shot watch that calls
        fired(event) on kazoo's thread at the node's next change, deletion or session event
        (a tailer follows a ledger's close, ensemble changes and recovery this way)."""
        path = ledger_path(self.root, ledger_id)

        def finish(exists: Any) -> int | None:
            stat = self._reply(exists, "stat", path)
            return None if stat is None else int(stat.version)
        return Pending(finish, self.zk.exists_async(path, watch=fired))

    def write_ledger(self, md: LedgerMetadata) -> LedgerMetadata:
        return self.write_ledger_async(md).result()

    def write_ledger_async(self, md: LedgerMetadata) -> Pending[LedgerMetadata]:
        """Compare-and-set on md.version; returns the snapshot at the new version."""
        path = ledger_path(self.root, md.ledger_id)

        def finish(written: Any) -> LedgerMetadata:
            try:
                stat = self._reply(written, "write", path)
            except (BadVersionError, NoNodeError) as e:
                error = self._written(md, e)
                assert isinstance(error, BKError)
                raise error from e
            return md.replace(version=stat.version)
        return Pending(finish, self.zk.set_async(path, self._stored(md), version=md.version))

    def write_ledgers_async(self, mds: list[LedgerMetadata]) -> Pending[list[LedgerMetadata | BKError | None]]:
        """Compare-and-set of several ledgers' metadata in multi-ops, which ZooKeeper applies
        whole or not at all (one multi-op per MULTI_OP_BYTES of metadata, pipelined: a
        request past jute.maxbuffer would end the session): per md, in order, its snapshot at
        the new version, or the error that refused it (MetadataVersionError,
        NoSuchLedgerError, ...), or None where its multi-op was rolled back for another md's
        error (not applied: send it again). Why: kazoo spends ~130 us of the client's CPU per
        request and ~20 per op of a multi-op of ten (BookKeeper.write_metadata sends
        concurrent writes this way)."""
        slots: list[LedgerMetadata | BKError | tuple[int, int]] = []  # md's outcome, or (multi-op, op) of it
        txns: list[Any] = []
        size = MULTI_OP_BYTES
        for md in mds:
            try:
                data = self._stored(md)
            except BKError as e:  # this md alone: its password cannot be sealed
                slots.append(e)
                continue
            if size + len(data) > MULTI_OP_BYTES:
                txns.append(self.zk.transaction())
                size = 0
            size += len(data)
            txns[-1].set_data(ledger_path(self.root, md.ledger_id), data, version=md.version)
            slots.append((len(txns) - 1, len(txns[-1].operations) - 1))

        def finish(*committed: Any) -> list[LedgerMetadata | BKError | None]:
            results = [self._reply(c, "write (in a multi-op)", txn.operations[0].path)
                       for c, txn in zip(committed, txns)]
            return [slot if not isinstance(slot, tuple) else self._written(md, results[slot[0]][slot[1]])
                    for md, slot in zip(mds, slots)]
        if not txns:
            return Pending(lambda: finish())
        return Pending(finish, *(txn.commit_async() for txn in txns))

    def _written(self, md: LedgerMetadata, result: Any) -> LedgerMetadata | BKError | None:
        """One set_data's result (a stat, or the error it got alone or in a multi-op) as
        write_ledgers_async answers it; write_ledger_async raises the errors it maps."""
        if isinstance(result, (RolledBackError, RuntimeInconsistency)):
            return None  # before / after the op that failed: not applied
        if isinstance(result, BadVersionError):
            return MetadataVersionError(f"ledger {md.ledger_id} metadata changed since version {md.version}")
        if isinstance(result, NoNodeError):
            return NoSuchLedgerError(f"ledger {md.ledger_id} does not exist")
        if isinstance(result, (NoAuthError, AuthFailedError)):
            return metadata_auth_error(result, "write (in a multi-op)", ledger_path(self.root, md.ledger_id),
                                       self.security)
        if isinstance(result, Exception):
            return MetadataServiceError(f"ZooKeeper: {type(result).__name__} {result}")
        return md.replace(version=result.version)

    def delete_ledger(self, ledger_id: int) -> None:
        """Delete the ledger's metadata and, before returning, the parent levels it emptied."""
        self.delete_ledger_async(ledger_id, prune_here=True).result()

    def delete_ledger_async(self, ledger_id: int, *, prune_here: bool = False) -> Pending[None]:
        """Delete the ledger's metadata, and the parent levels that emptied: the bucket's stat is
        sent with the delete (one round trip; answered after it, in order), and only an
        emptied bucket costs more, once per 10^4 ledgers (_prune_soon: its blocking calls must
        not run where finish may, on kazoo's completion thread, whose replies they would wait
        behind, or on its connection thread once the client stops: a deadlock). prune_here:
        finish prunes itself (for result() on the caller's thread, which may block)."""
        path = ledger_path(self.root, ledger_id)
        bucket = path.rsplit("/", 1)[0]

        def finish(deleted: Any, bucket_stat: Any) -> None:
            try:
                self._reply(deleted, "delete", path)
            except NoNodeError as e:
                raise NoSuchLedgerError(f"ledger {ledger_id} does not exist") from e
            try:
                stat = bucket_stat.get()
            except (KazooException, ZookeeperError):
                return  # deleted; only the pruning is skipped (an empty bucket costs a listing a read)
            if stat is not None and not stat.numChildren:
                if prune_here:
                    self._prune_parents(path)
                else:
                    self._prune_soon(path)
        return Pending(finish, self.zk.delete_async(path), self.zk.exists_async(bucket))

    def _prune_soon(self, path: str) -> None:
        """_prune_parents on a thread of its own (at once over the simulator's client, which
        has no threads); it only tidies, so its failure is logged, never the delete's."""
        def prune() -> None:
            try:
                self._prune_parents(path)
            except Exception as e:  # noqa: BLE001 - an empty bucket left behind costs a listing a read
                log.info("emptied metadata bucket of %s not removed: %s", path, e)
        if self._injected:
            prune()
        else:
            threading.Thread(target=prune, name="zk-prune", daemon=True).start()

    def _prune_parents(self, path: str) -> None:
        """Remove the parent levels a delete emptied. A stat (a read, served locally) first: a
        delete of a non-empty parent is a failed write through the leader, per ledger deleted.
        A concurrent create may refill a parent between the two (NotEmpty: fine)."""
        parent = path.rsplit("/", 1)[0]
        while parent != self.root:
            stat = self.zk.exists(parent)
            if stat is None or stat.numChildren:
                return
            try:
                self.zk.delete(parent)
            except (NotEmptyError, NoNodeError):
                return
            parent = parent.rsplit("/", 1)[0]

    def ledger_exists(self, ledger_id: int) -> bool:
        if not 0 <= ledger_id <= MAX_LEDGER_ID:
            return False
        return self.zk.exists(ledger_path(self.root, ledger_id)) is not None

    # -- buckets (garbage collection) ---------------------------------------------
    def ledger_bucket(self, ledger_id: int) -> str:
        """The znode whose children are the ledger's metadata and its up to 9,999 neighbours'."""
        return ledger_path(self.root, ledger_id).rsplit("/", 1)[0]

    def bucket_version(self, bucket: str) -> int | None:
        """The zxid of the bucket's last child change (pzxid: moved by every create and delete
        under it, and never repeated, even by a bucket deleted and made again), or None if the
        bucket is gone (all its ledgers deleted). One small read."""
        stat = self.zk.exists(bucket)
        return None if stat is None else stat.pzxid

    def sync(self, path: str) -> None:
        """Bring this session's server up to the leader's view of `path` before the next read
        (ZooKeeper's sync): a read after it sees every write committed before the sync. Why:
        reads are served by the connected server, which may lag; a garbage collector that
        drops a ledger for being absent must not trust a lagging listing (Apache's
        ZkUtils.getChildrenInSingleNode syncs too)."""
        self.zk.sync(path)

    def bucket_ledgers(self, bucket: str) -> tuple[int, list[int]] | None:
        """(pzxid, the 4-digit suffixes of its ledgers, sorted) of a bucket in one read, or None
        if it is gone. The suffix is the ledger id modulo 10^4 (docs/metadata.md)."""
        try:
            names, stat = self.zk.get_children(bucket, include_data=True)
        except NoNodeError:
            return None
        return stat.pzxid, sorted(int(n[1:]) for n in names if n.startswith("L") and n[1:].isdigit())

    def list_ledgers(self, start: int = 0) -> Iterator[int]:
        """Ledger ids >= start in ascending order, lazily: one listing per bucket (<= 10^4 ids
        held at a time), buckets below `start` never listed."""
        for bucket in self.ledger_buckets(start):
            for lid in self.bucket_ledger_ids(bucket):
                if lid >= start:
                    yield lid

    # -- auto-recovery reads (docs/autorecovery.md) -----------------------------------
    def bookie_ids(self, *, readonly: bool = False, watch: Callable[[WatchedEvent], None] | None = None) -> set[str]:
        """Registered bookie ids (names only: one read, no per-bookie data); `watch` fires once
        when a registration appears or goes."""
        base = f"{self.root}/available" + ("/readonly" if readonly else "")
        try:
            return {c for c in self.zk.get_children(base, watch=watch) if c != "readonly"}
        except NoNodeError:
            return set()

    def _sorted_children(self, path: str) -> list[str]:
        try:
            return sorted(self.zk.get_children(path))
        except NoNodeError:
            return []

    def ledger_buckets(self, start: int = 0) -> Iterator[str]:
        """Every bucket (the parent of up to 10^4 ledgers' znodes) in id order, lazily, from the
        one that would hold `start`: the 10-digit subtree, then the 19-digit one. At most one
        level's names (<= 10^4) are held per level at a time."""
        for widths in SUBTREES:
            yield from self._buckets_of(widths, start=start)

    def _buckets_of(self, widths: tuple[int, ...], *, start: int = 0, reverse: bool = False) -> Iterator[str]:
        """The buckets of one subtree (its levels' digit widths), skipping those wholly below
        `start` (a level's name is compared with the same digits of start's id)."""
        digits = sum(widths) + 4
        if start > 10**digits - 1:
            return
        low = f"{max(start, 0):0{digits}d}"

        def walk(path: str, level: int, prefix: str, bounded: bool) -> Iterator[str]:
            if level == len(widths):
                yield path
                return
            width = len(prefix) + widths[level]
            floor = low[len(prefix):width] if bounded else ""
            names = [c for c in self._sorted_children(path)
                     if len(c) == widths[level] and c.isdigit() and c >= floor]
            for name in reversed(names) if reverse else names:
                yield from walk(f"{path}/{name}", level + 1, prefix + name, bounded and name == floor)
        yield from walk(self.root, 0, "", True)

    def bucket_ledger_ids(self, bucket: str) -> list[int]:
        """The ledger ids under a bucket path from ledger_buckets(), ascending (one read)."""
        got = self.bucket_ledgers(bucket)
        if got is None:
            return []
        base = bucket_base(self.root, bucket)
        return [base + suffix for suffix in got[1]]

    def read_ledgers(self, ledger_ids: list[int]) -> list[LedgerMetadata | None]:
        """The metadata of many ledgers, their reads pipelined on the session (None: deleted).
        Why: a scan of every ledger costs one round trip per batch, not per ledger."""
        pending = [self.zk.get_async(ledger_path(self.root, lid)) for lid in ledger_ids]
        out: list[LedgerMetadata | None] = []
        for lid, res in zip(ledger_ids, pending):
            try:
                data, stat = res.get()
            except NoNodeError:
                out.append(None)
                continue
            except (NoAuthError, AuthFailedError) as e:
                raise metadata_auth_error(e, "read", ledger_path(self.root, lid), self.security) from None
            out.append(LedgerMetadata.deserialize(data, version=stat.version))
        return out
