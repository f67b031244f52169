"""Connections to bookie shards: pipelined requests, callbacks per request id.

Lives in: the client's event loop. One connection per shard address (with TLS, per bookie
id and address: each checks the bookie's certificate against the id it serves), shared by
every ledger whose owning shard it is. Requests issued in one loop iteration are written
together; responses are parsed a whole receive buffer at a time by the Cython codec. A
connection that fails fails all its outstanding requests with BookieUnavailableError; the
next request reconnects.

A connection is set up before any request goes out (docs/protocol.md, "START_TLS (6)" and
"AUTH (7)"): START_TLS and the TLS handshake, the bookie's certificate checked against the
bookie id the client routed to, then the AUTH exchange, renewed in band while the
connection lives. Requests made meanwhile wait in the pipe's outbox; a set-up that fails
fails them with AuthenticationError saying which bookie, TLS or which plug-in, and why.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bookkeeper._ext.client import RequestPipe
from bookkeeper.client.config import ClientConfig
from bookkeeper.clock import Clock, system_monotonic
from bookkeeper.errors import (AuthenticationError, BKError, BookieUnavailableError, ClientClosedError, ConfigError,
                               TimeoutError, error_for_status)
from bookkeeper.proto import (DEFAULT_MAX_FRAME_BYTES, NO_KEY, FrameError, Op, Status, encode_request,
                              parse_responses, shard_for_ledger)
from bookkeeper.security.auth import ClientAuthProvider, ClientAuthSession, load_client_provider
from bookkeeper.security.tls import ReloadingTLS, check_bookie_identity, describe_tls_failure
from bookkeeper.security.tokens import utc_iso

log = logging.getLogger(__name__)

# callback(ctx, response tuple or None, exception or None): ctx is whatever the sender
# passed, so hot callers hand over a bound method and a tuple instead of a new closure.
Callback = Callable[[Any, tuple[Any, ...] | None, BKError | None], None]
# One AUTH round: the AUTH frame's payload -> the answer's (status, entry_id, payload).
AuthRound = Callable[[bytes], Awaitable[tuple[int, int, bytes]]]

MAX_REASON_CHARS = 512  # of a bookie's reason text quoted in an exception
# A bookie refuses a client certificate as soon as the handshake's last flight reaches it: a
# close this soon after the handshake, before any answer, is read as that refusal; a later one
# (a bookie that died under a long poll, say) stays a lost connection, which is retried.
CERT_REFUSAL_WINDOW_S = 2.0


@dataclass(frozen=True)
class ClientTrust:
    """How a client secures its bookie connections: its TLS mode, its TLS context (one per
    client, reloaded when its files change) and its AUTH plug-in (None: no AUTH exchange)."""

    mode: str = "off"
    tls: ReloadingTLS | None = None
    auth: ClientAuthProvider | None = None

    @classmethod
    def from_config(cls, cfg: ClientConfig) -> ClientTrust:
        """The trust a validated ClientConfig asks for; bad files or plug-ins raise ConfigError."""
        tls = None
        if cfg.tls != "off":
            tls = ReloadingTLS(server_side=False, cert_file=cfg.tls_cert_file or None,
                               key_file=cfg.tls_key_file or None, ca_file=cfg.tls_ca_file or None,
                               reload_interval_s=cfg.tls_reload_interval_s)
        auth = None
        if cfg.auth_provider:
            auth = load_client_provider(cfg.auth_provider, token=cfg.auth_token or None)
        return cls(cfg.tls, tls, auth)

    @property
    def sets_up(self) -> bool:
        """Whether a new connection has anything to do before its first request."""
        return self.mode != "off" or self.auth is not None


def bookie_reason(status: int, payload: Any) -> str:
    """The status's name, and the bookie's reason when its answer carried one (UTF-8, bounded)."""
    name = Status(status).name if status in Status._value2member_map_ else str(status)
    if not payload:
        return name
    reason = bytes(payload[:4 * MAX_REASON_CHARS]).decode("utf-8", "replace")[:MAX_REASON_CHARS]
    return f"{name}: {reason}"


def start_tls_answer(status: int, payload: bytes, *, mode: str, peer: str) -> bool:
    """What the bookie's answer to START_TLS means for a client in `mode` (optional or
    require): True to upgrade, False to go on in plain text (an `optional` client and a
    bookie without TLS, which answers like an older bookie); AuthenticationError otherwise."""
    if status == Status.OK:
        return True
    if status == Status.UNKNOWN_OP:
        if mode == "optional":
            return False
        raise AuthenticationError(f"bookie {peer} does not offer TLS (tls = require on this client)")
    raise AuthenticationError(f"bookie {peer}: TLS: {bookie_reason(status, payload)}")


def auth_answer(status: int, done: int, payload: bytes, *, plugin: str, peer: str) -> bool:
    """What the answer to one AUTH round means: True when authenticated, False when the
    plug-in must send another round; AuthenticationError naming the bookie, the plug-in and
    the reason otherwise. A bookie that does not authenticate (UNKNOWN_OP) is an error too:
    a client configured for authentication wants it, and must not silently go without."""
    if status == Status.OK:
        return done == 1
    if status == Status.UNKNOWN_OP:
        raise AuthenticationError(f"bookie {peer} does not authenticate clients (auth_provider = {plugin} "
                                  f"on this client)")
    raise AuthenticationError(f"bookie {peer}: auth {plugin}: {bookie_reason(status, payload)}")


def auth_frame_payload(plugin: str, payload: bytes) -> bytes:
    """An AUTH request's payload: u8 n, the plug-in's name (n bytes ASCII), its payload."""
    try:
        name = plugin.encode("ascii")
    except UnicodeEncodeError:
        raise ConfigError(f"auth plug-in name {plugin!r} is not ASCII") from None
    if not 0 < len(name) < 256:
        raise ConfigError(f"auth plug-in name {plugin!r} must be 1-255 bytes")
    return bytes([len(name)]) + name + payload


def _plugin_step(plugin: str, peer: str, fn: Callable[..., Any], *args: Any) -> Any:
    """A call into the plug-in (user code for a dotted path): whatever it raises becomes the
    AuthenticationError that fails the queued requests, naming it."""
    try:
        return fn(*args)
    except AuthenticationError:
        raise
    except Exception as e:  # noqa: BLE001 - any plug-in failure fails the set-up, named
        raise AuthenticationError(f"bookie {peer}: auth {plugin}: the plug-in failed: {e}") from e


async def authenticate(provider: ClientAuthProvider, round_trip: AuthRound, *, peer: str) -> ClientAuthSession:
    """One AUTH exchange, its rounds sent with round_trip: the session that authenticated
    (its renew_after_s() says when to run the next)."""
    name = provider.name
    session: ClientAuthSession = _plugin_step(name, peer, provider.new_session)
    payload: bytes | None = _plugin_step(name, peer, session.first)
    while True:
        status, done, reply = await round_trip(auth_frame_payload(name, payload or b""))
        if auth_answer(status, done, reply, plugin=name, peer=peer):
            return session
        payload = _plugin_step(name, peer, session.step, reply)
        if payload is None:
            raise AuthenticationError(f"bookie {peer}: auth {name}: the bookie expects another round and the "
                                      f"plug-in has nothing more to send")


def tls_refusal(exc: BaseException | None, peer: str) -> AuthenticationError | None:
    """The AuthenticationError a connection lost to a TLS alert stands for (None for any
    other loss). Why: under TLS 1.3 the bookie checks the client's certificate after the
    client's side of the handshake is done, so its refusal (an untrusted or expired client
    certificate) arrives as an alert on the first read, not from the handshake."""
    if isinstance(exc, ssl.SSLError):
        return AuthenticationError(f"bookie {peer}: TLS refused: {describe_tls_failure(exc, peer=peer)}")
    return None


def client_cert_refusal(tls: ReloadingTLS, peer: str, now: float | None = None) -> AuthenticationError | None:
    """What a bookie closing the connection right after the TLS handshake, before answering
    anything, means when this client presented a certificate (None when it presented none).

    Why a conclusion at all: under TLS 1.3 the bookie checks the client's certificate after
    the client's side of the handshake is done, and its loop closes the connection without
    the alert that would say why; the client sees only the close. A certificate past its
    notAfter is named as such (the client knows its own expiry)."""
    days = tls.days_to_expiry(now)
    if days is None:
        return None
    if days < 0:
        reason = (f"this client's certificate (tls_cert_file) expired at "
                  f"{utc_iso((time.time() if now is None else now) + days * 86400)}")
    else:
        reason = "it did not accept this client's certificate (tls_cert_file: is it signed by a CA the bookie trusts?)"
    return AuthenticationError(f"bookie {peer}: TLS refused: closed right after the handshake: {reason}")


class _SetupProtocol(asyncio.Protocol):
    """A connection while it is set up (START_TLS, AUTH): one request and its answer at a time.
    Frames are few and small here, so plain bytes and the Python-facing codec do."""

    def __init__(self, max_frame_bytes: int, peer: str) -> None:
        self.transport: asyncio.Transport | None = None
        self._max_frame = max_frame_bytes
        self._peer = peer
        # Set once the TLS handshake is done: what a close with no answer since means.
        self.refusal: Callable[[], AuthenticationError | None] | None = None
        self._buf = bytearray()
        self._waiter: asyncio.Future[tuple[int, int, bytes]] | None = None
        self._lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buf += data
        self._answer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = (tls_refusal(exc, self._peer) or (self.refusal() if self.refusal is not None else None)
                      or ConnectionResetError(f"closed by the bookie during set-up{f': {exc}' if exc else ''}"))
        self._answer()

    async def round_trip(self, op: int, payload: bytes = b"") -> tuple[int, int, bytes]:
        """Send one set-up request; its answer's (status, entry_id, payload)."""
        self._waiter = asyncio.get_running_loop().create_future()
        if self._lost is None:
            self.transport.write(encode_request(op, 0, 0, 0, -1, NO_KEY, 0, payload))  # type: ignore[union-attr]
        self._answer()
        return await self._waiter

    def _answer(self) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        try:
            frames, used = parse_responses(bytes(self._buf), self._max_frame)
        except FrameError as e:
            waiter.set_exception(ConnectionResetError(f"bad answer during set-up: {e}"))
            return
        if frames:
            del self._buf[:used]
            _op, status, _rid, _ledger, entry_id, _lac, payload = frames[0]
            waiter.set_result((status, entry_id, payload))
        elif self._lost is not None:
            waiter.set_exception(self._lost)


