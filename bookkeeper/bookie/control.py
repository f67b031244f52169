"""The control channel between a bookie's supervisor and its shards.

Lives in: both ends. Each shard serves a Unix socket in Linux's abstract namespace
(no file to leak or to outgrow the 108-byte path limit, gone when the shard dies),
named after the supervisor's pid and the shard index. One request per connection:
a JSON object on one line, answered with one JSON line.

Why a channel and not files or signals: the supervisor needs answers at the moment
it is asked (a scrape, a GC the operator is waiting on, a read-only switch that must
be in force before the registration moves), and a shard must never be blocked by it:
the shard serves it on its own event loop, as one more connection.

Who may ask: a socket in the abstract namespace has no file mode, so any local user could
connect (and flip a shard writable); each connection's peer credentials (SO_PEERCRED, set
by the kernel at connect, not claimable) are checked first, and only a peer running as the
bookie's own uid is served. Not root as well: a bookie that is not root has no reason to
take orders from root, and one that is root is served by root as the same uid. Any other
peer is closed at once, unread, and logged with its pid and uid.

Requests: {"op": "stats"} -> metrics snapshot and state; {"op": "readonly", "on": bool,
"reason": str}; {"op": "gc", "force": bool} -> what the pass reclaimed.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
MAX_REQUEST_BYTES = 1 << 16
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
log = logging.getLogger("bookkeeper.shard")


def socket_name(supervisor_pid: int, index: int) -> str:
    """The abstract socket of shard `index` of the bookie whose supervisor is `supervisor_pid`."""
    return f"\0bookkeeper-{supervisor_pid}-shard-{index}"


async def serve(name: str, handler: Handler) -> asyncio.AbstractServer:
    """Serve the control socket on the running loop; a failing request gets {"error": ...}."""

    own_uid = os.geteuid()

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pid, uid = peer_credentials(writer.get_extra_info("socket"))
        if uid != own_uid:
            log.warning("control socket %s: refused a peer running as uid %d (pid %d); only uid %d is served",
                        name[1:], uid, pid, own_uid)
            writer.close()
            return
        try:
            line = await reader.readline()
            try:
                reply = await handler(json.loads(line))
            except Exception as e:  # a bad request or a failed job: said to the asker, shard stays up
                reply = {"error": f"{type(e).__name__}: {e}"}
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        finally:
            writer.close()

    return await asyncio.start_unix_server(client, path=name, limit=MAX_REQUEST_BYTES)


def peer_credentials(sock: Any) -> tuple[int, int]:
    """(pid, uid) of a connected Unix socket's peer, as the kernel recorded them at connect."""
    pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid


def call(name: str, request: dict[str, Any], *, timeout_s: float = 5.0) -> dict[str, Any]:
    """Ask a shard (blocking; supervisor threads). Raises OSError if it cannot answer in time."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(name)
        if peer_credentials(s)[1] != os.geteuid():  # another user took the name while the shard was down
            raise ConnectionError(f"shard control socket {name[1:]!r} is held by another uid")
        s.sendall(json.dumps(request).encode() + b"\n")
        chunks = []
        while not chunks or not chunks[-1].endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                raise ConnectionError(f"shard control socket {name[1:]!r} closed without an answer")
            chunks.append(chunk)
    reply = json.loads(b"".join(chunks))
    if "error" in reply:
        raise OSError(f"shard control request {request.get('op')!r} failed: {reply['error']}")
    return reply
