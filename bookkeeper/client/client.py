"""The asyncio BookKeeper client: ledger lifecycle over ZooKeeper metadata and bookie shards.

Lives in: the caller's event loop. Metadata calls (kazoo, blocking) run in the
default executor so a slow ZooKeeper never stalls adds in flight on the loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import functools
import json
import logging
import random
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar, cast

from kazoo.exceptions import KazooException, ZookeeperError

from bookkeeper import metrics
from bookkeeper._ext.client import LatencyHistogram
from bookkeeper.client.bookie_client import BookieClientPool, BookieHealth, ClientTrust
from bookkeeper.client.config import ClientConfig
from bookkeeper.client.lac_wheel import LacWheel
from bookkeeper.client.core.placement import choose_ensemble, choose_replacement
from bookkeeper.client.digest import master_key
from bookkeeper.clock import Clock, system_monotonic
from bookkeeper.client.ledger import ReadHandle, WriteHandle, recover
from bookkeeper.errors import (
    AuthorizationError,
    BKError,
    BookieUnavailableError,
    DigestMismatchError,
    InvalidArgumentError,
    LedgerExistsError,
    MetadataServiceError,
    NotEnoughBookiesError,
    TimeoutError,
    UnauthorizedError,
    UnknownOpError,
)
from bookkeeper.meta.ledger_metadata import DigestType, LedgerMetadata, check_password, password_digest
from bookkeeper.proto import NO_KEY, Op
from bookkeeper.security.authz import ALL_ROLES, ANONYMOUS
from bookkeeper.meta.zk import Pending, ZkMetadataStore
from bookkeeper.meta.zk_security import zk_security_from

T = TypeVar("T")


def _settle(fut: asyncio.Future[T], value: T | None, error: BaseException | None) -> None:
    """A metadata request's answer into its future (on the loop), unless the caller gave up."""
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(cast(T, value))
log = logging.getLogger(__name__)
PASSWORD_CACHE = 256  # passwords whose digest (or check) a client remembers
# How long a delete trusts the roles the bookies last told this client (WHOAMI): an admin role
# taken away in a bookie's authz file stops this client's deletes of others' ledgers within it.
ROLES_FRESH_S = 5.0
CREATE_ATTEMPTS = 5  # a create's ZooKeeper calls, tried through ~1.5 s of trouble (backoff from 0.05 s)