class _ShardProtocol(asyncio.BufferedProtocol):
    """Responses are read straight into the pipe's receive buffer (no bytes object per read)."""

    def __init__(self, conn: ShardConnection) -> None:
        self.conn = conn
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def _current(self) -> bool:
        """Whether this transport is still the connection's: one it gave up on (a bad frame)
        may report late, and must not touch the pipe the next transport now feeds."""
        return self.transport is not None and self.conn._transport is self.transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self._current():
            self.conn._lost(exc)

    def get_buffer(self, sizehint: int) -> memoryview:
        if not self._current():  # a transport given up on may still read: never into the pipe
            return memoryview(bytearray(65536))
        buf: memoryview = self.conn.pipe.get_buffer(sizehint)
        return buf

    def buffer_updated(self, nbytes: int) -> None:
        if self._current():
            self.conn.answered = True
            self._dispatch(self.conn.pipe.buffer_updated, nbytes)

    def feed(self, data: bytes) -> None:
        """Responses that arrived some other way (`bk bench client`'s in-process echo)."""
        if self._current():
            self._dispatch(self.conn.pipe.feed, data)

    def _dispatch(self, how: Callable[[Any], None], arg: Any) -> None:
        try:
            how(arg)
        except FrameError as e:
            self.transport.close()  # type: ignore[union-attr]
            self.conn._lost(e)


