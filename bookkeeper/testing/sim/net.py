"""A simulated TCP network: connections between named nodes that carry real bytes.

What TCP gives and the simulation keeps: each direction of a connection delivers its bytes
in order, exactly once, until the connection dies; a write arrives as one or more packets
split at any byte, each after a seeded delay. What it may do and the simulation does:
delay a direction (a partition holds packets, as retransmission would, until it heals or
the connection is reset), reset a connection (both sides see it lost; bytes in flight
either way are gone), refuse a connection to a node that is down, black-hole a connect
(a SYN to a partitioned node: the caller's own timeout ends the wait). Connections are
independent, so frames on two connections reorder freely.

The protocols on each end are the production ones (the client's `_ShardProtocol`, a
`BufferedProtocol` over `RequestPipe`; the bookie's `BookieProtocol`), so frames are parsed
by the production parsers, split wherever the seed splits them.

Which node a connect comes from is the context variable `NODE`: the simulator runs each
node's tasks in a context naming it (asyncio copies the context into every task and
callback made from there), and delivers each packet in the receiving node's context.
"""
from __future__ import annotations

import asyncio
import contextvars
import random
from collections import deque
from collections.abc import Callable
from typing import Any

NODE: contextvars.ContextVar[str] = contextvars.ContextVar("sim_node", default="?")


class Link:
    """The path from node a to node b: whether packets pass (a partition holds them), and
    since when they are held."""

    __slots__ = ("held", "since")

    def __init__(self) -> None:
        self.held = False
        self.since = 0.0


