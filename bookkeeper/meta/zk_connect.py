"""Starting a ZooKeeper session that fails at once, and says why, when no server can be reached.

Why not kazoo's `KazooClient.start(timeout)` alone: its connection thread turns every failed
TCP connect (refused, no route, timed out) into a log line and retries with back-off until
`start` gives up after the whole timeout, with one message for every cause ("Connection
time-out"); a stopped cluster cost 15 s and the wrong word. Here kazoo's own attempts are
watched instead (its handler's `create_connection`, the one place it opens a socket): each TCP
connect is bounded by `connect_timeout_s` and reported, and `start_client` decides from the
reports (`start_verdict`, a pure function) as soon as the answer is known:

- every address kazoo tries failed its TCP connect once: unreachable, at once, naming each
  address and why (`failure_reason`); "refused" only when every one refused;
- an address accepted TCP but no session started within the session timeout: a hung server;
- a session started: connected.

No extra connection is made to probe: the sockets are kazoo's, so a server that is up sees
one client, as before. The bound on each TCP connect holds for the session's later
reconnects too (a dead server in an ensemble costs `connect_timeout_s`, not the session
timeout, before the next one is tried).
"""
from __future__ import annotations

import enum
import errno
import math
import select
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kazoo.client import KazooClient
from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.hosts import collect_hosts
from kazoo.protocol.states import KazooState

from bookkeeper.errors import ZooKeeperUnreachableError

Address = tuple[str, int]  # (ip, port): what kazoo connects to
REFUSED = "connection refused"
UNRESOLVED = "cannot resolve the host name"
_WORDS = {errno.ECONNREFUSED: REFUSED, errno.EHOSTUNREACH: "no route to host",
          errno.ENETUNREACH: "network unreachable", errno.ECONNRESET: "connection reset"}


class StartVerdict(enum.Enum):
    CONNECTED = "connected"
    WAIT = "wait"
    UNREACHABLE = "unreachable"  # no address accepted a TCP connection
    HUNG = "hung"                # one did, and no session started in time


def failure_reason(error: OSError, *, connect_timeout_s: float) -> str:
    """A failed TCP connect in the words of the error message.

    | error                                   | words                             |
    |-----------------------------------------|-----------------------------------|
    | ECONNREFUSED                            | connection refused                |
    | EHOSTUNREACH / ENETUNREACH / ECONNRESET | no route to host / network unreachable / connection reset |
    | TimeoutError, or kazoo's bare OSError() once its time is used up | no answer within S s |
    | anything else                           | its strerror, else its text       |
    """
    if isinstance(error, TimeoutError) or (error.errno is None and not error.args):
        return f"no answer within {connect_timeout_s:g} s"
    if error.errno in _WORDS:
        return _WORDS[error.errno]
    return (error.strerror or str(error)).lower()


def start_verdict(*, connected: bool, addresses: int, failed: int, accepted: int, timed_out: bool) -> StartVerdict:
    """What a session start has come to, from the attempts kazoo reported so far.

    | connected | accepted | failed >= addresses | timed_out | verdict     |
    |-----------|----------|---------------------|-----------|-------------|
    | yes       | -        | -                   | -         | CONNECTED   |
    | no        | 0        | yes                 | -         | UNREACHABLE |
    | no        | > 0      | -                   | yes       | HUNG        |
    | no        | 0        | no                  | yes       | UNREACHABLE |
    | no        | -        | -                   | no        | WAIT        |

    An address that accepted TCP keeps the start waiting (up to the session timeout) even
    when others failed: kazoo may still start a session there.
    """
    if connected:
        return StartVerdict.CONNECTED
    if accepted == 0 and failed >= addresses:
        return StartVerdict.UNREACHABLE
    if not timed_out:
        return StartVerdict.WAIT
    return StartVerdict.HUNG if accepted else StartVerdict.UNREACHABLE