class ShardConnection:
    """One TCP connection to one bookie shard, serving one bookie id (client event loop only).

    Frames are encoded into the pipe's outbox as requests are made and written once per
    loop iteration; responses are dispatched by the pipe a receive buffer at a time.
    """

    def __init__(self, host: str, port: int, *, timeout_s: float, max_frame_bytes: int,
                 bookie_id: str | None = None, trust: ClientTrust | None = None,
                 clock: Clock = system_monotonic) -> None:
        self.host, self.port = host, port
        self.clock = clock
        self.bookie_id = bookie_id or f"{host}:{port}"
        # How messages name the peer: its id, and the shard's address when that differs.
        self.peer = self.bookie_id if self.bookie_id == f"{host}:{port}" else f"{self.bookie_id} at {host}:{port}"
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.trust = trust or ClientTrust()
        self._loop = asyncio.get_running_loop()
        self.pipe = RequestPipe(max_frame_bytes, self._error_for, functools.partial(self._loop.call_soon, self._flush),
                                self._flush, clock=None if clock is system_monotonic else clock)
        self._transport: asyncio.Transport | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._renewal: asyncio.TimerHandle | None = None
        self._renewing: asyncio.Task[None] | None = None
        # The bookie's last AUTHENTICATION answer on this connection: it closes the connection
        # after one, and the requests lost with it fail for that reason, not as "lost".
        self._refused: AuthenticationError | None = None
        # Whether the bookie answered anything on this transport, and what a close before it
        # did means (client_cert_refusal; None when the client presented no certificate).
        self.answered = False
        self._unanswered_close: Callable[[], AuthenticationError | None] | None = None
        self._handshake_at = 0.0

    def _error_for(self, status: int, payload: Any = b"") -> BKError:
        err = error_for_status(status, f"bookie {self.peer}: {bookie_reason(status, payload)}")
        if isinstance(err, AuthenticationError):
            self._refused = err
        return err

    async def _connect(self) -> None:
        try:
            transport, session = await asyncio.wait_for(self._set_up(), self.timeout_s)
        except BKError as e:  # AuthenticationError, or a plug-in that cannot be framed (ConfigError)
            self._fail_queued(e)
            return
        except (OSError, asyncio.TimeoutError) as e:
            self._fail_queued(BookieUnavailableError(f"cannot connect to {self.peer}: {e or type(e).__name__}"))
            return
        self.attach(transport)
        if session is not None:
            self._schedule_renewal(session, transport)

    def _fail_queued(self, err: BKError) -> None:
        self.pipe.discard_outbox()
        self.pipe.fail_all(err)

    async def _set_up(self) -> tuple[asyncio.Transport, ClientAuthSession | None]:
        """TCP connect, then START_TLS and the identity check, then the AUTH exchange (each when
        configured): the transport to attach (its protocol a _ShardProtocol of this connection)
        and the AUTH session, whose plug-in says when to renew."""
        self._unanswered_close = None
        if not self.trust.sets_up:
            transport, _ = await self._loop.create_connection(lambda: _ShardProtocol(self), self.host, self.port)
            return transport, None
        transport, setup = await self._loop.create_connection(lambda: _SetupProtocol(self.max_frame_bytes, self.peer),
                                                              self.host, self.port)
        try:
            if self.trust.mode != "off":
                transport = await self._start_tls(transport, setup)
            session = None
            if self.trust.auth is not None:
                if self.trust.mode == "optional" and transport.get_extra_info("ssl_object") is None:
                    # Whoever answered START_TLS with UNKNOWN_OP may be a man in the middle: its
                    # identity was never checked, and a token sent now could be replayed.
                    raise AuthenticationError(
                        f"bookie {self.peer} does not offer TLS: this client's {self.trust.auth.name} credential "
                        f"is not sent in plain text to a bookie whose identity was not checked (tls = optional; "
                        f"tls = off sends it in clear deliberately)")
                session = await authenticate(self.trust.auth, functools.partial(setup.round_trip, Op.AUTH),
                                             peer=self.peer)
        except BaseException:
            transport.close()
            raise
        protocol = _ShardProtocol(self)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        # Set-up answered nothing when it had no AUTH round: a close soon after, before the first
        # answer, is then still the bookie refusing this client's certificate.
        self._unanswered_close = setup.refusal if session is None else None
        self._handshake_at = self.clock()
        return transport, session

    async def _start_tls(self, transport: asyncio.Transport, setup: _SetupProtocol) -> asyncio.Transport:
        """START_TLS, the handshake with the client's current context, then the certificate
        checked against the bookie id this connection serves (not the address: a registration
        pointing this id at another bookie's address must not pass)."""
        status, _, payload = await setup.round_trip(Op.START_TLS)
        if not start_tls_answer(status, payload, mode=self.trust.mode, peer=self.peer):
            return transport
        context = self.trust.tls.context  # type: ignore[union-attr]  # mode != off: a context exists
        try:
            tls_transport = await self._loop.start_tls(transport, setup, context, server_hostname=None,
                                                       ssl_handshake_timeout=self.timeout_s)
        except (ssl.SSLError, OSError) as e:
            raise AuthenticationError(f"bookie {self.peer}: TLS handshake failed: "
                                      f"{describe_tls_failure(e, peer=self.peer)}") from e
        if tls_transport is None:
            raise AuthenticationError(f"bookie {self.peer}: TLS handshake failed: the connection closed")
        setup.transport = tls_transport
        setup.refusal = functools.partial(client_cert_refusal, self.trust.tls, self.peer)  # type: ignore[arg-type]
        try:
            ssl_object = tls_transport.get_extra_info("ssl_object")
            check_bookie_identity(ssl_object.getpeercert() if ssl_object is not None else {}, self.bookie_id,
                                  host_port=f"{self.host}:{self.port}")
        except BaseException:
            tls_transport.close()
            raise
        return tls_transport

    def _schedule_renewal(self, session: ClientAuthSession, transport: asyncio.Transport) -> None:
        """Run the next AUTH exchange when the plug-in says its credential needs renewing."""
        if self._transport is not transport:
            return
        try:
            delay = _plugin_step(self.trust.auth.name, self.peer, session.renew_after_s)  # type: ignore[union-attr]
        except AuthenticationError as e:
            self._lost(e, error=e)
            return
        if delay is not None:
            self._renewal = self._loop.call_later(max(0.0, delay), self._renew, transport)

    def _renew(self, transport: asyncio.Transport) -> None:
        if self._transport is transport:
            self._renewing = self._loop.create_task(self._run_renewal(transport))

    async def _run_renewal(self, transport: asyncio.Transport) -> None:
        """An AUTH exchange on the open connection, requests flowing meanwhile: on success its
        new credential replaces the old one on the bookie; a refusal closes the connection."""
        try:
            session = await authenticate(self.trust.auth, self._pipe_round, peer=self.peer)  # type: ignore[arg-type]
        except AuthenticationError as e:
            if self._transport is transport:
                log.warning("renewing the authentication of %s failed: %s", self.peer, e)
                self._lost(e, error=e)
            return
        except BKError:
            return  # the connection was lost meanwhile: its requests failed with it
        self._schedule_renewal(session, transport)

    async def _pipe_round(self, payload: bytes) -> tuple[int, int, bytes]:
        """One AUTH round through the pipe, like any request of the open connection."""
        fut: asyncio.Future[tuple[int, int, bytes]] = self._loop.create_future()

        def done(_ctx: None, resp: tuple[Any, ...] | None, err: BKError | None) -> None:
            if fut.done():
                return
            if resp is None:
                fut.set_exception(err)  # type: ignore[arg-type]
            else:
                fut.set_result((resp[1], resp[4], bytes(resp[6])))
        self.request(Op.AUTH, 0, 0, -1, NO_KEY, 0, payload, done, None)
        return await fut

    def attach(self, transport: asyncio.Transport) -> None:
        """Use this transport (connected, its protocol a _ShardProtocol of this connection) and
        send what waited for it. `bk bench client` attaches an in-process echo this way."""
        self._transport = transport
        self._refused = None
        self.answered = False
        if transport.is_closing():  # lost before it was attached: its connection_lost was ignored
            self._lost(None)
            return
        self.pipe.connected = True
        self._flush()

    def request(self, op: int, flags: int, ledger_id: int, entry_id: int, key: bytes, aux: int,
                payload: bytes, callback: Callback, ctx: Any, timeout_s: float | None = None,
                borrow: bool = False) -> None:
        """Queue one request; callback(ctx, response, error) runs on the loop when it settles.
        borrow: the response payload is a view of the receive buffer, valid during the callback only."""
        if self.pipe.send(op, flags, ledger_id, entry_id, key, aux, payload, callback, ctx,
                          timeout_s or self.timeout_s, borrow):
            self.ensure_connecting()

    def ensure_connecting(self) -> None:
        """Start connecting unless already under way (the pipe's frames wait for it)."""
        if self._connecting is None or self._connecting.done():
            self._connecting = self._loop.create_task(self._connect())

    def _flush(self) -> None:
        if self.pipe.connected:
            out = self.pipe.take()
            if out is not None:
                self._transport.write(out)  # type: ignore[union-attr]

    def _lost(self, exc: Exception | None, *, error: BKError | None = None) -> None:
        """The connection is gone: its requests fail with `error`, else with the bookie's last
        AUTHENTICATION refusal on it, else as lost."""
        transport, self._transport = self._transport, None
        if transport is not None and error is not None:
            transport.close()
        self._cancel_renewal()
        self.pipe.connected = False
        self.pipe.discard_outbox()
        refusal = (self._unanswered_close if not self.answered
                   and self.clock() - self._handshake_at < CERT_REFUSAL_WINDOW_S else None)
        err = (error or self._refused or tls_refusal(exc, self.peer) or (refusal() if refusal is not None else None)
               or BookieUnavailableError(f"connection to {self.peer} lost: {exc or 'closed'}"))
        self._refused = None
        self.pipe.fail_all(err)

    def _cancel_renewal(self) -> None:
        if self._renewal is not None:
            self._renewal.cancel()
            self._renewal = None

    def expire(self, now: float) -> None:
        """Fail requests past their deadline with TimeoutError."""
        self.pipe.expire(now, lambda: TimeoutError(f"request to {self.peer} timed out"))

    def close(self, error: BKError | None = None) -> None:
        """Close it: every request on it (sent, or queued while it was connecting) fails now,
        with `error` (the client closing), else as dropped (retriable: their handles go on
        elsewhere). Why now: once closed, the transport's own close is no longer this
        connection's (_ShardProtocol._current), so requests left to it never settled. A
        connection being made is stopped (left running, it attached a transport nobody
        tracked and sent them with no deadline kept)."""
        self._cancel_renewal()
        if self._renewing is not None:
            self._renewing.cancel()
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        self._lost(None, error=error or BookieUnavailableError(f"connection to {self.peer} dropped"))


