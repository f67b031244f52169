"""ZooKeeper at the znode level, for the simulator: one ensemble's data tree and sessions,
with a kazoo-compatible client (the calls and recipes bookkeeper.meta uses), so
`ZkMetadataStore` runs unchanged over it.

Kept from ZooKeeper: versions and compare-and-set, multi (all or nothing, kazoo's result
list with `RolledBackError` for the rest), ephemeral nodes owned by a session and removed
with it, sequential nodes (a per-parent counter, ten digits), one-shot watches (data,
exists, children) fired after the change, `DataWatch`/`ChildrenWatch` recipes that re-arm,
session state listeners. Faults, drawn from the simulation's seed: a call refused with
`ConnectionLoss` before it reaches the server, a write applied whose reply is lost (the
caller sees `ConnectionLoss` and must find out what happened), a partition between a
node and ZooKeeper (every call `ConnectionLoss`), session expiry (ephemerals gone,
listeners told LOST, then a new session CONNECTED, as kazoo reconnects).

Calls are synchronous, as kazoo's are: the simulator's event loop runs `run_in_executor`
jobs after a virtual delay, which is where a ZooKeeper round trip takes its time.
Left out: ACLs and authentication (the simulated cluster has no credentials), the
ZooKeeper servers themselves (no leader election, no stale follower reads).
"""
from __future__ import annotations

import asyncio
import contextvars
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kazoo.exceptions import (BadVersionError, ConnectionLoss, NoNodeError, NodeExistsError, NotEmptyError,
                              RolledBackError, SessionExpiredError)
from kazoo.protocol.states import EventType, KazooState, KeeperState, WatchedEvent, ZnodeStat


_Watch = tuple[Callable[[WatchedEvent], None], contextvars.Context]


@dataclass
class _Node:
    data: bytes
    czxid: int
    mzxid: int
    version: int = 0
    cversion: int = 0
    pzxid: int = 0
    owner: int = 0  # session id of an ephemeral node's creator, else 0
    children: set[str] = field(default_factory=set)
    seq: int = 0  # next sequential suffix under this node


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] or "/"