def unreachable_message(reasons: Mapping[str, Iterable[str]], *, waited_s: float) -> str:
    """`cannot reach ZooKeeper at HOST:PORT (why)[, HOST:PORT (why)...]: <hint>`; reasons maps each
    host:port of the URI to why its addresses failed (empty: nothing was learnt in waited_s)."""
    if not reasons:
        return f"cannot reach ZooKeeper: no answer within {waited_s:g} s"
    parts, every = [], set()
    for name, why in reasons.items():
        words = list(dict.fromkeys(why))
        every.update(words)
        parts.append(f"{name} ({'; '.join(words)})")
    if every == {REFUSED}:
        hint = "is it running?"
    elif every == {UNRESOLVED}:
        hint = "is the address right?"
    else:
        hint = "is it running, and is the address right?"
    return f"cannot reach ZooKeeper at {', '.join(parts)}: {hint}"


def hung_message(accepted: Iterable[str], *, session_timeout_s: float) -> str:
    names = ", ".join(dict.fromkeys(accepted))
    return (f"ZooKeeper at {names} accepted a connection but started no session within the session "
            f"timeout ({session_timeout_s:g} s): is it hung or overloaded?")


class _Attempts:
    """The TCP connects kazoo's thread made since start_client began: written by that thread
    (report), read by start_client once `settled` is set or its wait is over."""

    def __init__(self, names: Mapping[Address, str], unresolved: Mapping[str, str], connect_timeout_s: float) -> None:
        self.names = dict(names)              # every address kazoo will try -> its host:port in the URI
        self.unresolved = dict(unresolved)    # host:port -> why it has no address
        self.connect_timeout_s = connect_timeout_s
        self.failed: dict[Address, str] = {}
        self.accepted: set[Address] = set()
        self.connected = False
        self.recording = True
        self.settled = threading.Event()
        self._lock = threading.Lock()

    def report(self, address: Any, error: OSError | None) -> None:
        with self._lock:
            if not self.recording:
                return
            key = (str(address[0]), int(address[1]))
            if error is None:
                self.accepted.add(key)
            else:
                self.failed.setdefault(key, failure_reason(error, connect_timeout_s=self.connect_timeout_s))
            if self.verdict(timed_out=False) is not StartVerdict.WAIT:
                self.settled.set()

    def on_state(self, state: KazooState) -> bool:
        if state == KazooState.CONNECTED:
            with self._lock:
                self.connected = True
            self.settled.set()
            return True  # kazoo drops a listener that returns True
        return False

    def verdict(self, *, timed_out: bool) -> StartVerdict:
        return start_verdict(connected=self.connected, addresses=len(self.names), failed=len(self.failed),
                             accepted=len(self.accepted), timed_out=timed_out)

    def stop(self) -> None:
        """Later reconnects are the session's business, not the start's: stop recording them."""
        with self._lock:
            self.recording = False

    def error(self, verdict: StartVerdict, *, session_timeout_s: float, waited_s: float) -> ZooKeeperUnreachableError:
        with self._lock:
            if verdict is StartVerdict.HUNG:
                return ZooKeeperUnreachableError(hung_message(sorted(self.names[a] for a in self.accepted),
                                                              session_timeout_s=session_timeout_s))
            reasons: dict[str, list[str]] = {}
            for address, name in self.names.items():  # the URI's order, not the order kazoo tried
                if address in self.failed:
                    reasons.setdefault(name, []).append(self.failed[address])
            for name, why in self.unresolved.items():
                reasons[name] = [why]
            return ZooKeeperUnreachableError(unreachable_message(reasons, waited_s=waited_s))


_READABLE = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP | select.POLLNVAL
_WRITABLE = select.POLLOUT | select.POLLERR | select.POLLHUP | select.POLLNVAL