class Segment:
    """Where the entries of one ledger segment go (client loop only): its ensemble, each
    slot's shard connection (None: the bookie is not registered) and their request pipes
    (None unless every slot routes). Shared by every handle whose segment has the same
    bookies owning its ledger on the same shards: a client with 10^4 open handles over a few
    ensembles keeps a few of these, not 10^4 (issue 26: what an open handle costs)."""

    __slots__ = ("ensemble", "conns", "pipes", "epoch")

    def __init__(self, ensemble: list[str], conns: list[ShardConnection | None], epoch: int) -> None:
        self.ensemble = ensemble
        self.conns = conns
        self.pipes: list[Any] | None = None if None in conns else [c.pipe for c in conns]  # type: ignore[union-attr]
        self.epoch = epoch  # the pool's routes_epoch it was routed at: stale once that moves


MAX_SEGMENTS = 4096  # distinct segments cached; past it the cache starts again (handles keep theirs)


class BookieClientPool:
    """Shard-aware routing: bookie id + ledger id -> the owning shard's connection.

    Routes are cached per bookie (its shards' connections, from its registration); the shard
    of a ledger is shard_for_ledger(ledger id, the bookie's shard count), the function the
    bookie answers by. Nothing is cached per ledger: a client with 10^4 open ledgers keeps
    routes for its bookies only."""

    def __init__(self, resolve: Callable[[str], dict[str, Any] | None], *, timeout_s: float = 30.0,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, trust: ClientTrust | None = None,
                 clock: Clock = system_monotonic) -> None:
        self._resolve = resolve
        self.clock = clock  # request deadlines (bookkeeper/clock.py)
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.trust = trust or ClientTrust()
        self._conns: dict[tuple[str, str, int], ShardConnection] = {}
        self._routes: dict[str, list[ShardConnection]] = {}  # bookie id -> its shards' connections, in shard order
        self._segments: dict[tuple[Any, ...], Segment] = {}
        self.routes_epoch = 0  # bumped when routes are forgotten: segments routed before are stale
        self._sweeper: asyncio.Task[None] | None = None
        self.closed = False

    def local_addresses(self) -> list[str]:
        """`host:port` of this client's end of every shard connection open now, as the shards
        see it: what a bookie's add trace takes (bookkeeper/bookie/add_trace.py)."""
        out = []
        for conn in self._conns.values():
            transport = conn._transport
            name = transport.get_extra_info("sockname") if transport is not None and not transport.is_closing() else None
            if isinstance(name, tuple) and len(name) >= 2:
                out.append(f"{name[0]}:{name[1]}")
        return sorted(out)

    def invalidate_routes(self) -> None:
        """Forget cached routes (registrations were re-read)."""
        self._routes.clear()
        self._segments.clear()
        self.routes_epoch += 1

    def connection(self, bookie_id: str, ledger_id: int) -> ShardConnection:
        """The connection of the shard of bookie_id that owns ledger_id."""
        conns = self._routes.get(bookie_id) or self._route(bookie_id)
        return conns[shard_for_ledger(ledger_id, len(conns))]

    def _route(self, bookie_id: str) -> list[ShardConnection]:
        info = self._resolve(bookie_id)
        if info is None:
            raise BookieUnavailableError(f"bookie {bookie_id} is not registered")
        if not info["shards"]:
            raise BookieUnavailableError(f"bookie {bookie_id} registers no shard")
        conns = self._routes[bookie_id] = [self.connection_to(shard["host"], shard["port"], bookie_id)
                                           for shard in info["shards"]]
        return conns

    def segment(self, ensemble: list[str], ledger_id: int) -> Segment:
        """The shared Segment of ledger_id's entries over `ensemble` (routed now; a handle
        asks again once routes_epoch moves)."""
        key: list[Any] = []
        conns: list[ShardConnection | None] = []
        for bookie in ensemble:
            try:
                conn = self.connection(bookie, ledger_id)
            except BKError:
                conn = None
            key.append(bookie)
            key.append(None if conn is None else (conn.host, conn.port))
            conns.append(conn)
        found = self._segments.get(tuple(key))
        if found is None:
            if len(self._segments) >= MAX_SEGMENTS:
                self._segments.clear()
            found = self._segments[tuple(key)] = Segment(list(ensemble), conns, self.routes_epoch)
        return found

    def connection_to(self, host: str, port: int, bookie_id: str | None = None) -> ShardConnection:
        """The connection to a shard address serving bookie_id (default: the address itself).

        With TLS one is kept per (bookie id, address), each checked against the id it serves:
        a registration that points id X at another bookie's address gets a connection of its
        own, whose check fails, instead of one verified for that other bookie. Without TLS
        nothing is checked, and the ids registered at one address share its connection.
        """
        if self.closed:
            raise ClientClosedError(f"bookie {bookie_id or f'{host}:{port}'}: the client is closed")
        key = ((bookie_id or f"{host}:{port}") if self.trust.mode != "off" else "", host, port)
        conn = self._conns.get(key)
        if conn is None:
            conn = self._conns[key] = ShardConnection(host, port, timeout_s=self.timeout_s,
                                                      max_frame_bytes=self.max_frame_bytes, bookie_id=bookie_id,
                                                      trust=self.trust, clock=self.clock)
            if self._sweeper is None:
                self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return conn

    def send(self, bookie_id: str, op: int, flags: int, ledger_id: int, entry_id: int, key: bytes,
             aux: int, payload: bytes, callback: Callback, ctx: Any, timeout_s: float | None = None,
             borrow: bool = False) -> None:
        """Route one request; an unresolvable bookie fails through the callback, like any other error.
        borrow: see ShardConnection.request."""
        try:
            conn = self.connection(bookie_id, ledger_id)
        except BKError as e:
            asyncio.get_running_loop().call_soon(callback, ctx, None, e)
            return
        conn.request(op, flags, ledger_id, entry_id, key, aux, payload, callback, ctx, timeout_s, borrow)

    async def call(self, bookie_id: str, op: int, flags: int, ledger_id: int, entry_id: int, key: bytes,
                   aux: int = 0, payload: bytes = b"", timeout_s: float | None = None) -> tuple[Any, ...]:
        """One request as a coroutine: the response tuple, or raises its error."""
        fut: asyncio.Future[tuple[Any, ...]] = asyncio.get_running_loop().create_future()

        def done(_ctx: None, resp: tuple[Any, ...] | None, err: BKError | None) -> None:
            if fut.done():
                return
            if err is not None:
                fut.set_exception(err)
            else:
                fut.set_result(resp)  # type: ignore[arg-type]
        self.send(bookie_id, op, flags, ledger_id, entry_id, key, aux, payload, done, None, timeout_s)
        return await fut

    async def _sweep(self) -> None:
        """Deadlines of every connection's requests; the TLS files, cheaply (a stat at most once
        per tls_reload_interval_s): a renewed certificate or CA serves the next connection."""
        while True:
            await asyncio.sleep(0.1)
            now = self.clock()
            for conn in list(self._conns.values()):
                conn.expire(now)
            if self.trust.tls is not None:
                self.trust.tls.maybe_reload()

    def drop_connections(self) -> None:
        """Close every connection (their requests fail as on a connection lost); the next
        request connects anew. For a client that lives on: a test or bench measuring new
        connections, a simulated client whose connections are reset."""
        self._drop(None)

    def _drop(self, error: BKError | None) -> None:
        conns = list(self._conns.values())
        self._conns.clear()  # first: a failed request's callback may connect anew (drop_connections)
        self.invalidate_routes()
        for conn in conns:
            conn.close(error)

    def close(self) -> None:
        """Drop every connection and refuse later requests (ClientClosedError): requests queued
        on a connection still being made fail with it."""
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._drop(ClientClosedError("the client is closed"))