class BookKeeper:
    """Client of one BookKeeper cluster (asyncio). Create with `await BookKeeper.connect(uri)`."""

    def __init__(self, store: ZkMetadataStore, config: ClientConfig | None = None, *,
                 seed: int | None = None, trust: ClientTrust | None = None,
                 clock: Clock = system_monotonic) -> None:
        """trust: how bookie connections are secured; by default what the config's trust keys
        say (tls, tls_*_file, auth_provider, auth_token). clock: what deadlines, penalties and
        latencies are measured with (bookkeeper/clock.py; a simulation passes virtual time)."""
        self.store = store
        self.clock = clock
        self.config = (config or ClientConfig()).validate()
        # A refused certificate or AUTH exchange is an error of the requests that met it, like
        # any other: not a slow bookie (health penalizes it for slow_bookie_penalty_s at most).
        self.pool = BookieClientPool(self._resolve, timeout_s=max(self.config.add_timeout_s,
                                                                  self.config.read_timeout_s),
                                     trust=trust or ClientTrust.from_config(self.config), clock=clock)
        self.health = BookieHealth(self.config.slow_bookie_penalty_s, clock)
        self.quarantine = BookieHealth(self.config.bookie_quarantine_s, clock)
        # What bookkeeper.metrics reports: counters by name, and the latencies of acknowledged
        # adds (observed in C by each write handle's AddTracker) and of entry reads.
        self.stats: dict[str, int] = defaultdict(int)
        self.add_latency = LatencyHistogram(metrics.LATENCY_BUCKETS_S)
        self.read_latency = LatencyHistogram(metrics.LATENCY_BUCKETS_S)
        self.lac_wheel = LacWheel(self)
        self._rng = random.Random(seed)
        self._bookies: dict[str, dict[str, Any]] = {}
        self._writable: list[str] = []
        self._principal = ""  # who the bookies say this client is (whoami), once asked
        self._roles: frozenset[str] = frozenset()
        self._roles_at = float("-inf")  # when the bookies last said self._roles (clock)
        self._asking_roles: asyncio.Task[None] | None = None
        # Registrations are re-read only after a ZooKeeper watch says they changed (set from
        # kazoo's thread: a plain attribute write), not on every create, open or ensemble change.
        self._bookies_dirty = True
        self._creates = asyncio.Semaphore(self.config.max_pending_creates)
        self._digests: dict[bytes, asyncio.Future[str]] = {}
        self._verified: dict[tuple[str, bytes], asyncio.Future[bool]] = {}
        self._unplaceable: set[tuple[frozenset[tuple[str, str]], int, int]] = set()
        self._watching = False
        self._closed = False
        self._loop = asyncio.get_running_loop()
        self._writes = _MetadataWrites(self)
        metrics.add_client(self)

    @classmethod
    async def connect(cls, metadata_uri: str, *, seed: int | None = None, **config: Any) -> BookKeeper:
        """Connect to the cluster whose metadata lives at metadata_uri.

        Keyword arguments are ClientConfig fields (add_timeout_s, speculative_read_timeout_ms, ...).
        """
        cfg = ClientConfig(**config).validate()
        trust = ClientTrust.from_config(cfg)  # bad certificate files or plug-ins fail before ZooKeeper is asked
        loop = asyncio.get_running_loop()
        store = await loop.run_in_executor(
            None, functools.partial(ZkMetadataStore, metadata_uri, session_timeout_ms=cfg.zk_session_timeout_ms,
                                    connect_timeout_s=cfg.zk_connect_timeout_s, create=False,
                                    security=zk_security_from(cfg)))
        bk = cls(store, cfg, seed=seed, trust=trust)
        await bk.refresh_bookies()
        return bk

    def with_config(self, **changes: Any) -> ClientConfig:
        """Change client settings in place (tests and tools); returns the new config."""
        self.config = dataclasses.replace(self.config, **changes).validate()
        return self.config

    async def __aenter__(self) -> BookKeeper:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True  # the bookie watches drop themselves at their next event
        if self._asking_roles is not None:
            self._asking_roles.cancel()
        metrics.drop_client(self)
        self.pool.close()
        await self.metadata_call(self.store.close)

    async def metadata_call(self, fn: Callable[..., T], *args: Any) -> T:
        """A blocking metadata call (kazoo) off the loop; ZooKeeper trouble becomes a retriable
        MetadataServiceError. Public: layers over the client (auto-recovery, streams, the CLI)
        reach ZooKeeper through it, so every such call is off the loop and mapped the same way."""
        try:
            return await self._loop.run_in_executor(None, functools.partial(fn, *args))
        except (KazooException, ZookeeperError) as e:
            raise MetadataServiceError(f"ZooKeeper: {type(e).__name__} {e}") from e

    async def metadata_request(self, make: Callable[..., Pending[T]], *args: Any) -> T:
        """A ledger's metadata request (one of the store's `*_async`: create, read, write, watch,
        delete), sent from the loop through kazoo's async API and awaited without a thread;
        ZooKeeper trouble becomes a retriable MetadataServiceError, as in metadata_call. Over
        the simulator's ZooKeeper (store.pipelined False) it is a metadata_call of its result."""
        if not self.store.pipelined:
            return await self.metadata_call(lambda: make(*args).result())
        loop = self._loop
        fut: asyncio.Future[T] = loop.create_future()

        def done(value: T | None, error: BaseException | None) -> None:
            loop.call_soon_threadsafe(_settle, fut, value, error)
        try:
            make(*args).then(done)
            return await fut
        except (KazooException, ZookeeperError) as e:
            raise MetadataServiceError(f"ZooKeeper: {type(e).__name__} {e}") from e

    # -- bookies -----------------------------------------------------------
    async def refresh_bookies(self) -> dict[str, dict[str, Any]]:
        """Re-read the registered bookies (writable and read-only); the first call also sets the
        watches that say when they change (_bookies_changed)."""
        if not self._watching:
            self._watching = True
            await self.metadata_call(self.store.watch_bookies, self._bookies_changed)
        self._bookies_dirty = False  # before the reads: a change during them marks it again
        try:
            writable = await self.metadata_call(self.store.get_bookies)
            readonly = await self.metadata_call(functools.partial(self.store.get_bookies, readonly=True))
        except BaseException:
            self._bookies_dirty = True  # not read: the next look tries again
            raise
        self._bookies = {**readonly, **writable}
        self.pool.invalidate_routes()
        self._writable = list(writable)
        return self._bookies

    def _bookies_changed(self) -> bool:
        """kazoo's thread: the registrations may have changed. False once closed (drops the watch)."""
        if self._closed:
            return False
        self._bookies_dirty = True
        return True

    async def _current_bookies(self) -> None:
        """The registrations as of the last change the watches reported."""
        if self._bookies_dirty:
            await self.refresh_bookies()

    async def bookies_for(self, ensembles: Iterable[list[str]]) -> None:
        """Before a read: the registrations again only if the watch marked them stale and one of
        the ledger's bookies is missing from the view (it restarted while the view was read, so
        its reads would fail "not registered"). Reads need no ZooKeeper otherwise, and do not
        wait for it: unreachable within the read timeout, the view as it is serves."""
        if not self._bookies_dirty or all(b in self._bookies for ens in ensembles for b in ens):
            return
        try:
            async with asyncio.timeout(self.config.read_timeout_s):
                await self.refresh_bookies()
        except (asyncio.TimeoutError, MetadataServiceError) as e:  # asyncio's: the builtin, not ours
            log.info("registrations not re-read before a read (%s): routing by the last view", e)

    def _resolve(self, bookie_id: str) -> dict[str, Any] | None:
        return self._bookies.get(bookie_id)

    def _racks(self, ids: list[str]) -> dict[str, str]:
        return {b: self._bookies.get(b, {}).get("rack", "/default-rack") for b in ids}

    def _place(self, ensemble: int, write_quorum: int) -> list[str]:
        """A new ensemble under the placement policy; says so (or refuses) when racks are too few."""
        rack_aware = self.config.placement == "rack_aware"
        quarantined = self.quarantine.current()
        healthy = [b for b in self._writable if b not in quarantined]
        candidates = self._racks(healthy if len(healthy) >= ensemble else self._writable)
        # A shape the racks could not place is not tried again (64 draws per create) until the
        # registrations or the quarantine change: the verdict is kept per candidate set.
        verdict = (frozenset(candidates.items()), ensemble, write_quorum)
        p = choose_ensemble(candidates, ensemble_size=ensemble, write_quorum=write_quorum, rng=self._rng,
                            rack_aware=rack_aware, attempts=0 if verdict in self._unplaceable else 64)
        if rack_aware and not p.rack_aware:
            if len(self._unplaceable) >= 64:
                self._unplaceable.clear()
            self._unplaceable.add(verdict)
            if self.config.placement_strict:
                raise NotEnoughBookiesError(f"placement: {p.reason}")
            self.stats["placement_degraded"] += 1
            # Said once per client, counted always; at INFO, not as a warning: a one-rack cluster
            # (a test cluster, a small site) degrades by design, and a warning would be noise on
            # every client's stderr.
            if self.stats["placement_degraded"] == 1:
                log.info("placement degraded: %s (bookies may share racks)", p.reason)
        return p.ensemble

    async def replacement_ensemble(self, md: LedgerMetadata, base: list[str], slots: list[int],
                                   exclude: set[str]) -> list[str]:
        """`base` with each failed slot replaced, keeping the placement rule where possible.

        `exclude` (the bookies being replaced) is never picked; quarantined bookies (failed
        on some handle of this client within bookie_quarantine_s) only when nothing else is
        left, as Apache BookKeeper does: a long-lived writer never runs out of replacements
        while bookies that failed once are back and healthy.
        """
        await self._current_bookies()
        try:
            return self._replace(md, base, slots, exclude)
        except NotEnoughBookiesError:  # a bookie may have registered just now: the watch may lag
            await self.refresh_bookies()
            return self._replace(md, base, slots, exclude)

    def _replace(self, md: LedgerMetadata, base: list[str], slots: list[int], exclude: set[str]) -> list[str]:
        ensemble = list(base)
        racks = self._racks(self._writable)
        avoid = exclude | self.quarantine.current()
        rack_aware = self.config.placement == "rack_aware"
        for slot in slots:
            bookie, kept = choose_replacement(ensemble, slot, racks, write_quorum=md.write_quorum,
                                              exclude=avoid, rng=self._rng, rack_aware=rack_aware)
            if bookie is None and avoid != exclude:
                bookie, kept = choose_replacement(ensemble, slot, racks, write_quorum=md.write_quorum,
                                                  exclude=exclude, rng=self._rng, rack_aware=rack_aware)
                self.stats["quarantine_overridden"] += bookie is not None
            if bookie is None:
                raise NotEnoughBookiesError(f"no writable bookie left to replace {ensemble[slot]}")
            if self.config.placement == "rack_aware" and not kept:
                if self.config.placement_strict:
                    raise NotEnoughBookiesError(f"placement: no replacement for {ensemble[slot]} on a distinct rack")
                self.stats["placement_degraded"] += 1
                if self.stats["placement_degraded"] == 1:
                    log.info("placement degraded: replacement %s shares a rack with a neighbour", bookie)
            ensemble[slot] = bookie
        return ensemble

    @staticmethod
    def master_key(password: bytes) -> bytes:
        return master_key(password)

    # -- metadata (the ledger handles' context: bookkeeper/client/context.py) ----------
    async def ledger_metadata(self, ledger_id: int) -> LedgerMetadata:
        """The ledger's metadata as ZooKeeper has it now."""
        return await self.metadata_request(self.store.read_ledger_async, ledger_id)

    async def write_metadata(self, md: LedgerMetadata) -> LedgerMetadata:
        """Compare-and-set md over the version it was read at (MetadataVersionError if another
        writer changed it since): the new version. For handles, recovery and auto-recovery;
        an application changes metadata only through them. Writes of one turn of the loop
        go to ZooKeeper together (_MetadataWrites)."""
        if not self.store.pipelined:
            return await self.metadata_request(self.store.write_ledger_async, md)
        return await self._writes.write(md)

    async def watch_metadata(self, ledger_id: int, fired: Callable[[Any], None]) -> int | None:
        """A one-shot watch on the ledger's metadata (fired runs on kazoo's thread): its
        version now, None if it is gone."""
        version: int | None = await self.metadata_request(self.store.watch_ledger_async, ledger_id, fired)
        return version

    # -- ledgers -------------------------------------------------------------
    async def create_ledger(self, *, ensemble: int = 3, write_quorum: int = 2, ack_quorum: int = 2,
                            digest: DigestType = DigestType.CRC32C, password: bytes = b"",
                            custom_metadata: dict[str, bytes] | None = None) -> WriteHandle:
        """Create a ledger on `ensemble` random writable bookies and return its write handle."""
        if not (1 <= ack_quorum <= write_quorum <= ensemble):
            raise InvalidArgumentError(f"need 1 <= ack_quorum <= write_quorum <= ensemble, got "
                          f"{ensemble}/{write_quorum}/{ack_quorum}")
        if not isinstance(password, bytes):
            raise TypeError("password must be bytes")
        custom = dict(custom_metadata or {})
        for k, v in custom.items():
            if not isinstance(k, str) or not isinstance(v, bytes):
                raise TypeError("custom_metadata must map str to bytes")
        await self._current_bookies()
        if len(self._writable) < ensemble:
            await self.refresh_bookies()  # a bookie may have registered just now: the watch may lag
        if len(self._writable) < ensemble:
            raise NotEnoughBookiesError(f"ensemble of {ensemble} needs {ensemble} writable bookies, "
                                        f"{len(self._writable)} registered")
        chosen = self._place(ensemble, write_quorum)
        creator = self._principal or (await self.whoami(chosen))[0]
        async with self._create_slot():
            # From this store's reserved block without a ZooKeeper call, but for one create per
            # block. A lost reply skips ids (the block was reserved): never reused, so retried as is.
            ledger_id = self.store.take_ledger_id()
            if ledger_id is None:
                ledger_id = await self._retried("allocate_ledger_id", functools.partial(
                    self.metadata_call, self.store.allocate_ledger_id))
            md = LedgerMetadata(ledger_id=ledger_id, ensemble_size=ensemble, write_quorum=write_quorum,
                                ack_quorum=ack_quorum, digest=DigestType(digest),
                                password_digest=await self._password_digest(password), ensembles={0: chosen},
                                custom_metadata=custom, password=password, creator=creator)
            md = await self._create_metadata(md)
        return WriteHandle(self, md, password)

    @contextlib.asynccontextmanager
    async def _create_slot(self) -> AsyncIterator[None]:
        """One of max_pending_creates: creates past what ZooKeeper takes wait here, and fail
        with MetadataServiceError after metadata_timeout_s, never an unbounded queue."""
        try:
            async with asyncio.timeout(self.config.metadata_timeout_s):
                await self._creates.acquire()
        except asyncio.TimeoutError:  # asyncio's: the builtin, not ours
            raise MetadataServiceError(f"{self.config.max_pending_creates} creates pending for "
                                       f"{self.config.metadata_timeout_s} s: ZooKeeper is not keeping up") from None
        try:
            yield
        finally:
            self._creates.release()

    async def _password_digest(self, password: bytes) -> str:
        """The salted digest new ledgers with this password store: made once per client and
        password (scrypt costs ~27 ms of a core by design; per create it capped creates at
        ~37/s per core). Its salt is then shared by this client's ledgers of one password,
        which tells a reader of the metadata only that their passwords are equal. Concurrent
        first creates wait for the one digest being made, not each make their own."""
        return await self._once(self._digests, password, password_digest, password)

    async def _password_matches(self, password: bytes, digest: str) -> bool:
        """check_password, remembered per (digest, password): a recovery opening many ledgers of
        one creator and password runs scrypt once, not per ledger (64 opens in flight each
        checking the same digest cost 3.5 ms of CPU per open)."""
        key = (digest, hashlib.sha256(password).digest())
        return await self._once(self._verified, key, check_password, password, digest)

    async def _once(self, memo: dict[Any, asyncio.Future[Any]], key: Any, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) off the loop, once per key while its answer is remembered (PASSWORD_CACHE
        keys); callers asking meanwhile share the one call. A failed call is not remembered."""
        fut = memo.get(key)
        if fut is None:
            if len(memo) >= PASSWORD_CACHE:
                memo.clear()
            fut = memo[key] = asyncio.ensure_future(self._loop.run_in_executor(None, functools.partial(fn, *args)))
            fut.add_done_callback(lambda f: (f.cancelled() or f.exception() is not None) and memo.pop(key, None))
        result: T = await asyncio.shield(fut)
        return result

    async def _retried(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """A metadata call tried again through ZooKeeper's transient trouble (a lost connection,
        a lost reply: MetadataServiceError), CREATE_ATTEMPTS times with backoff; for calls
        that are safe to repeat."""
        delay = 0.05
        for _ in range(CREATE_ATTEMPTS - 1):
            try:
                return await attempt()
            except MetadataServiceError as e:
                log.info("metadata call %s failed (%s): trying again in %.2f s", what, e, delay)
                await asyncio.sleep(delay)
                delay *= 2
        return await attempt()

    async def _create_metadata(self, md: LedgerMetadata) -> LedgerMetadata:
        """The new ledger's metadata stored, tried again through ZooKeeper's transient trouble.

        A create that ZooKeeper applied but whose reply was lost meets LedgerExistsError when
        tried again; the stored metadata is then this create's if its password digest and
        ensemble are (the id was handed out once, to this create: the check guards against a
        layout-1 client of another version colliding), and the create is done. Before, the
        first lost reply failed create_ledger (the simulator's writers, at 5 % loss)."""
        create = functools.partial(self.metadata_request, self.store.create_ledger_async, md)
        try:
            return await create()
        except MetadataServiceError:
            pass  # not known whether it was applied
        try:
            return await self._retried("create_ledger", create)
        except LedgerExistsError:
            stored = await self._retried("read_ledger", functools.partial(self.ledger_metadata, md.ledger_id))
            if stored.password_digest != md.password_digest or stored.ensembles != md.ensembles:
                raise
            return md.replace(creator=stored.creator, version=stored.version)

    async def open_ledger(self, ledger_id: int, *, password: bytes = b"", digest: DigestType | None = None,
                          recovery: bool = True, verify_password: bool = True) -> ReadHandle:
        """Open for reading. recovery=True fences and closes a ledger that may still have a writer.

        verify_password=False is for admin reads (`bk ledger read`) of CRC32C/DUMMY ledgers:
        reads need no master key and those digests no password. It cannot fence.
        """
        md = await self.ledger_metadata(ledger_id)
        if not verify_password:
            if recovery or md.digest is DigestType.MAC:
                raise UnauthorizedError(f"ledger {ledger_id}: the password is needed to "
                                        f"{'recover' if recovery else 'verify its MAC digest'}")
        elif not await self._password_matches(password, md.password_digest):
            raise UnauthorizedError(f"wrong password for ledger {ledger_id}")
        if digest is not None and DigestType(digest) is not md.digest:
            raise DigestMismatchError(f"ledger {ledger_id} uses digest {md.digest.value}, not "
                                      f"{DigestType(digest).value}")
        await self._current_bookies()  # a closed ledger's reads need current registrations too
        if not md.is_closed and recovery:
            md = await recover(self, md, password)
        handle = ReadHandle(self, md, password, md.last_entry_id)
        if not md.is_closed:
            await handle.read_last_add_confirmed()
        return handle

    async def delete_ledger(self, ledger_id: int) -> None:
        """Delete the ledger's metadata; bookies garbage-collect its entries.

        Only its creator, or a principal with the `admin` role, may: the bookies say who this
        client is (WHOAMI), the metadata who created the ledger. AuthorizationError otherwise.
        Ledgers created before creators were recorded carry none and are not checked. A
        client the bookies said within ROLES_FRESH_S is an admin reads no metadata: one round
        trip to ZooKeeper, the delete with its bucket's stat (every principal is an admin of
        a cluster without authorization)."""
        if not self._admin_now():
            md = await self.ledger_metadata(ledger_id)
            if md.creator and md.creator != self._principal:  # its creator needs no role: no WHOAMI
                principal, roles = await self.whoami(md.ensembles[min(md.ensembles)], fresh=True)
                if principal != md.creator and "admin" not in roles:
                    raise AuthorizationError(f"principal {principal!r} lacks role 'admin': ledger {ledger_id} "
                                             f"was created by {md.creator!r}")
        await self.metadata_request(self.store.delete_ledger_async, ledger_id)

    def _admin_now(self) -> bool:
        """Whether the bookies said within ROLES_FRESH_S that this client has the admin role.
        Once their word is older, a client that has asked before asks again in the background
        (one WHOAMI at a time; a failure is only logged), so that later deletes know: no delete
        waits for a WHOAMI it does not need (a cluster whose bookies are all read-only, where
        deleting is how space comes back, answers WHOAMI only from them)."""
        if self.clock() - self._roles_at < ROLES_FRESH_S:
            return "admin" in self._roles
        if self._principal and (self._asking_roles is None or self._asking_roles.done()):
            self._asking_roles = self._loop.create_task(self._ask_roles())
        return False

    async def _ask_roles(self) -> None:
        try:
            await self.whoami(sorted(self._bookies), fresh=True)
        except BKError as e:
            log.debug("roles not refreshed: %s", e)

    async def whoami(self, bookies: list[str] | None = None, *, fresh: bool = False) -> tuple[str, frozenset[str]]:
        """This client's principal and roles as the bookies see them (WHOAMI, through the
        connection's TLS and AUTH set-up): the first of `bookies` (default: the writable ones)
        that answers. The principal is kept for the client's lifetime (its credential does not
        change identity); roles are asked again with fresh=True (the authz file is live)."""
        if self._principal and not fresh:
            return self._principal, self._roles
        await self._current_bookies()
        last: BKError = NotEnoughBookiesError("no bookie to ask who this client is")
        for bookie_id in list(bookies or []) + sorted(self._writable):
            try:
                resp = await self.pool.call(bookie_id, Op.WHOAMI, 0, 0, -1, NO_KEY, timeout_s=self.config.read_timeout_s)
            except UnknownOpError:  # a bookie older than WHOAMI authorizes nothing
                self._principal, self._roles, self._roles_at = ANONYMOUS, ALL_ROLES, self.clock()
                return self._principal, self._roles
            except (BookieUnavailableError, TimeoutError) as e:
                last = e
                continue
            answer = json.loads(bytes(resp[6]))
            self._principal, self._roles = str(answer["principal"]), frozenset(answer["roles"])
            self._roles_at = self.clock()
            return self._principal, self._roles
        raise last

    async def list_ledgers(self, start: int = 0) -> AsyncIterator[int]:
        """Ledger ids >= start, ascending, one bucket (<= 10^4 ids) read at a time: the first
        comes after a few ZooKeeper reads however many ledgers there are, and nothing holds
        them all (`bk ledgers list` streams)."""
        buckets = self.store.ledger_buckets(start)
        while (bucket := await self.metadata_call(next, buckets, None)) is not None:
            for lid in await self.metadata_call(self.store.bucket_ledger_ids, bucket):
                if lid >= start:
                    yield lid


MULTI_WRITE_MAX = 128  # metadata writes per multi-op (~0.5 KB each: far below jute.maxbuffer's 1 MB)


class _MetadataWrites:
    """The client's metadata writes (write_metadata) queued in one turn of the loop and sent
    as one ZooKeeper multi-op (ZkMetadataStore.write_ledgers_async, which splits what would
    pass ZooKeeper's request limit), a lone one as a plain compare-and-set.

    Why: kazoo costs the client ~130 us of CPU per request, and ~20 us per write of a
    multi-op of ten; a recovery writes twice (IN_RECOVERY, then CLOSED) and a close once,
    so 64 recoveries in flight spent most of their client CPU in kazoo. Each write keeps its
    own outcome: ZooKeeper applies a multi-op whole or not at all, so a write refused (its
    version moved, its ledger deleted) fails alone and the others, rolled back, go again
    each alone, pipelined (one more round trip, however many were refused). Writes wait for
    the end of the loop's turn: a delete sent in the same turn reaches ZooKeeper first. A lost connection fails every write of the multi-op as it would each
    plain write (MetadataServiceError: applied or not, unknown)."""

    def __init__(self, bk: BookKeeper) -> None:
        self._bk = bk
        self._queued: list[tuple[LedgerMetadata, asyncio.Future[LedgerMetadata]]] = []
        self._sending: set[asyncio.Task[None]] = set()  # the loop holds tasks only weakly

    def write(self, md: LedgerMetadata) -> asyncio.Future[LedgerMetadata]:
        fut: asyncio.Future[LedgerMetadata] = self._bk._loop.create_future()
        self._queue(md, fut)
        return fut

    def _queue(self, md: LedgerMetadata, fut: asyncio.Future[LedgerMetadata]) -> None:
        if not self._queued:
            self._bk._loop.call_soon(self._send)
        self._queued.append((md, fut))

    def _send(self) -> None:
        queued, self._queued = [(md, f) for md, f in self._queued if not f.done()], []
        for start in range(0, len(queued), MULTI_WRITE_MAX):
            self._spawn(self._commit(queued[start:start + MULTI_WRITE_MAX]))

    def _spawn(self, commit: Coroutine[Any, Any, None]) -> None:
        task = self._bk._loop.create_task(commit)
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _commit(self, batch: list[tuple[LedgerMetadata, asyncio.Future[LedgerMetadata]]]) -> None:
        store = self._bk.store
        results: list[LedgerMetadata | BaseException | None]
        try:
            if len(batch) == 1:
                written: LedgerMetadata = await self._bk.metadata_request(store.write_ledger_async, batch[0][0])
                results = [written]
            else:
                each: list[LedgerMetadata | BKError | None] = await self._bk.metadata_request(
                    store.write_ledgers_async, [md for md, _ in batch])
                results = list(each)
        except Exception as e:  # noqa: BLE001 - every write of the batch ends with it
            results = [e] * len(batch)
        for (md, fut), result in zip(batch, results):
            if fut.done():
                continue
            if result is None:  # rolled back for another write's error, not applied: sent again alone
                self._spawn(self._commit([(md, fut)]))  # (re-batched, k stale writes took k round trips)
            elif isinstance(result, BaseException):
                fut.set_exception(_own(result) if len(batch) > 1 else result)
            else:
                fut.set_result(result)


def _own(error: BaseException) -> BaseException:
    """An error one of several writes fails with: its own instance where its type allows
    (a traceback is kept per raise)."""
    try:
        return type(error)(*error.args)
    except Exception:  # noqa: BLE001 - a type that will not take its args again: shared
        return error