def poll_select(rlist: Iterable[Any], wlist: Iterable[Any], _xlist: Iterable[Any],
                timeout: float | None = None) -> tuple[list[Any], list[Any], list[Any]]:
    """select(2)'s contract (sockets or fds; ready lists returned; the third always empty: kazoo
    passes none) on poll(2). Why: kazoo's threading handler makes, fills and closes an epoll
    selector per wait (kazoo.handlers.utils.selector_select: three syscalls and ~20 Python
    calls around the wait itself), and its connection thread waits about four times per
    request (the wake-up, the send, the reply's header and body); with the metadata requests
    on kazoo's async API that was the largest part of what a ledger create cost the client.
    A poll object costs no syscall to make, and takes any fd number (select(2)'s FD_SETSIZE
    limit is why kazoo left select)."""
    wanted: dict[int, int] = {}
    objs: dict[int, tuple[list[Any], list[Any]]] = {}
    for objects, mask, side in ((rlist, _READABLE, 0), (wlist, _WRITABLE, 1)):
        for obj in objects:
            fd = obj if isinstance(obj, int) else obj.fileno()
            if fd < 0:
                raise ValueError("Invalid event mask or fd")  # a closed socket, as selector_select says
            wanted[fd] = wanted.get(fd, 0) | mask
            objs.setdefault(fd, ([], []))[side].append(obj)
    poller = select.poll()
    for fd, mask in wanted.items():
        poller.register(fd, mask)
    ready = poller.poll(None if timeout is None else math.ceil(max(timeout, 0.0) * 1000))
    readable: list[Any] = []
    writable: list[Any] = []
    for fd, events in ready:
        if events & _READABLE:
            readable += objs[fd][0]
        if events & _WRITABLE:
            writable += objs[fd][1]
    return readable, writable, []


class _WatchedHandler(SequentialThreadingHandler):
    """kazoo's threading handler, with every TCP connect bounded by connect_timeout_s and
    reported, waiting with poll_select."""

    def select(self, *args: Any, **kwargs: Any) -> tuple[list[Any], list[Any], list[Any]]:
        return poll_select(*args, **kwargs)

    def __init__(self, attempts: _Attempts) -> None:
        super().__init__()
        self.attempts = attempts

    def create_connection(self, *args: Any, **kwargs: Any) -> Any:
        limit = self.attempts.connect_timeout_s
        kwargs["timeout"] = min(kwargs.get("timeout") or limit, limit)
        address = kwargs.get("address", args[0] if args else ("?", 0))
        try:
            sock = super().create_connection(*args, **kwargs)
        except OSError as e:
            self.attempts.report(address, e)
            raise
        self.attempts.report(address, None)
        return sock


def _addresses(hosts: Iterable[tuple[str, int]]) -> tuple[dict[Address, str], dict[str, str]]:
    """The addresses kazoo will try (its own expansion: getaddrinfo per host), each with the
    host:port that named it, and the host:ports that resolve to nothing."""
    names: dict[Address, str] = {}
    unresolved: dict[str, str] = {}
    for host, port in hosts:
        name = f"{host}:{port}"
        try:
            infos = socket.getaddrinfo(host.strip(), port, 0, 0, socket.IPPROTO_TCP)
        except socket.gaierror:
            unresolved[name] = UNRESOLVED
            continue
        for info in infos:
            names[(str(info[4][0]), int(info[4][1]))] = name
    return names, unresolved


def start_client(hosts: str, *, session_timeout_s: float, connect_timeout_s: float,
                 client_factory: Callable[..., KazooClient] = KazooClient) -> KazooClient:
    """A started KazooClient for `hosts` ('h1:p1,h2:p2'), or ZooKeeperUnreachableError: at once when
    every address refused or is unreachable, after connect_timeout_s per address that does not
    answer a TCP connect, after the session timeout when a server accepts TCP but starts no
    session. client_factory(hosts=, timeout=, handler=) makes it (credentials, TLS options: a
    TLS handshake runs inside the handler's bounded connect, and fails it with its reason)."""
    names, unresolved = _addresses(collect_hosts(hosts)[0])
    attempts = _Attempts(names, unresolved, connect_timeout_s)
    if not names:
        raise attempts.error(StartVerdict.UNREACHABLE, session_timeout_s=session_timeout_s, waited_s=0.0)
    client = client_factory(hosts=hosts, timeout=session_timeout_s, handler=_WatchedHandler(attempts))
    client.add_listener(attempts.on_state)
    client.start_async()
    waited_s = max(session_timeout_s, connect_timeout_s)
    attempts.settled.wait(waited_s)
    attempts.stop()
    verdict = attempts.verdict(timed_out=True)
    if verdict is StartVerdict.CONNECTED:
        return client
    client.remove_listener(attempts.on_state)
    client.stop()
    client.close()
    raise attempts.error(verdict, session_timeout_s=session_timeout_s, waited_s=waited_s)
