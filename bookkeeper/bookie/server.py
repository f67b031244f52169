"""The RPC front end of one shard: a thin uvloop protocol over the Cython codec.

Lives in: one shard process, its event loop thread.

`data_received` hands the whole receive buffer to the shard's C add path
(`AddPath.dispatch`, ext/bookkeeper/_ext/shardpath.pyx): adds whose answer is OK are
staged, journaled and their responses encoded into the connection's `pending` bytes
in one C loop; every other frame comes back here (`dispatch`) in arrival order.
Responses that need no journal (reads, errors) are encoded together and written once
per receive; add responses are written once per journal batch per connection
(`on_durable`).

Bad input never takes the shard down: a frame that can never parse (over the
limit, shorter than a header, unknown version) closes that connection; a
well-formed frame with a bad op, key or ledger gets an error status; nothing
stored changes on any error path.

Bounds on every peer (`PeerBounds`, docs/protocol.md "Bounds"): at most `max_connections`
per shard (one over it is closed at once); a peer whose answers pile up unread past
`write_buffer_high_bytes` is not read from, and its requests already received wait
unanswered, until its answers drain; at most `max_long_polls_per_connection` parked long
polls per connection (one over it is answered at once with the current state), none on a
ledger this shard does not hold (NO_SUCH_LEDGER at once); a connection with no request for
`idle_timeout_s` and nothing outstanding is closed.

Trust (`ShardTrust`, bookkeeper/bookie/trust.py; docs/protocol.md START_TLS, AUTH,
Authorization): a connection that must prove something (tls = require, an auth_provider) is
not `open` until it has; until then its frames are parsed here, at most 64 KiB each, only
START_TLS and AUTH served, within auth_timeout_s, at most max_unauthenticated_connections
per shard, and an address that keeps failing is backed off. TLS is uvloop's start_tls on the
same protocol object, so every bound above holds through the SSL transport, and a receive
buffer's answers still leave in one write (one TLS write). Once open, each op's role is
checked against the principal's cached roles before storage is touched; the C add path
takes only the adds the connection's `add_roles` cover.
"""
from __future__ import annotations

import asyncio
import heapq
import hmac
import itertools
import json
import logging
import math
import shutil
import struct
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

from bookkeeper._ext.journal import REC_ADD, REC_FENCE, REC_MASTER_KEY
from bookkeeper._ext.shardpath import AddPath, fail_responses
from bookkeeper.clock import Clock, system_monotonic, system_wall
from bookkeeper.bookie.add_trace import REPORT_PAGE, AddTrace, parse_peers, parse_seconds
from bookkeeper.bookie.core import (ReadAction, decide_add, decide_read, decide_read_lac, decide_write_lac,
                                    is_idle)
from bookkeeper.bookie.journal import Journal
from bookkeeper.bookie.metrics import shard_histograms
from bookkeeper.bookie.storage import LedgerState, LedgerStorage
from bookkeeper.bookie.storage.ledger_storage import ENTRY_OVERHEAD_BYTES
from bookkeeper.bookie.trust import (
    PRE_AUTH_FRAME_BYTES,
    ShardTrust,
    add_roles,
    reason_class,
    required_role,
    split_auth_payload,
)
from bookkeeper.errors import AuthenticationError, AuthorizationError
from bookkeeper.proto import (
    ENTRY_HEADER_BYTES,
    MAX_LEDGER_ID,
    NO_KEY,
    Flag,
    FrameError,
    Op,
    Status,
    encode_responses,
    entry_header,
    parse_requests,
    shard_for_ledger,
)
from bookkeeper.security.auth import ServerAuthSession
from bookkeeper.security.authz import ALL_ROLES, ANONYMOUS
from bookkeeper.security.tls import describe_tls_failure

log = logging.getLogger(__name__)

Response = tuple[int, int, int, int, int, int, bytes]
Poll = tuple[int, "BookieProtocol", int, int, int]  # entry, conn, request_id, number, ledger
# Plain ints for the per-request path (IntEnum attribute lookups and comparisons cost).
_ADD, _READ, _READ_LAC, _INFO = int(Op.ADD_ENTRY), int(Op.READ_ENTRY), int(Op.READ_LAC), int(Op.GET_BOOKIE_INFO)
_WRITE_LAC, _START_TLS, _AUTH, _WHOAMI = int(Op.WRITE_LAC), int(Op.START_TLS), int(Op.AUTH), int(Op.WHOAMI)
_OK = int(Status.OK)
_FENCE = int(Flag.FENCE)  # an IntFlag `&` costs ~1 us a read
_RECOVERY_ADD, _LONG_POLL = int(Flag.RECOVERY_ADD), int(Flag.LONG_POLL)
_NO_REPLY = (None, None, 0.0)
BOOKIE_INFO = struct.Struct(">QQHH")
_U32 = struct.Struct(">I")
LONG_POLL_MAX_MS = 60_000
POLL_TICK_S = 0.01  # parked long polls expire in buckets this wide (at most this late)
NEVER = 2**62
REFUSAL_LOG_INTERVAL_S = 10.0  # a flood of refused connections logs one line per interval
# Connections one address may hold before authenticating: without it one host holding every
# unauthenticated slot (and reconnecting at each auth_timeout_s) locks every new client out.
MAX_UNAUTHENTICATED_PER_HOST = 64


# A sender with at most this many adds waiting for the journal, whose receive buffers are at
# most LIGHT_SENDER_BYTES, is read on while the shard is over its memory bounds
# (ShardServer.apply_backpressure).
LIGHT_SENDER_ADDS = 32
LIGHT_SENDER_BYTES = 64 << 10
ADD_RESPONSE_BYTES = 40  # an add's encoded response in BookieProtocol.pending (the C add path)
# One connection's full reads dispatched before the loop turns to others (BookieProtocol._slice);
# a read shorter than SLICE_READ_MIN_BYTES means the kernel had no more of it.
READ_SLICE_BYTES = 128 << 10
SLICE_READ_MIN_BYTES = 64 << 10


@dataclass(frozen=True)
class PeerBounds:
    """What one peer may hold of a shard (the bookie config keys of the same names)."""

    max_connections: int = 10_000
    write_buffer_high_bytes: int = 4 << 20
    max_long_polls_per_connection: int = 1_000
    idle_timeout_s: float = 600.0  # 0: never closed for idleness