class BookieHealth:
    """Which bookies erred or timed out lately, each for `penalty_s` after its last error
    (client loop only): reads try them last, placement avoids them."""

    def __init__(self, penalty_s: float, clock: Clock = system_monotonic) -> None:
        self.penalty_s = penalty_s
        self.clock = clock
        self._until: dict[str, float] = {}

    def penalize(self, bookie_id: str) -> None:
        self._until[bookie_id] = self.clock() + self.penalty_s

    def is_slow(self, bookie_id: str) -> bool:
        until = self._until.get(bookie_id)
        if until is None:
            return False
        if until < self.clock():
            del self._until[bookie_id]
            return False
        return True

    def current(self) -> set[str]:
        """The bookies penalized now (expired ones are forgotten)."""
        now = self.clock()
        for b in [b for b, until in self._until.items() if until < now]:
            del self._until[b]
        return set(self._until)

    def penalized_now(self) -> set[str]:
        """current() without forgetting expired ones: a read only, safe from another thread
        (a metrics scrape) while the loop penalizes and forgets."""
        now = self.clock()
        return {b for b, until in list(self._until.items()) if until >= now}

    def order(self, replicas: list[str]) -> list[str]:
        """Replicas in write-set order, penalized ones moved last (stable)."""
        if not self._until:
            return replicas
        return sorted(replicas, key=self.is_slow)