class SimTransport(asyncio.Transport):
    """One end of a simulated connection."""

    def __init__(self, net: SimNetwork, node: str, peer_node: str, ctx: contextvars.Context,
                 local: tuple[str, int], remote: tuple[str, int]) -> None:
        super().__init__()
        self.net = net
        self.node, self.peer_node = node, peer_node
        self.ctx = ctx
        self.local, self.remote = local, remote
        self.peer: SimTransport | None = None
        self.protocol: asyncio.BaseProtocol | None = None
        self.reading = True
        self.closing = False
        self.dead = False
        self.inbox: deque[bytes] = deque()  # arrived while reading was paused
        self.in_flight: deque[bytes] = deque()  # sent to the peer, not arrived (held by a partition, or delayed)
        self.arrival = 0.0  # when this direction's last packet arrives (order is kept)
        self.high = 64 << 10

    # -- asyncio.Transport ----------------------------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.closing or self.dead or not data:
            return
        self.net.send(self, bytes(data))

    def writelines(self, chunks: Any) -> None:
        for c in chunks:
            self.write(c)

    def can_write_eof(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.high = high or self.high

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (self.high // 4, self.high)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        if not self.reading and not self.dead:
            self.reading = True
            self.net.loop.call_soon(self._drain_inbox, context=self.ctx)

    def is_reading(self) -> bool:
        return self.reading

    def is_closing(self) -> bool:
        return self.closing or self.dead

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": self.remote, "sockname": self.local}.get(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self.protocol is not None
        return self.protocol

    def close(self) -> None:
        """FIN: the peer sees the end after the bytes already sent; this end at once."""
        if self.closing or self.dead:
            return
        self.closing = True
        self.net.fin(self)
        self.net.loop.call_soon(self._lost, None, context=self.ctx)

    def abort(self) -> None:
        self.net.reset(self)

    # -- delivery ---------------------------------------------------------------
    def deliver(self, data: bytes) -> None:
        if self.dead:
            return
        if not self.reading or self.inbox:
            self.inbox.append(data)
            return
        self._feed(data)

    def _drain_inbox(self) -> None:
        while self.inbox and self.reading and not self.dead:
            self._feed(self.inbox.popleft())
        if not self.inbox and self.closing and self.peer is not None and self.peer.closing:
            self._lost(None)

    def _feed(self, data: bytes) -> None:
        proto = self.protocol
        if isinstance(proto, asyncio.BufferedProtocol):
            view = memoryview(data)
            while view and not self.dead:
                if not self.reading:  # paused mid-packet: the rest waits, first in line
                    self.inbox.appendleft(bytes(view))
                    return
                buf = memoryview(proto.get_buffer(len(view)))
                n = min(len(buf), len(view))
                buf[:n] = view[:n]
                proto.buffer_updated(n)
                view = view[n:]
        elif proto is not None:
            proto.data_received(data)  # type: ignore[attr-defined]

    def _lost(self, exc: Exception | None) -> None:
        if self.dead:
            return
        self.dead = True
        self.inbox.clear()
        if self.protocol is not None:
            self.protocol.connection_lost(exc)


class SimNetwork:
    """Listeners by address, connections between nodes, and the faults between them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rng: random.Random, *,
                 latency_s: tuple[float, float] = (50e-6, 400e-6), split: float = 0.3) -> None:
        self.loop = loop
        self.rng = rng
        self.latency_s = latency_s
        self.split = split  # chance that a write is cut into more than one packet
        self.listeners: dict[tuple[str, int], tuple[str, contextvars.Context, Callable[[], asyncio.BaseProtocol]]] = {}
        self.links: dict[tuple[str, str], Link] = {}
        self.transports: list[SimTransport] = []
        self.stats = {"packets": 0, "bytes": 0, "resets": 0, "refused": 0}

    def link(self, a: str, b: str) -> Link:
        lk = self.links.get((a, b))
        if lk is None:
            lk = self.links[(a, b)] = Link()
        return lk

    def listen(self, node: str, host: str, port: int, factory: Callable[[], asyncio.BaseProtocol]) -> None:
        self.listeners[(host, port)] = (node, contextvars.copy_context(), factory)

    def unlisten(self, host: str, port: int) -> None:
        self.listeners.pop((host, port), None)

    async def connect(self, factory: Callable[[], asyncio.BaseProtocol], host: str,
                      port: int) -> tuple[SimTransport, asyncio.BaseProtocol]:
        """The client side of a TCP connect from the current node (NODE)."""
        src = NODE.get()
        await asyncio.sleep(self._delay())
        target = self.listeners.get((host, port))
        if target is None:
            self.stats["refused"] += 1
            raise ConnectionRefusedError(f"{host}:{port} refused")
        dst, dst_ctx, server_factory = target
        if self.link(src, dst).held or self.link(dst, src).held:
            await asyncio.Event().wait()  # a SYN into a partition: the caller's timeout ends this
        client = SimTransport(self, src, dst, contextvars.copy_context(), (src, 40000), (host, port))
        server = SimTransport(self, dst, src, dst_ctx, (host, port), (src, 40000))
        client.peer, server.peer = server, client
        self.transports.extend((client, server))
        if len(self.transports) > 4096:
            self.transports = [t for t in self.transports if not t.dead]
        proto = factory()
        client.protocol = proto
        server.protocol = dst_ctx.run(server_factory)
        dst_ctx.run(server.protocol.connection_made, server)
        proto.connection_made(client)
        return client, proto

    def _delay(self) -> float:
        lo, hi = self.latency_s
        return self.rng.uniform(lo, hi)

    def send(self, t: SimTransport, data: bytes) -> None:
        """Cut data into packets and schedule each one's arrival after the previous one's."""
        peer = t.peer
        if peer is None:
            return
        cuts = []
        if len(data) > 1 and self.rng.random() < self.split:
            cuts = sorted(self.rng.sample(range(1, len(data)), min(len(data) - 1, self.rng.randint(1, 3))))
        start = 0
        for end in [*cuts, len(data)]:
            self._packet(t, data[start:end])
            start = end

    def _packet(self, t: SimTransport, data: bytes) -> None:
        self.stats["packets"] += 1
        self.stats["bytes"] += len(data)
        t.in_flight.append(data)
        if self.link(t.node, t.peer_node).held:
            return  # retransmitted once the partition heals (release), or lost with a reset
        self._schedule(t)

    def _schedule(self, t: SimTransport) -> None:
        t.arrival = max(t.arrival, self.loop.time()) + self._delay()
        self.loop.call_at(t.arrival, self._arrive, t, context=t.peer.ctx if t.peer else None)

    def _arrive(self, t: SimTransport) -> None:
        if not t.in_flight or t.peer is None:
            return
        if self.link(t.node, t.peer_node).held:
            return
        t.peer.deliver(t.in_flight.popleft())

    def fin(self, t: SimTransport) -> None:
        """The peer sees end of stream after what t sent (a graceful close)."""
        peer = t.peer
        if peer is None:
            return
        t.arrival = max(t.arrival, self.loop.time()) + self._delay()

        def end() -> None:
            if peer.dead:
                return
            if t.in_flight:  # still held: a partition between them; the close waits with the bytes
                self.loop.call_later(0.05, end, context=peer.ctx)
                return
            peer.closing = True
            if not peer.inbox:
                peer._lost(None)
        self.loop.call_at(t.arrival, end, context=peer.ctx)

    def reset(self, t: SimTransport) -> None:
        """RST: both ends lose the connection now; bytes in flight either way are gone."""
        peer = t.peer
        self.stats["resets"] += 1
        for side in (t, peer):
            if side is None or side.dead:
                continue
            side.in_flight.clear()
            side.inbox.clear()
            side.closing = True
            exc = None if side is t else ConnectionResetError("connection reset by peer")
            self.loop.call_soon(side._lost, exc, context=side.ctx)

    # -- faults -------------------------------------------------------------------
    def hold(self, a: str, b: str) -> None:
        """Packets from a to b stop arriving (both ways: call twice); connections stay up."""
        link = self.link(a, b)
        if not link.held:
            link.held, link.since = True, self.loop.time()

    def release(self, a: str, b: str) -> None:
        """Held packets from a to b arrive, in order, and new ones flow again."""
        self.link(a, b).held = False
        for t in self.transports:  # a sender closed meanwhile still delivers what it sent
            if t.node == a and t.peer_node == b and t.peer is not None and not t.peer.dead:
                for _ in range(len(t.in_flight)):
                    self._schedule(t)

    def reset_between(self, a: str, b: str) -> int:
        """Reset every live connection between a and b; how many."""
        n = 0
        for t in list(self.transports):
            if not t.dead and not t.closing and {t.node, t.peer_node} == {a, b} and t.node == a:
                self.reset(t)
                n += 1
        return n

    def crash(self, node: str) -> None:
        """A node's process dies: its listeners go, its connections are reset."""
        for addr in [a for a, (n, _, _) in self.listeners.items() if n == node]:
            del self.listeners[addr]
        for t in list(self.transports):
            if t.node == node and not t.dead:
                self.reset(t)