class SimZooKeeper:
    """The ensemble: the tree, the zxid, sessions and watches (loop thread only)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rng: random.Random, *, loss_rate: float = 0.0,
                 reply_loss_rate: float = 0.0) -> None:
        self.loop = loop
        self.rng = rng
        self.loss_rate = loss_rate
        self.reply_loss_rate = reply_loss_rate
        self.zxid = 1
        self.nodes: dict[str, _Node] = {"/": _Node(b"", 0, 0)}
        self.sessions: dict[int, SimKazooClient] = {}
        self._next_session = 0x1000
        # path -> (watch, the context it was set in: it fires there, as the setting node's
        # client would run it; a paused node's watches wait for it)
        self.data_watches: dict[str, list[_Watch]] = {}
        self.child_watches: dict[str, list[_Watch]] = {}
        self.stats = {"calls": 0, "writes": 0, "lost_requests": 0, "lost_replies": 0, "expiries": 0}
        self.last_trouble: dict[str, float] = {}  # node -> when a call of its last failed (ConnectionLoss)
        # on_write(path, data, node) after each set applied: the simulator's hook for faults
        # placed at a moment that matters (a recovery's own ensemble change)
        self.on_write: Callable[[str, bytes, str], None] = lambda _p, _d, _n: None

    def client(self, node: str, partitioned: Callable[[str], bool]) -> SimKazooClient:
        return SimKazooClient(self, node, partitioned)

    def new_session(self, client: SimKazooClient) -> int:
        self._next_session += 1
        self.sessions[self._next_session] = client
        return self._next_session

    def end_session(self, sid: int) -> None:
        self.sessions.pop(sid, None)
        for path in sorted([p for p, n in self.nodes.items() if n.owner == sid], reverse=True):
            if path in self.nodes and not self.nodes[path].children:
                self._delete(path)

    # -- the tree ----------------------------------------------------------------
    def _stat(self, n: _Node) -> ZnodeStat:
        return ZnodeStat(n.czxid, n.mzxid, 0, 0, n.version, n.cversion, 0, n.owner, len(n.data), len(n.children),
                         n.pzxid)

    def _fire(self, table: dict[str, list[_Watch]], path: str, kind: str) -> None:
        for fn, ctx in table.pop(path, []):
            self.loop.call_soon(fn, WatchedEvent(kind, KeeperState.CONNECTED, path), context=ctx)

    def _create(self, path: str, value: bytes, owner: int, sequence: bool) -> str:
        parent = _parent(path)
        p = self.nodes.get(parent)
        if p is None:
            raise NoNodeError(parent)
        if p.owner:
            raise NodeExistsError("ephemeral parent")  # ZooKeeper: NoChildrenForEphemerals
        if sequence:
            path = f"{path}{p.seq:010d}"
            p.seq += 1
        if path in self.nodes:
            raise NodeExistsError(path)
        self.zxid += 1
        self.nodes[path] = _Node(bytes(value), self.zxid, self.zxid, owner=owner, pzxid=self.zxid)
        p.children.add(path.rsplit("/", 1)[1])
        p.cversion += 1
        p.pzxid = self.zxid
        self._fire(self.data_watches, path, EventType.CREATED)
        self._fire(self.child_watches, parent, EventType.CHILD)
        return path

    def _delete(self, path: str, version: int = -1) -> None:
        n = self.nodes.get(path)
        if n is None:
            raise NoNodeError(path)
        if version != -1 and n.version != version:
            raise BadVersionError(path)
        if n.children:
            raise NotEmptyError(path)
        self.zxid += 1
        del self.nodes[path]
        p = self.nodes[_parent(path)]
        p.children.discard(path.rsplit("/", 1)[1])
        p.cversion += 1
        p.pzxid = self.zxid
        self._fire(self.data_watches, path, EventType.DELETED)
        self._fire(self.child_watches, path, EventType.DELETED)
        self._fire(self.child_watches, _parent(path), EventType.CHILD)

    def _set(self, path: str, value: bytes, version: int = -1) -> ZnodeStat:
        n = self.nodes.get(path)
        if n is None:
            raise NoNodeError(path)
        if version != -1 and n.version != version:
            raise BadVersionError(path)
        self.zxid += 1
        n.data = bytes(value)
        n.version += 1
        n.mzxid = self.zxid
        self._fire(self.data_watches, path, EventType.CHANGED)
        return self._stat(n)

    def _check(self, path: str, version: int) -> None:
        n = self.nodes.get(path)
        if n is None:
            raise NoNodeError(path)
        if n.version != version:
            raise BadVersionError(path)


class SimKazooClient:
    """One node's session: the subset of KazooClient that bookkeeper.meta calls."""

    def __init__(self, zk: SimZooKeeper, node: str, partitioned: Callable[[str], bool]) -> None:
        self.zk = zk
        self.node = node
        self._partitioned = partitioned
        self.default_acl: Any = None
        self._listeners: list[tuple[Callable[[Any], Any], contextvars.Context]] = []
        self.session = zk.new_session(self)
        self.closed = False

    # -- session ---------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return not self.closed and not self._partitioned(self.node)

    @property
    def client_id(self) -> tuple[int, bytes]:
        return (self.session, b"")

    def add_listener(self, fn: Callable[[Any], Any]) -> None:
        self._listeners.append((fn, contextvars.copy_context()))

    def remove_listener(self, fn: Callable[[Any], Any]) -> None:
        self._listeners = [(f, ctx) for f, ctx in self._listeners if f is not fn]

    def expire(self) -> None:
        """The session expires (its ephemerals go); kazoo tells LOST, reconnects, tells CONNECTED."""
        self.zk.stats["expiries"] += 1
        self.zk.end_session(self.session)
        self.session = self.zk.new_session(self)
        for state in (KazooState.LOST, KazooState.CONNECTED):
            for fn, ctx in list(self._listeners):
                self.zk.loop.call_soon(self._tell, fn, state, context=ctx)

    def _tell(self, fn: Callable[[Any], Any], state: Any) -> None:
        if fn(state) is True:
            self.remove_listener(fn)

    def start(self, timeout: float = 0.0) -> None:
        pass

    def stop(self) -> None:
        if not self.closed:
            self.closed = True
            self.zk.end_session(self.session)

    def close(self) -> None:
        pass

    # -- calls -----------------------------------------------------------------
    def _call(self, write: bool) -> None:
        """Refuse the call as ZooKeeper trouble would (before it reaches the ensemble)."""
        self.zk.stats["calls"] += 1
        if self.closed:
            raise SessionExpiredError("session closed")
        if self._partitioned(self.node):
            self.zk.last_trouble[self.node] = self.zk.loop.time()
            raise ConnectionLoss("partitioned from ZooKeeper")
        if self.zk.loss_rate and self.zk.rng.random() < self.zk.loss_rate:
            self.zk.stats["lost_requests"] += 1
            self.zk.last_trouble[self.node] = self.zk.loop.time()
            raise ConnectionLoss("request lost")
        if write:
            self.zk.stats["writes"] += 1

    def _reply(self) -> None:
        """After a write was applied: its reply may be lost (the caller sees ConnectionLoss)."""
        if self.zk.reply_loss_rate and self.zk.rng.random() < self.zk.reply_loss_rate:
            self.zk.stats["lost_replies"] += 1
            self.zk.last_trouble[self.node] = self.zk.loop.time()
            raise ConnectionLoss("reply lost (the write was applied)")

    def create(self, path: str, value: bytes = b"", acl: Any = None, ephemeral: bool = False,
               sequence: bool = False, makepath: bool = False, include_data: bool = False) -> Any:
        self._call(True)
        if makepath:
            self._ensure(_parent(path))
        made = self.zk._create(path, value, self.session if ephemeral else 0, sequence)
        self._reply()
        return (made, self.zk._stat(self.zk.nodes[made])) if include_data else made

    def _ensure(self, path: str) -> None:
        parts = [p for p in path.split("/") if p]
        for i in range(1, len(parts) + 1):
            sub = "/" + "/".join(parts[:i])
            if sub not in self.zk.nodes:
                self.zk._create(sub, b"", 0, False)

    def ensure_path(self, path: str, acl: Any = None) -> bool:
        self._call(True)
        self._ensure(path)
        return True

    def exists(self, path: str, watch: Callable[[WatchedEvent], None] | None = None) -> ZnodeStat | None:
        self._call(False)
        n = self.zk.nodes.get(path)
        if watch is not None:
            self.zk.data_watches.setdefault(path, []).append((watch, contextvars.copy_context()))
        return None if n is None else self.zk._stat(n)

    def _read(self, path: str, watch: Callable[[WatchedEvent], None] | None,
              watches: dict[str, list[_Watch]]) -> _Node:
        """A read of an existing node, leaving `watch` in `watches` (data or children)."""
        self._call(False)
        n = self.zk.nodes.get(path)
        if n is None:
            raise NoNodeError(path)
        if watch is not None:
            watches.setdefault(path, []).append((watch, contextvars.copy_context()))
        return n

    def get(self, path: str, watch: Callable[[WatchedEvent], None] | None = None) -> tuple[bytes, ZnodeStat]:
        n = self._read(path, watch, self.zk.data_watches)
        return n.data, self.zk._stat(n)

    def get_children(self, path: str, watch: Callable[[WatchedEvent], None] | None = None,
                     include_data: bool = False) -> Any:
        n = self._read(path, watch, self.zk.child_watches)
        children = sorted(n.children)
        return (children, self.zk._stat(n)) if include_data else children

    def set(self, path: str, value: bytes, version: int = -1) -> ZnodeStat:
        self._call(True)
        stat = self.zk._set(path, value, version)
        self.zk.on_write(path, bytes(value), self.node)
        self._reply()
        return stat

    def delete(self, path: str, version: int = -1, recursive: bool = False) -> bool:
        self._call(True)
        if recursive:
            for child in sorted(self.zk.nodes.get(path, _Node(b"", 0, 0)).children):
                self.delete(f"{path}/{child}", recursive=True)
        self.zk._delete(path, version)
        self._reply()
        return True

    def sync(self, path: str) -> str:
        """ZooKeeper's sync: one round trip; the simulated ensemble has no lagging server, so a
        read after it sees what a read before it would."""
        self._call(False)
        return path

    def get_async(self, path: str, watch: Callable[[WatchedEvent], None] | None = None) -> _Done:
        return _Done(lambda: self.get(path, watch))

    def delete_async(self, path: str, version: int = -1) -> _Done:
        return _Done(lambda: self.delete(path, version))

    def create_async(self, path: str, value: bytes = b"", acl: Any = None, ephemeral: bool = False,
                     sequence: bool = False, makepath: bool = False) -> _Done:
        return _Done(lambda: self.create(path, value, acl, ephemeral, sequence, makepath))

    def exists_async(self, path: str, watch: Callable[[WatchedEvent], None] | None = None) -> _Done:
        return _Done(lambda: self.exists(path, watch))

    def set_async(self, path: str, value: bytes, version: int = -1) -> _Done:
        return _Done(lambda: self.set(path, value, version))

    def transaction(self) -> SimTransaction:
        return SimTransaction(self)

    # -- recipes -------------------------------------------------------------------
    def DataWatch(self, path: str, func: Callable[..., Any]) -> None:  # noqa: N802 - kazoo's name
        """func(data, stat) now and after every change, until it returns False."""
        ctx = contextvars.copy_context()

        def look(event: WatchedEvent | None = None) -> None:
            if self.closed:
                return
            n = self.zk.nodes.get(path)
            self.zk.data_watches.setdefault(path, []).append((look, ctx))
            data, stat = (None, None) if n is None else (n.data, self.zk._stat(n))
            if (func(data, stat, event) if event is not None else func(data, stat)) is False:
                self.zk.data_watches.get(path, []).remove((look, ctx))
        look()

    def ChildrenWatch(self, path: str, func: Callable[[list[str]], Any]) -> None:  # noqa: N802 - kazoo's name
        """func(children) now and after every change of them, until it returns False."""
        ctx = contextvars.copy_context()

        def look(_event: WatchedEvent | None = None) -> None:
            if self.closed:
                return
            n = self.zk.nodes.get(path)
            self.zk.child_watches.setdefault(path, []).append((look, ctx))
            if func(sorted(n.children) if n is not None else []) is False:
                self.zk.child_watches.get(path, []).remove((look, ctx))
        look()