class BookieProtocol(asyncio.Protocol):
    """One client connection to a shard."""

    def __init__(self, shard: ShardServer) -> None:
        self.shard = shard
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._out: list[Response] = []
        self.pending = bytearray()  # encoded responses of adds not yet durable (the C add path)
        self.journal_waiting = 0  # replies of the Python path waiting in the journal (ShardServer._journal_reply)
        self.journal_block = 0  # the last journal block its records went to (Journal.select)
        self._slice_bytes = 0  # read in full reads since it last let others in (_slice)
        # Its C-path journal records not yet durable, and their bytes (its share: apply_backpressure).
        self.journal_records = 0
        self.journal_bytes = 0
        self.closed = False
        self._refusing = False  # a bad frame arrived: answer what came before it, then close
        self.writing_paused = False  # the peer does not read its answers: see pause_writing
        self.held: deque[tuple[Any, ...]] = deque()  # requests received while writing_paused, answered on resume
        self._out_bytes = 0  # payload bytes of the answers in _out
        self.polls: dict[int, int] = {}  # parked long polls: number -> ledger
        self.last_request = shard.clock()
        self._buffered = True  # the transport keeps what the peer has not taken (a socket's)
        # Trust (docs/protocol.md, START_TLS, AUTH, Authorization): until `open`, frames are
        # parsed here (_pre_auth), only START_TLS and AUTH served; once open, the principal's
        # roles are cached per policy generation, and `add_roles` tells the C add path which
        # adds it may take (read once per receive buffer).
        self.open = False
        self.tls = False
        self.peercert: dict[str, Any] | None = None
        self.principal: str | None = None
        self.host: str | None = None  # the peer's address while it holds an unauthenticated slot
        self.roles: frozenset[str] = frozenset()
        self.roles_gen = -1
        self.add_roles = 0
        self._tls_offer = False  # open, plain, nothing received yet, and the bookie offers TLS
        self._auth: ServerAuthSession | None = None  # an AUTH exchange under way
        self._expiry: asyncio.TimerHandle | None = None  # the credential's expiry

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if not self.shard.admit(self):
            self.closed = True
            transport.close()
            return
        try:
            transport.set_write_buffer_limits(high=self.shard.bounds.write_buffer_high_bytes)  # type: ignore[attr-defined]
        except NotImplementedError:  # an in-process driver's transport (tests, bk bench shard): no buffer
            self._buffered = False
        trust = self.shard.trust
        if not trust.gated:
            self._authenticated(ANONYMOUS, None)
            self._tls_offer = trust.tls is not None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.held.clear()
        self._buf.clear()  # the auth sweep may keep this object until its deadline: not its bytes
        if self._expiry is not None:
            self._expiry.cancel()
        self.shard.leave_unauthenticated(self)
        self.shard.connections.pop(self, None)
        self.shard.paused.pop(self, None)
        self.shard.write_paused.discard(self)
        self.shard.forget_waiters(self)

    def pause_writing(self) -> None:
        """The peer's unread answers passed write_buffer_high_bytes: stop reading it, and
        hold what it already sent, so that what a shard keeps for it stays bounded."""
        self.writing_paused = True
        self.shard.write_paused.add(self)
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        """Its answers drained: answer the held requests (until it fills up again), then read
        it again unless the shard's own backpressure holds it (release_backpressure does then)."""
        self.writing_paused = False
        self.shard.write_paused.discard(self)
        self.shard.now = self.shard.clock()
        journal = self.shard.journal
        if journal is not None:
            journal.select(self, False)
        try:
            while self.held and not self.writing_paused and not self.closed:
                self.shard.handle(self, self.held.popleft())
        finally:
            if journal is not None:
                journal.deselect()
        self.shard.wake_parked()
        self.flush()
        if self._may_read():
            self.transport.resume_reading()  # type: ignore[union-attr]

    def _may_read(self) -> bool:
        """Nothing holds this connection unread: not the peer's unread answers, not the shard's
        backpressure, not a bad frame or a close."""
        return (not self.writing_paused and self not in self.shard.paused and self.transport is not None
                and not self._refusing and not self.closed)

    def light(self, received: int) -> bool:
        """A light sender: at most LIGHT_SENDER_ADDS C-path adds not yet durable, no reply of
        the Python path waiting (a fence, an add the C path did not take: their items can hold
        an entry's bytes the journal's batches do not count), and the receive buffer it sent
        (and any partial frame kept) at most LIGHT_SENDER_BYTES: a latency-sensitive writer,
        one add or a few in flight. Its adds go to the next journal block to be written
        (Journal.select) and it is read on while only the journal is full
        (ShardServer.apply_backpressure)."""
        return (received <= LIGHT_SENDER_BYTES and len(self._buf) <= LIGHT_SENDER_BYTES
                and not self.journal_waiting and len(self.pending) <= LIGHT_SENDER_ADDS * ADD_RESPONSE_BYTES)

    def unread_bytes(self) -> int:
        """Answers written to the transport that the peer has not taken yet."""
        return self.transport.get_write_buffer_size() if self._buffered and self.transport is not None else 0

    def outstanding(self) -> bool:
        """Anything owed to or from the peer: parked polls, held requests, answers not yet
        durable or not yet taken by the peer."""
        return bool(self.polls or self.held or self.pending or self.writing_paused or self.unread_bytes())

    def data_received(self, data: bytes) -> None:
        if self._refusing:
            return
        if not self.open:
            return self._pre_auth(data)
        if self._tls_offer:
            self._buf += data
            if len(self._buf) < 6:  # the first frame's op byte decides
                return
            self._tls_offer = False
            if self._buf[5] == _START_TLS:
                self.open = False  # until the handshake: nothing else may come meanwhile
                return self._pre_auth(b"")
            data = bytes(self._buf)
            self._buf.clear()
        if self.roles_gen != self.shard.trust.authz.generation:
            self._refresh_roles()
        now = self.shard.now = self.last_request = self.shard.clock()  # every request's arrival time
        bad: FrameError | None
        journal = self.shard.journal
        if journal is not None:
            journal.select(self, self.light(len(data)))
        try:
            if self._buf:
                self._buf += data
                used, bad = self.shard.add_path.dispatch(self, self.pending, self._buf, now)
                del self._buf[:used]
            else:  # the common case: no partial frame kept, parse the receive buffer in place
                used, bad = self.shard.add_path.dispatch(self, self.pending, data, now)
                if used < len(data) and bad is None:
                    self._buf += memoryview(data)[used:]
        finally:
            if journal is not None:
                journal.deselect()
        self.shard.wake_parked()
        self.flush()
        if bad is None:
            self.shard.apply_backpressure(self, len(data))
            self._slice(len(data))
            return
        self.bad_frame(bad)

    def _slice(self, received: int) -> None:
        """Let other connections' requests in after READ_SLICE_BYTES of this one's full reads.

        Why: the event loop reads a connection again and again in one turn while each read
        fills its buffer (libuv: up to 32 reads of 256,000 bytes, measured here), so a bulk
        writer's 8 MB were dispatched before any other connection's small add was read, or a
        sync's completion handled (issue 28 item 2). Past the slice the connection stops being
        read until the next turn of the loop; a read shorter than SLICE_READ_MIN_BYTES ends the
        run (the kernel had no more of it)."""
        if received < SLICE_READ_MIN_BYTES:
            self._slice_bytes = 0
            return
        self._slice_bytes += received
        if self._slice_bytes >= READ_SLICE_BYTES and self._may_read():
            self._slice_bytes = 0
            self.transport.pause_reading()  # type: ignore[union-attr]
            asyncio.get_running_loop().call_soon(self._next_slice)

    def _next_slice(self) -> None:
        if self._may_read():
            self.transport.resume_reading()  # type: ignore[union-attr]

    def bad_frame(self, bad: FrameError) -> None:
        """A frame that can never parse, or one the protocol forbids where it came: counted,
        logged, the connection closed once what came before it is answered."""
        self.shard.counters["bad_frames"] += 1
        log.info("closing connection %s: %s", self.peer, bad)
        self._close_after_answers()

    def _close_after_answers(self) -> None:
        """Read no more; close once every answer owed (adds not yet durable included) is sent."""
        self._refusing = True
        if self.transport is not None:
            self.transport.pause_reading()
        self.flush()
        if self.open:  # adds or fences of it may wait in the journal
            asyncio.get_running_loop().create_task(self._close_when_answered())
        else:
            self.close()

    # -- trust: before the connection is open ---------------------------------------
    def _pre_auth(self, data: bytes) -> None:
        """Frames of a connection not yet open: one at a time, each at most
        PRE_AUTH_FRAME_BYTES, only START_TLS and AUTH served (anything else: AUTHENTICATION,
        then closed). Once AUTH opens it, what follows goes to the add path."""
        self._buf += data
        self.shard.now = self.last_request = self.shard.clock()
        buf = self._buf
        while not self.open and not self._refusing and len(buf) >= 4:
            flen = _U32.unpack_from(buf)[0] + 4
            if flen > PRE_AUTH_FRAME_BYTES:
                return self.bad_frame(FrameError(f"a {flen}-byte frame before authentication "
                                                 f"(at most {PRE_AUTH_FRAME_BYTES})"))
            if len(buf) < flen:
                break
            try:
                frames, _used = parse_requests(bytes(buf[:flen]), PRE_AUTH_FRAME_BYTES)
            except FrameError as e:
                return self.bad_frame(e)
            del buf[:flen]
            frame = frames[0]
            if frame[0] == _START_TLS:
                if buf:
                    return self.bad_frame(FrameError("a frame after START_TLS in the same receive buffer"))
                self.start_tls(frame)
            elif frame[0] == _AUTH:
                self.auth_round(frame)
            else:
                self._refuse_unauthenticated(frame)
        self.flush()
        if self.open and buf and not self._refusing:
            rest = bytes(buf)
            buf.clear()
            self.data_received(rest)

    def _gate_reason(self) -> str:
        trust = self.shard.trust
        if trust.tls_mode == "require" and not self.tls:
            return "TLS required (tls = require on this bookie)"
        name = trust.provider.name if trust.provider is not None else "none"
        return f"authentication required (auth_provider = {name} on this bookie)"

    def _refuse_unauthenticated(self, frame: tuple[Any, ...]) -> None:
        """An op other than START_TLS or AUTH before the connection is open."""
        reason = self._gate_reason()
        self.shard.auth_refused(self, reason_class(reason), offence=False)
        self.respond((frame[0], Status.AUTHENTICATION, frame[2], frame[3], frame[4], -1, reason.encode()))
        self._close_after_answers()

    def start_tls(self, frame: tuple[Any, ...]) -> None:
        """START_TLS: UNKNOWN_OP on a bookie with tls = off; else OK, then the handshake with
        the context current now. Only as a connection's first frame (docs/protocol.md)."""
        tls = self.shard.trust.tls
        if tls is None:
            self.respond((_START_TLS, Status.UNKNOWN_OP, frame[2], frame[3], frame[4], -1, b""))
            return
        if self.tls or self.open:
            return self.bad_frame(FrameError("START_TLS is only a plain connection's first frame"))
        assert self.transport is not None
        self.transport.pause_reading()
        self.respond((_START_TLS, _OK, frame[2], frame[3], frame[4], -1, b""))
        self.flush()
        self._refusing = True  # nothing is read until the handshake is done
        asyncio.get_running_loop().create_task(self._upgrade(tls.context))

    async def _upgrade(self, context: Any) -> None:
        raw = self.transport
        assert raw is not None
        try:
            transport = await asyncio.get_running_loop().start_tls(
                raw, self, context, server_side=True, ssl_handshake_timeout=self.shard.trust.auth_timeout_s)
        except (OSError, EOFError) as e:  # ssl.SSLError, a reset, the handshake's timeout
            self.shard.tls_failed(self, e)
            raw.close()
            self.connection_lost(None)
            return
        if transport is None or self.closed:  # timed out or shut down meanwhile
            if transport is not None:
                transport.close()
            return
        self.transport = transport
        self.tls = True
        self._refusing = False
        self.peercert = transport.get_extra_info("peercert") or None
        transport.set_write_buffer_limits(high=self.shard.bounds.write_buffer_high_bytes)
        self.shard.counters["tls_handshakes"] += 1
        if self.shard.trust.provider is None:
            self._authenticated(ANONYMOUS, None)

    def auth_round(self, frame: tuple[Any, ...]) -> None:
        """One AUTH frame: a round of an exchange (the first names the plug-in), before the
        connection is open or, renewing its credential, after. A failure answers
        AUTHENTICATION with the reason and closes the connection."""
        _op, _flags, req_id, ledger_id, entry_id, _key, _aux, payload, _lac = frame
        trust = self.shard.trust
        provider = trust.provider
        if provider is None:
            return self.respond((_AUTH, Status.UNKNOWN_OP, req_id, ledger_id, entry_id, -1, b""))
        if trust.tls_mode == "require" and not self.tls:
            return self._auth_failed(frame, self._gate_reason())
        try:
            name, body = split_auth_payload(payload)
        except ValueError as e:
            return self._auth_failed(frame, str(e))
        if self._auth is None:
            if name != provider.name:
                return self._auth_failed(frame, f"unknown plug-in {name!r} (this bookie uses {provider.name})")
            self._auth = provider.new_session(self.peercert)
        try:
            step = self._auth.step(body)
        except AuthenticationError as e:
            return self._auth_failed(frame, str(e))
        except Exception as e:  # a plug-in's bug refuses this peer, never takes the shard down
            log.exception("auth plug-in %s failed", provider.name)
            return self._auth_failed(frame, f"the {provider.name} plug-in failed: {type(e).__name__}")
        if not step.done:
            return self.respond((_AUTH, _OK, req_id, ledger_id, 0, -1, step.reply))
        self._auth = None
        if not step.principal:
            return self._auth_failed(frame, f"the {provider.name} plug-in named no principal")
        # A credential expired already is refused; one that expires later is served until its timer runs.
        if step.expires_at is not None and step.expires_at <= self.shard.wall_clock():
            return self._auth_failed(frame, f"the {provider.name} plug-in's credential expired already")
        self.shard.counters["auth_successes"] += 1
        self._authenticated(step.principal, step.expires_at)
        self.respond((_AUTH, _OK, req_id, ledger_id, 1, -1, step.reply or step.principal.encode()))

    def _auth_failed(self, frame: tuple[Any, ...], reason: str) -> None:
        self._auth = None
        self.shard.auth_refused(self, reason_class(reason), offence=True)
        log.debug("closing connection %s: AUTH refused: %s", self.peer, reason)
        self.respond((_AUTH, Status.AUTHENTICATION, frame[2], frame[3], frame[4], -1, reason.encode()))
        self._close_after_answers()

    def _authenticated(self, principal: str, expires_at: float | None) -> None:
        """Open the connection for `principal` (or renew it): its roles, its expiry."""
        self.principal = principal
        self._refresh_roles()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if expires_at is not None:
            self._expiry = asyncio.get_running_loop().call_later(max(0.0, expires_at - self.shard.wall_clock()),
                                                                 self._expired)
        if not self.open:
            self.open = True
            self.shard.leave_unauthenticated(self)

    def _expired(self) -> None:
        """The credential expired without a renewal: closed, counted."""
        self._expiry = None
        self.shard.counters["auth_expired_closed"] += 1
        log.info("closing connection %s: the credential of %r expired without renewal", self.peer, self.principal)
        self.close()

    def _refresh_roles(self) -> None:
        authz = self.shard.trust.authz
        self.roles = authz.roles(self.principal or ANONYMOUS)
        self.add_roles = add_roles(self.roles)
        self.roles_gen = authz.generation

    def whoami(self) -> bytes:
        """WHOAMI's answer: the principal and its roles now (the policy may have been reloaded)."""
        self._refresh_roles()
        return json.dumps({"principal": self.principal or ANONYMOUS, "roles": sorted(self.roles)}).encode()

    def forbidden(self, frame: tuple[Any, ...], role: str) -> bool:
        """Whether the principal lacks `role` (then answered FORBIDDEN naming both, counted);
        asked only when its cached roles lack it, so the policy has the last word."""
        try:
            self.shard.trust.authz.check(self.principal or ANONYMOUS, role)
        except AuthorizationError as e:
            self.shard.forbidden[role] += 1
            self.respond((frame[0], Status.FORBIDDEN, frame[2], frame[3], frame[4], -1, str(e).encode()))
            return True
        self._refresh_roles()
        return False

    async def _close_when_answered(self) -> None:
        """Close once the adds accepted before a refusal are durable and answered."""
        journal = self.shard.journal
        if journal is not None:
            await journal.drain()
        self.close()

    @property
    def peer(self) -> Any:
        return self.transport.get_extra_info("peername") if self.transport else None

    def respond(self, resp: Response) -> None:
        self._out.append(resp)
        self._out_bytes += len(resp[6])
        if self._out_bytes >= self.shard.bounds.write_buffer_high_bytes:
            self.flush()  # may pause_writing: the rest of this receive buffer is then held

    def flush(self) -> None:
        if self._out and not self.closed and self.transport is not None:
            self.transport.write(encode_responses(self._out))
        self._out = []
        self._out_bytes = 0

    def send_now(self, responses: list[Response]) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(encode_responses(responses))

    def send_pending(self, nbytes: int, failed: bool = False) -> None:
        """Write the first nbytes of pending add responses (their block is durable, or
        failed: then they become SERVER_ERROR) and drop them."""
        if failed:
            fail_responses(self.pending, nbytes)
        if not self.closed and self.transport is not None:
            self.transport.write(self.pending[:nbytes])  # a copy: pending keeps changing
        del self.pending[:nbytes]

    def close(self) -> None:
        self.closed = True
        self.shard.leave_unauthenticated(self)
        if self.transport is not None:
            self.transport.close()


def _host_of(peer: Any) -> str | None:
    """The address part of a peername (None for an in-process transport)."""
    return peer[0] if isinstance(peer, tuple) and peer else None


class ShardServer:
    """Request handling of one shard: storage + journal + long-poll waiters."""

    def __init__(self, *, storage: LedgerStorage, shard_index: int, shards: int,
                 max_frame_bytes: int, readonly: bool, data_dir: str,
                 write_cache_max_bytes: int = 64 << 20, bounds: PeerBounds = PeerBounds(),
                 trust: ShardTrust | None = None, clock: Clock = system_monotonic,
                 wall_clock: Clock = system_wall) -> None:
        self.storage = storage
        self.clock = clock  # arrivals, idleness, back-off, latencies (bookkeeper/clock.py)
        self.wall_clock = wall_clock  # token expiry
        self.write_cache_max_bytes = write_cache_max_bytes
        self.journal: Journal | None = None
        self.shard_index = shard_index
        self.shards = shards
        self.max_frame_bytes = max_frame_bytes
        self.readonly = readonly  # adds get READ_ONLY: set by the supervisor (disks, decommission, config)
        self.readonly_reason: str | None = "readonly = true in the configuration" if readonly else None
        self.data_dir = data_dir
        self.bounds = bounds
        self.trust = trust if trust is not None else ShardTrust()
        # Insertion-ordered (dicts, not sets of objects): a sweep or a resume visits them in the
        # order they came, not by address, so a simulation replays exactly (testing/sim).
        self.connections: dict[BookieProtocol, None] = {}
        self.unauthenticated: set[BookieProtocol] = set()  # not yet open: at most trust.max_unauthenticated
        self._unauthenticated_by_host: dict[str | None, int] = defaultdict(int)  # at most MAX_UNAUTHENTICATED_PER_HOST
        self._auth_deadlines: deque[tuple[float, BookieProtocol]] = deque()  # arrival order = deadline order
        self._auth_sweep: asyncio.TimerHandle | None = None
        self.auth_failures: dict[str, int] = defaultdict(int)  # by reason class (trust.reason_class)
        self.forbidden: dict[str, int] = defaultdict(int)  # by the role lacked
        self.paused: dict[BookieProtocol, None] = {}  # not read: the shard is over its memory bounds
        self.write_paused: set[BookieProtocol] = set()  # not read: their answers are not being read
        self._refusal_logged = -REFUSAL_LOG_INTERVAL_S
        self._idle_sweep: asyncio.TimerHandle | None = None
        # per op code, "bad_frames", "add_errors", "fence", "connections_refused", "long_polls_refused",
        # "idle_closed", "tls_handshakes", "tls_handshake_failures", "auth_successes", "auth_expired_closed",
        # "unauthenticated_refused", "auth_timeouts", "auth_backoff_refused", "light_senders_read_on",
        # "share_read_on"
        self.counters: dict[int | str, int] = defaultdict(int)
        self.histograms = shard_histograms()
        self._add_latency = self.histograms["add_entry_latency_seconds"]
        self._read_latency = self.histograms["read_entry_latency_seconds"]
        self.now = 0.0  # arrival time of the receive buffer being dispatched (monotonic)
        # ledger -> [poll]: long polls waiting for the LAC to cover their entry; a poll is one
        # tuple (entry, conn, request_id, number, ledger), also in the bucket of its deadline
        # (_buckets: tick -> polls; _ticks: a heap of the buckets' ticks, swept by one timer).
        # A poll that expires or whose connection closes is only marked gone (_gone, by number)
        # and the list rebuilt once half of it is gone: finding it in the list would make
        # 100,000 polls expiring on one ledger cost 10^10 steps. A poll is live while its
        # number is in its connection's polls.
        self._waiters: dict[int, list[Poll]] = {}
        self._buckets: dict[int, list[Poll]] = {}
        self._ticks: list[int] = []
        self._parked = 0  # live polls
        self._dead_polls = 0  # polls in _buckets no longer live
        self._expiry: asyncio.TimerHandle | None = None
        self._sweep_tick = NEVER  # the tick _expiry fires at
        self._gone: dict[int, set[int]] = {}
        self._poll_numbers = itertools.count()
        self._to_wake: set[int] = set()  # ledgers with parked long polls that adds touched since
        self.add_path = AddPath(self, storage, max_frame_bytes, ENTRY_OVERHEAD_BYTES)
        # A running add trace (start_add_trace), tested once per durable block; None when off.
        self.add_trace: AddTrace | None = None
        self._last_trace: AddTrace | None = None

    # -- peers -----------------------------------------------------------------
    def admit(self, conn: BookieProtocol) -> bool:
        """Take a new connection unless max_connections are open, its address is backed off,
        or (when it must authenticate) max_unauthenticated_connections are waiting; each
        refusal counted, logged once per REFUSAL_LOG_INTERVAL_S."""
        trust = self.trust
        if len(self.connections) >= self.bounds.max_connections:
            return self._refuse("connections_refused", f"{len(self.connections)} open, max_connections = "
                                f"{self.bounds.max_connections}")
        host = _host_of(conn.peer)
        if len(trust.backoff) and host is not None and trust.backoff.blocked(host, self.clock()):
            return self._refuse("auth_backoff_refused", f"{host} is backed off after repeated AUTH or TLS failures")
        if trust.gated:
            if len(self.unauthenticated) >= trust.max_unauthenticated:
                return self._refuse("unauthenticated_refused", f"{len(self.unauthenticated)} connections not yet "
                                    f"authenticated, max_unauthenticated_connections = {trust.max_unauthenticated}")
            per_host = min(MAX_UNAUTHENTICATED_PER_HOST, trust.max_unauthenticated)
            if self._unauthenticated_by_host[host] >= per_host:
                return self._refuse("unauthenticated_refused", f"{host} holds {per_host} connections not yet "
                                    f"authenticated, the most one address may")
            self.unauthenticated.add(conn)
            self._unauthenticated_by_host[host] += 1
            conn.host = host
            loop = asyncio.get_running_loop()
            self._auth_deadlines.append((loop.time() + trust.auth_timeout_s, conn))
            if self._auth_sweep is None:
                self._auth_sweep = loop.call_at(self._auth_deadlines[0][0], self._sweep_unauthenticated)
        self.connections[conn] = None
        if self.bounds.idle_timeout_s > 0 and self._idle_sweep is None:
            self._schedule_idle_sweep()
        return True

    def leave_unauthenticated(self, conn: BookieProtocol) -> None:
        """The connection authenticated or closed: its slot, and its address's, are free."""
        if conn in self.unauthenticated:
            self.unauthenticated.discard(conn)
            left = self._unauthenticated_by_host[conn.host] - 1
            if left > 0:
                self._unauthenticated_by_host[conn.host] = left
            else:
                del self._unauthenticated_by_host[conn.host]

    def _refuse(self, counter: str, why: str) -> bool:
        self.counters[counter] += 1
        now = self.clock()
        if now - self._refusal_logged >= REFUSAL_LOG_INTERVAL_S:
            self._refusal_logged = now
            log.warning("refusing connections: %s (%d refused so far)", why, self.counters[counter])
        return False

    def _sweep_unauthenticated(self) -> None:
        """Close the connections still not open auth_timeout_s after they arrived (counted)."""
        loop = asyncio.get_running_loop()
        now, deadlines = loop.time(), self._auth_deadlines
        while deadlines and deadlines[0][0] <= now:
            conn = deadlines.popleft()[1]
            if conn in self.unauthenticated:
                self.counters["auth_timeouts"] += 1
                log.debug("closing connection %s: not authenticated within auth_timeout_s", conn.peer)
                if conn.host is not None:  # holding a slot silently is an offence too: else one
                    self.trust.backoff.failed(conn.host, self.clock())  # address renews its hold forever
                conn.close()
        self._auth_sweep = loop.call_at(deadlines[0][0], self._sweep_unauthenticated) if deadlines else None

    def tls_failed(self, conn: BookieProtocol, exc: BaseException) -> None:
        """A failed TLS handshake: counted, and an offence of its address (Backoff)."""
        self.counters["tls_handshake_failures"] += 1
        host = _host_of(conn.peer)
        if host is not None:
            self.trust.backoff.failed(host, self.clock())
        log.debug("TLS handshake with %s failed: %s", conn.peer, describe_tls_failure(exc, peer=str(conn.peer)))

    def auth_refused(self, conn: BookieProtocol, reason_cls: str, *, offence: bool) -> None:
        """A refused AUTH (an offence of its address: Backoff) or an op before authentication."""
        self.auth_failures[reason_cls] += 1
        host = _host_of(conn.peer)
        if offence and host is not None:
            self.trust.backoff.failed(host, self.clock())

    def maybe_reload(self) -> None:
        """Re-read the TLS files, the token keys and the roles file where they changed."""
        trust = self.trust
        if trust.tls is not None:
            trust.tls.maybe_reload()
        keys = getattr(trust.provider, "keys", None)
        if keys is not None:
            keys.maybe_reload()
        trust.authz.maybe_reload()

    def _schedule_idle_sweep(self) -> None:
        """Sweep four times per timeout, so a connection idles at most 1.25 timeouts; no
        timer while no connection is open."""
        self._idle_sweep = asyncio.get_running_loop().call_later(self.bounds.idle_timeout_s / 4, self._sweep_idle)

    def _sweep_idle(self) -> None:
        now = self.clock()
        timeout = self.bounds.idle_timeout_s
        for conn in [c for c in self.connections if is_idle(now=now, last_request=c.last_request,
                                                            timeout_s=timeout, outstanding=c.outstanding())]:
            self.counters["idle_closed"] += 1
            log.debug("closing connection %s: no request for %.0f s", conn.peer, now - conn.last_request)
            conn.close()
            self.connections.pop(conn, None)
        self._idle_sweep = None
        if self.connections:
            self._schedule_idle_sweep()

    def write_buffer_bytes(self) -> int:
        """Answers written but not yet taken by their peers, over every connection."""
        return sum(c.unread_bytes() for c in self.connections)

    def long_polls(self) -> int:
        """Long polls parked, over every connection."""
        return self._parked

    # -- backpressure ------------------------------------------------------------
    def _over_bounds(self) -> bool:
        """The journal's filling batch is full, or the write cache is over its bound (a
        checkpoint is still flushing the previous one): memory must not grow further."""
        journal = self.journal
        return (journal is not None and journal.full) or self.storage.write_cache_bytes > self.write_cache_max_bytes

    def apply_backpressure(self, conn: BookieProtocol, received: int) -> None:
        """Stop reading from a sender while the shard is over its memory bounds, unless the
        bound is only the journal's full batch (and the batch is under twice its bounds) and
        it is a light sender (BookieProtocol.light).

        Why the exception (issue 28 item 4, fair shares): a bulk writer keeps the journal's
        batch full, and every sender was paused alike, so a latency-sensitive writer's next
        add sat unread until the sync in flight returned and then joined the block after the
        one just sealed: a whole sync cycle more than the bulk writer's adds waited. Read on,
        it joins the next block. What light senders add past the batch's bound is bounded per
        connection (about 2 MiB) and in all (the batch at twice its bounds). Never past the
        write cache's bound: every staged add is in the cache, and a checkpoint that lags
        would otherwise let light senders grow it without end."""
        if not conn.transport or not self._over_bounds():
            return
        if self._journal_room():
            if conn.light(received):
                self.counters["light_senders_read_on"] += 1
                return
            if self._under_share(conn):
                self.counters["share_read_on"] += 1
                return
        conn.transport.pause_reading()
        self.paused[conn] = None

    def _journal_room(self) -> bool:
        """Only the journal is full, and under twice its bounds: light senders and those under
        their share may still be read."""
        journal = self.journal
        return (journal is not None and journal.under_twice_its_bounds
                and self.storage.write_cache_bytes <= self.write_cache_max_bytes)

    def _under_share(self, conn: BookieProtocol) -> bool:
        """Its share (issue 28 item 4): one bulk writer may fill the journal alone, but not keep
        a second one out of it. Under half of the journal's bounds, counted from the C path's
        records not yet durable, and no Python-path reply waiting (it holds bytes they do not
        count, as for light senders); the slices of the read path (_slice) make those read
        take turns."""
        journal = self.journal
        assert journal is not None
        return (conn.journal_bytes < journal.batch_bytes_max // 2
                and conn.journal_records < journal.batch_entries_max // 2 and not conn.journal_waiting)

    def release_backpressure(self) -> None:
        """Resume the paused senders once the shard is back within its bounds; while only the
        journal is full, those now under their share (their own records durable meanwhile):
        else senders under their share could keep the journal full and one paused for ever."""
        if not self.paused:
            return
        if not self._over_bounds():
            resume = list(self.paused)
        elif self._journal_room():
            resume = [conn for conn in self.paused if self._under_share(conn)]
        else:
            return
        for conn in resume:
            del self.paused[conn]
            if conn._may_read():
                conn.transport.resume_reading()  # type: ignore[union-attr]  # else resume_writing does

    # -- journal callbacks -----------------------------------------------------
    def on_durable(self, items: list[Any]) -> None:
        """A journal batch is durable: answer its adds, one write per connection.

        Add latency is observed once per run of adds that arrived in one receive buffer
        (they share an arrival time), not once per add. Items are (conn, response, arrival)
        from this module, or (conn, None, arrival, count, nbytes, record bytes) for a run of adds of the C
        add path, whose responses wait encoded in conn.pending.
        """
        per_conn: dict[BookieProtocol, list[Response]] = {}
        pending: dict[BookieProtocol, int] = {}
        now, run_t, run = self.clock(), 0.0, 0
        for item in items:
            conn, resp, t = item[0], item[1], item[2]
            if resp is None:
                if conn is not None:
                    pending[conn] = pending.get(conn, 0) + item[4]
                    conn.journal_bytes -= item[5]
                    conn.journal_records -= item[3]
                    self._add_latency.observe(now - t, item[3])
            elif conn is not None:
                conn.journal_waiting -= 1
                per_conn.setdefault(conn, []).append(resp)
                if resp[0] == _ADD:
                    if t != run_t:
                        if run:
                            self._add_latency.observe(now - run_t, run)
                        run_t, run = t, 0
                    run += 1
        if run:
            self._add_latency.observe(now - run_t, run)
        trace = self.add_trace
        if trace is not None and now >= trace.until:
            self.add_trace = trace = None  # its records stay readable until the next trace starts
        # While a trace runs, each connection's answer is stamped as its first write begins
        # (a stamp after it could come later than the peer's receipt, on another core).
        started: dict[BookieProtocol, float] | None = None if trace is None else {}
        for conn, nbytes in pending.items():
            if started is not None:
                started[conn] = self.clock()
            conn.send_pending(nbytes)
        for conn, responses in per_conn.items():
            if started is not None and conn not in started:
                started[conn] = self.clock()
            conn.send_now(responses)
        if started is not None:
            assert trace is not None and self.journal is not None
            trace.record(items, self.journal.durable_block, started)
        self.release_backpressure()

    # -- add trace -------------------------------------------------------------
    def start_add_trace(self, peers: Any, seconds: Any) -> dict[str, Any]:
        """Trace the adds of these peers (`host:port`) for `seconds` (bookkeeper/bookie/add_trace.py),
        replacing a trace running; ValueError on bad arguments, before anything changes."""
        names, s = parse_peers(peers), parse_seconds(seconds)
        self.add_trace = self._last_trace = AddTrace(names, self.clock() + s)
        return {"peers": sorted(names), "seconds": s}

    def add_trace_report(self, start: int = 0, limit: int = REPORT_PAGE) -> dict[str, Any]:
        """A page of the running (or last) trace's records (AddTrace.report); empty when none
        was started."""
        if self._last_trace is None:
            return {"fields": [], "records": [], "next": 0, "end": 0, "dropped": 0, "peers": [], "remaining_s": 0.0}
        return self._last_trace.report(self.clock(), start, limit)

    def on_failed(self, items: list[Any], err: OSError) -> None:
        per_conn: dict[BookieProtocol, list[Response]] = {}
        pending: dict[BookieProtocol, int] = {}
        for item in items:
            conn, resp = item[0], item[1]
            if conn is None:
                continue
            if resp is None:
                self.counters["add_errors"] += item[3]
                pending[conn] = pending.get(conn, 0) + item[4]
                conn.journal_bytes -= item[5]
                conn.journal_records -= item[3]
            else:
                conn.journal_waiting -= 1
                self.counters["add_errors"] += resp[0] == _ADD
                per_conn.setdefault(conn, []).append(
                    (resp[0], Status.SERVER_ERROR, resp[2], resp[3], resp[4], -1, b""))
        for conn, nbytes in pending.items():
            conn.send_pending(nbytes, failed=True)
        for conn, responses in per_conn.items():
            conn.send_now(responses)
        self.release_backpressure()  # paused senders get their errors, not a stall

    # -- dispatch --------------------------------------------------------------
    def dispatch(self, conn: BookieProtocol, frame: tuple[Any, ...]) -> None:
        """A request the C add path did not take; held while its peer does not read answers."""
        if conn.writing_paused or conn.held:
            conn.held.append(frame)
            return
        self.handle(conn, frame)

    def handle(self, conn: BookieProtocol, frame: tuple[Any, ...]) -> None:
        op, flags, req_id, ledger_id, entry_id, key, aux, payload, blob_lac = frame
        self.counters[op] += 1
        if conn.roles is not ALL_ROLES:  # authorization, before storage is touched
            role = required_role(op, flags)
            if role is not None and role not in conn.roles and conn.forbidden(frame, role):
                if op == _ADD:
                    self.counters["add_errors"] += 1
                return
        try:
            if op == _ADD:
                self._add(conn, flags, req_id, ledger_id, entry_id, key, payload, blob_lac)
            elif op == _READ:
                if flags & _LONG_POLL:
                    self._read(conn, flags, req_id, ledger_id, entry_id, key, aux)
                else:
                    t0 = self.clock()
                    self._read(conn, flags, req_id, ledger_id, entry_id, key, aux)
                    self._read_latency.observe(self.clock() - t0)
            elif op == _READ_LAC:
                self._read_lac(conn, flags, req_id, ledger_id, key)
            elif op == _WRITE_LAC:
                self._write_lac(conn, req_id, ledger_id, entry_id, key)
            elif op == _INFO:
                usage = shutil.disk_usage(self.data_dir)
                conn.respond((op, Status.OK, req_id, 0, 0, -1,
                              BOOKIE_INFO.pack(usage.free, usage.total, self.shard_index, self.shards)))
            elif op == _WHOAMI:
                conn.respond((op, Status.OK, req_id, ledger_id, entry_id, -1, conn.whoami()))
            elif op == _AUTH:
                conn.auth_round(frame)  # a renewal on the open connection
            elif op == _START_TLS:
                conn.start_tls(frame)
            else:
                conn.respond((op, Status.UNKNOWN_OP, req_id, ledger_id, entry_id, -1, b""))
        except Exception:  # a bug must cost one request, never the shard
            log.exception("request op=%s ledger=%s entry=%s failed", op, ledger_id, entry_id)
            conn.respond((op, Status.SERVER_ERROR, req_id, ledger_id, entry_id, -1, b""))

    def _wrong_shard(self, ledger_id: int) -> bool:
        """Not ours to serve: another shard's ledger, or an id no ledger can have."""
        return ledger_id > MAX_LEDGER_ID or shard_for_ledger(ledger_id, self.shards) != self.shard_index

    def _add(self, conn: BookieProtocol, flags: int, req_id: int, ledger_id: int, entry_id: int,
             key: bytes, payload: bytes, blob_lac: int) -> None:
        """An add the C path did not take (the first of a ledger, or one it does not answer OK):
        decided by bookie.core.decide_add, applied here."""
        st = self.storage.ledgers.get(ledger_id)
        header_matches = False
        if len(payload) >= ENTRY_HEADER_BYTES:
            blob_ledger, blob_entry, _, _ = entry_header(payload)
            header_matches = blob_ledger == ledger_id and blob_entry == entry_id
        decision = decide_add(readonly=self.readonly, known=st is not None,
                              owned=st is not None or not self._wrong_shard(ledger_id), entry_id=entry_id,
                              payload_len=len(payload), header_matches=header_matches, key_given=key != NO_KEY,
                              key_matches=self._key_matches(st, key),
                              fenced=st is not None and st.fenced, recovery=bool(flags & _RECOVERY_ADD),
                              tombstoned=st is None and ledger_id in self.storage.tombstones)
        if decision.status != _OK:
            self.counters["add_errors"] += 1
            conn.respond((_ADD, decision.status, req_id, ledger_id, entry_id, -1, b""))
            return
        if decision.create:
            st = self._new_ledger(ledger_id, key)
        assert st is not None
        self.storage.put_entry(ledger_id, entry_id, payload, blob_lac)
        if self._waiters and ledger_id in self._waiters:
            self._to_wake.add(ledger_id)  # its LAC or its entries moved: see wake_parked
        self._journal_reply(conn, REC_ADD, ledger_id, entry_id, payload,
                            (_ADD, _OK, req_id, ledger_id, entry_id, st.lac, b""))

    def _journal_reply(self, conn: BookieProtocol, rtype: int, ledger_id: int, entry_id: int, data: bytes,
                       resp: Response) -> None:
        """Journal a record whose reply waits for it to be durable (the Python path: an add
        the C path did not take, a fence), counted on the connection until it is answered
        (apply_backpressure's light senders have none waiting)."""
        conn.journal_waiting += 1
        self.journal.append(rtype, ledger_id, entry_id, data, (conn, resp, self.now))  # type: ignore[union-attr]

    def _new_ledger(self, ledger_id: int, key: bytes) -> LedgerState:
        """First sight of a ledger on this shard: its state, and its master key journaled."""
        st = self.storage.create_ledger(ledger_id, key)
        self.journal.append(REC_MASTER_KEY, ledger_id, -1, key, _NO_REPLY, first=True)  # type: ignore[union-attr]
        return st

    def _key_matches(self, st: LedgerState | None, key: bytes) -> bool:
        """Whether a request's key is the ledger's (compared in constant time)."""
        return st is not None and key != NO_KEY and hmac.compare_digest(st.master_key, key)

    def _fence(self, ledger_id: int, st: LedgerState | None, key: bytes, create: bool) -> LedgerState:
        """Apply a fence decided by bookie.core.decide_fence: the ledger's state (made with the
        key if this shard never saw it) marked fenced. The caller journals a REC_FENCE record
        carrying its reply, so the reply leaves only once the fence is durable."""
        if create:
            st = self._new_ledger(ledger_id, key)
        assert st is not None
        st.fenced = True
        return st

    def _read(self, conn: BookieProtocol, flags: int, req_id: int, ledger_id: int, entry_id: int,
              key: bytes, aux: int) -> None:
        """A READ_ENTRY, decided by bookie.core.decide_read, applied here."""
        op = Op.READ_ENTRY
        st = self.storage.ledger(ledger_id)
        owned, fence = not self._wrong_shard(ledger_id), bool(flags & _FENCE)
        if fence and owned:
            self.counters["fence"] += 1
        decision = decide_read(owned=owned, fence=fence,
                               long_poll=bool(flags & _LONG_POLL), entry_id=entry_id, known=st is not None,
                               key_given=key != NO_KEY, key_matches=fence and self._key_matches(st, key),
                               covered=st is not None and st.lac >= entry_id, parked=len(conn.polls),
                               cap=self.bounds.max_long_polls_per_connection)
        action = decision.action
        if action is ReadAction.REFUSE:
            if decision.poll_refused:
                self.counters["long_polls_refused"] += 1
            lac = st.lac if st is not None and decision.status == Status.NO_SUCH_ENTRY else -1
            return conn.respond((op, decision.status, req_id, ledger_id, entry_id, lac, b""))
        if action is ReadAction.PARK:
            return self._park(conn, req_id, ledger_id, entry_id, min(aux, LONG_POLL_MAX_MS))
        if action is ReadAction.FENCE:
            st = self._fence(ledger_id, st, key, decision.create)
            assert self.journal is not None
            data = self.storage.get_entry(ledger_id, entry_id) if entry_id >= 0 else None
            status = Status.OK if data is not None else Status.NO_SUCH_ENTRY
            self._journal_reply(conn, REC_FENCE, ledger_id, -1, b"",
                                (op, status, req_id, ledger_id, entry_id, st.lac, data or b""))
            return None
        assert st is not None
        if flags & _LONG_POLL and entry_id >= 0:
            return conn.respond(self._covered(ledger_id, entry_id, st.lac, req_id))
        data = self.storage.get_entry(ledger_id, entry_id) if entry_id >= 0 else None
        if data is None:
            return conn.respond((op, Status.NO_SUCH_ENTRY, req_id, ledger_id, entry_id, st.lac, b""))
        return conn.respond((op, Status.OK, req_id, ledger_id, entry_id, st.lac, data))

    def _read_lac(self, conn: BookieProtocol, flags: int, req_id: int, ledger_id: int, key: bytes) -> None:
        """A READ_LAC, decided by bookie.core.decide_read_lac, applied here."""
        op = Op.READ_LAC
        st = self.storage.ledger(ledger_id)
        owned, fence = not self._wrong_shard(ledger_id), bool(flags & _FENCE)
        if fence and owned:
            self.counters["fence"] += 1
        decision = decide_read_lac(owned=owned, fence=fence, known=st is not None,
                                   key_given=key != NO_KEY, key_matches=fence and self._key_matches(st, key))
        if decision.action is ReadAction.REFUSE:
            return conn.respond((op, decision.status, req_id, ledger_id, -1, -1, b""))
        if decision.action is ReadAction.FENCE:
            st = self._fence(ledger_id, st, key, decision.create)
            assert self.journal is not None
            last = self.storage.last_entry_id(ledger_id)
            self._journal_reply(conn, REC_FENCE, ledger_id, -1, b"",
                                (op, Status.OK, req_id, ledger_id, last, st.lac, b""))
            return None
        assert st is not None
        return conn.respond((op, Status.OK, req_id, ledger_id, self.storage.last_entry_id(ledger_id), st.lac, b""))

    def _write_lac(self, conn: BookieProtocol, req_id: int, ledger_id: int, lac: int, key: bytes) -> None:
        """An idle writer's LAC (explicit LAC), decided by bookie.core.decide_write_lac: raises
        this shard's LAC of the ledger, never lowers it.

        Why not journaled: it is advisory. The LAC only ever covers entries an ack quorum
        stored durably, so a LAC lost in a restart costs a tailer a later wake-up, never an
        entry; the piggybacked LAC of the entries themselves is what storage keeps.
        """
        op = Op.WRITE_LAC
        st = self.storage.ledger(ledger_id)
        status = decide_write_lac(owned=not self._wrong_shard(ledger_id), lac=lac, known=st is not None,
                                  key_given=key != NO_KEY, key_matches=self._key_matches(st, key),
                                  fenced=st is not None and st.fenced)
        if status == Status.OK:
            assert st is not None
            if lac > st.lac:
                st.lac = lac
                if ledger_id in self._waiters:
                    self._to_wake.add(ledger_id)  # answered after this receive buffer: wake_parked
        shown = -1 if st is None or status in (Status.BAD_REQUEST, Status.NO_SUCH_LEDGER) else st.lac
        conn.respond((op, status, req_id, ledger_id, lac, shown, b""))

    # -- long poll -------------------------------------------------------------
    def _park(self, conn: BookieProtocol, req_id: int, ledger_id: int, entry_id: int, timeout_ms: int) -> None:
        """Park a long poll: one tuple, in its ledger's waiters and in its deadline's bucket.

        Why no timer per poll: an asyncio TimerHandle (its callback, its arguments tuple,
        its place in the loop's heap) was most of a parked poll's 0.9 KiB. Deadlines are
        bucketed by POLL_TICK_S, the buckets' keys kept in a heap, and one timer answers
        the due buckets (docs/protocol.md, Bounds)."""
        tick = math.ceil((asyncio.get_running_loop().time() + timeout_ms / 1000.0) / POLL_TICK_S)
        poll = (entry_id, conn, req_id, next(self._poll_numbers), ledger_id)
        bucket = self._buckets.get(tick)
        if bucket is None:
            bucket = self._buckets[tick] = []
            heapq.heappush(self._ticks, tick)
            if tick < self._sweep_tick:
                self._schedule_expiry(tick)
        bucket.append(poll)
        self._parked += 1
        self._waiters.setdefault(ledger_id, []).append(poll)
        conn.polls[poll[3]] = ledger_id

    def _schedule_expiry(self, tick: int) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._sweep_tick = tick
        self._expiry = asyncio.get_running_loop().call_at(tick * POLL_TICK_S, self._expire_due)

    def _retire(self, ledger_id: int, number: int) -> None:
        """Mark a parked poll gone; rebuild its ledger's list once half of it is gone."""
        gone = self._gone.setdefault(ledger_id, set())
        gone.add(number)
        waiters = self._waiters.get(ledger_id, [])
        if 2 * len(gone) >= len(waiters):
            keep = [w for w in waiters if w[3] not in gone]
            if keep:
                self._waiters[ledger_id] = keep
            else:
                self._waiters.pop(ledger_id, None)
            del self._gone[ledger_id]

    def _expire_due(self) -> None:
        """Answer every parked poll whose time ran out with the current state (its ledger
        may be gone by now); polls answered or dropped since they parked are skipped."""
        self._expiry, self._sweep_tick = None, NEVER
        ticks, now = self._ticks, asyncio.get_running_loop().time()
        while ticks and ticks[0] * POLL_TICK_S <= now:
            for entry_id, conn, req_id, number, ledger_id in self._buckets.pop(heapq.heappop(ticks)):
                if conn.polls.pop(number, None) is None:
                    self._dead_polls -= 1
                    continue
                self._parked -= 1
                self._retire(ledger_id, number)
                st = self.storage.ledger(ledger_id)
                conn.send_now([(_READ, Status.NO_SUCH_ENTRY if st else Status.NO_SUCH_LEDGER, req_id,
                                ledger_id, entry_id, st.lac if st else -1, b"")])
        if ticks:
            self._schedule_expiry(ticks[0])

    def _poll_gone(self, n: int) -> None:
        """n live polls left before their deadline (answered, or their connection
        closed); the buckets are rebuilt once half of what they hold is such leftovers, so a
        peer that parks, closes and reconnects cannot grow them for the polls' whole time."""
        self._parked -= n
        self._dead_polls += n
        if self._dead_polls > self.long_polls():
            for tick, bucket in self._buckets.items():
                self._buckets[tick] = [p for p in bucket if p[3] in p[1].polls]
            self._dead_polls = 0

    def forget_waiters(self, conn: BookieProtocol) -> None:
        """Drop a closed connection's long polls at once."""
        polls, conn.polls = conn.polls, {}
        for number, ledger_id in polls.items():
            self._retire(ledger_id, number)
        if polls:
            self._poll_gone(len(polls))

    def _covered(self, ledger_id: int, entry_id: int, lac: int, req_id: int) -> Response:
        """The answer to a long poll whose entry this shard's LAC covers: the entry if stored
        here, else NO_SUCH_ENTRY with the LAC. Why answer without the entry: the tailer polls
        every bookie of the ensemble, and a bookie outside the entry's write set (or one that
        missed it) may be the one the writer told its LAC; the tailer then reads the entry
        from its write set (Apache BookKeeper's long poll likewise returns on a LAC past the
        previous one, with the entry only if the bookie has it)."""
        data = self.storage.get_entry(ledger_id, entry_id)
        if data is None:
            return (_READ, Status.NO_SUCH_ENTRY, req_id, ledger_id, entry_id, lac, b"")
        return (_READ, Status.OK, req_id, ledger_id, entry_id, lac, data)

    def wake_parked(self) -> None:
        """Answer the parked long polls that the adds of one receive buffer made answerable.

        Why at arrival, not once the add is durable: the LAC an add carries says entries up
        to it are acknowledged (durable on an ack quorum), which is all a long poll needs;
        waiting for this bookie's own sync of the carrying add would only add a sync to
        every tailer's latency. Once per ledger per receive buffer.
        """
        to_wake, self._to_wake = self._to_wake, set()
        for ledger_id in to_wake:
            self._wake(ledger_id)

    def _wake(self, ledger_id: int) -> None:
        """Answer the long polls of a ledger whose entries the LAC now covers."""
        waiters = self._waiters.get(ledger_id)
        st = self.storage.ledger(ledger_id)
        if not waiters or st is None:
            return
        gone = self._gone.pop(ledger_id, ())
        keep = []
        answered = 0
        for w in waiters:
            entry_id, conn, req_id, number, _ledger = w
            if number in gone:
                continue
            if entry_id > st.lac:
                keep.append(w)
                continue
            del conn.polls[number]
            answered += 1
            conn.send_now([self._covered(ledger_id, entry_id, st.lac, req_id)])
        if keep:
            self._waiters[ledger_id] = keep
        else:
            del self._waiters[ledger_id]
        if answered:
            self._poll_gone(answered)