class _Done:
    """kazoo's IAsyncResult for a call made at once: get() returns or raises its outcome (read
    by the store's Pending.result(): ZkMetadataStore.pipelined is False over this client)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        try:
            self._value, self._error = fn(), None
        except Exception as e:  # noqa: BLE001 - raised again by get(), as kazoo's async result does
            self._value, self._error = None, e

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


class SimTransaction:
    """A multi-op: checked whole against the tree first, applied only if every op passes."""

    def __init__(self, client: SimKazooClient) -> None:
        self.client = client
        self.ops: list[tuple[str, tuple[Any, ...]]] = []

    def create(self, path: str, value: bytes = b"", acl: Any = None, ephemeral: bool = False,
               sequence: bool = False) -> None:
        self.ops.append(("create", (path, value, ephemeral, sequence)))

    def delete(self, path: str, version: int = -1) -> None:
        self.ops.append(("delete", (path, version)))

    def set_data(self, path: str, value: bytes, version: int = -1) -> None:
        self.ops.append(("set", (path, value, version)))

    def check(self, path: str, version: int) -> None:
        self.ops.append(("check", (path, version)))

    def commit(self) -> list[Any]:
        c = self.client
        c._call(True)
        zk = c.zk
        saved = (zk.zxid, {p: _copy(n) for p, n in zk.nodes.items()}, {k: list(v) for k, v in zk.data_watches.items()},
                 {k: list(v) for k, v in zk.child_watches.items()})
        pending = len(zk.loop._ready)  # type: ignore[attr-defined]  # watches a rolled-back multi must not fire
        results: list[Any] = []
        failed = -1
        for i, (kind, args) in enumerate(self.ops):
            try:
                if kind == "create":
                    path, value, ephemeral, sequence = args
                    results.append(zk._create(path, value, c.session if ephemeral else 0, sequence))
                elif kind == "delete":
                    zk._delete(*args)
                    results.append(True)
                elif kind == "set":
                    results.append(zk._set(*args))
                else:
                    zk._check(*args)
                    results.append(True)
            except (NoNodeError, NodeExistsError, BadVersionError, NotEmptyError) as e:
                results.append(e)
                failed = i
                break
        if failed >= 0:
            zk.zxid, zk.nodes, zk.data_watches, zk.child_watches = saved
            while len(zk.loop._ready) > pending:  # type: ignore[attr-defined]
                zk.loop._ready.pop()  # type: ignore[attr-defined]
            return [RolledBackError() if i != failed else results[failed] for i in range(len(self.ops))]
        c._reply()
        return results


def _copy(n: _Node) -> _Node:
    return _Node(n.data, n.czxid, n.mzxid, n.version, n.cversion, n.pzxid, n.owner, set(n.children), n.seq)
