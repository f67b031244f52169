"""Bounds on a bookie's local surfaces (issue 23, item 3): the shard control socket serves
only its own uid (SO_PEERCRED), and the admin HTTP serves on a bounded number of threads
(503 over it). One forced GC at a time on a real bookie is in tests/test_admin.py.

The control socket is served as the shard serves it (control.serve on an event loop, asyncio
and uvloop) and asked by a real process of another uid: the tests run as root, so a forked
child setuid()s to `nobody` before it connects.
"""
from __future__ import annotations

import asyncio
import logging
import os
import pwd
import socket
import subprocess
import threading
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import make_server

import pytest
import uvloop

from bookkeeper.bookie import admin, control
from bookkeeper.cli.main import admin_error_text

_NO_ANSWER = 3  # the child's exit code when the socket closed without a byte
_ANSWERED = 4


_PEER = f"""
import socket, sys
try:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10.0)
        s.connect(bytes.fromhex(sys.argv[1]).decode())  # an abstract name: it starts with a NUL
        s.sendall(b'{{"op": "readonly", "on": false, "reason": ""}}\\n')
        sys.exit({_NO_ANSWER} if s.recv(1 << 16) == b"" else {_ANSWERED})
except (ConnectionResetError, BrokenPipeError):  # closed with the request unread
    sys.exit({_NO_ANSWER})
except OSError:
    sys.exit(2)
"""


# The system's interpreter: another uid may not reach the venv's (under /root here).
SYSTEM_PYTHON = "/usr/bin/python3"


def _ask_as(uid: int, name: str) -> int:
    """A child process running as `uid` (subprocess sets the ids in the child, before it runs
    anything: no fork of this threaded process in Python) asks the control socket to make the
    shard writable; its exit code: _NO_ANSWER if the socket closed (or reset) unanswered."""
    child = subprocess.run([SYSTEM_PYTHON, "-c", _PEER, name.encode().hex()], user=uid, group=pwd.getpwuid(uid).pw_gid,
                           extra_groups=[], timeout=30, stdin=subprocess.DEVNULL, capture_output=True)
    return child.returncode


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer as another uid")
@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_control_socket_serves_only_its_own_uid(new_loop: Callable[[], asyncio.AbstractEventLoop],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A peer running as `nobody` is closed unanswered and logged, and its request never reaches
    the handler; the supervisor's own call (same uid) is answered."""
    name = control.socket_name(os.getpid(), 90 + id(new_loop) % 10)
    handled: list[dict[str, Any]] = []

    async def handler(request: dict[str, Any]) -> dict[str, Any]:
        handled.append(request)
        return {"ok": True}

    async def scenario() -> tuple[int, dict[str, Any]]:
        server = await control.serve(name, handler)
        try:
            other = await asyncio.to_thread(_ask_as, pwd.getpwnam("nobody").pw_uid, name)
            own = await asyncio.to_thread(control.call, name, {"op": "stats"})
            return other, own
        finally:
            server.close()
            await server.wait_closed()

    loop = new_loop()
    try:
        with caplog.at_level(logging.WARNING, logger="bookkeeper.shard"):
            other, own = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert other == _NO_ANSWER
    assert own == {"ok": True} and handled == [{"op": "stats"}]
    nobody = pwd.getpwnam("nobody").pw_uid
    assert any(f"refused a peer running as uid {nobody}" in r.getMessage() for r in caplog.records)


def test_admin_http_threads_are_bounded_and_the_excess_is_answered_503() -> None:
    """The admin HTTP's server with an app that blocks: ADMIN_THREADS requests run, ADMIN_QUEUE
    wait, the next connection is answered 503 at once; threads never pass ADMIN_THREADS more
    than before, and every waiting request is served once the app lets go."""
    release = threading.Event()

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        release.wait(30)
        start_response("200 OK", [("Content-Length", "3")])
        return [b"ok\n"]

    threads_before = threading.active_count()
    server = make_server("127.0.0.1", 0, app, server_class=admin._PooledWSGIServer, handler_class=admin._Quiet)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    port = server.server_address[1]
    held: list[socket.socket] = []
    try:
        for _ in range(admin.ADMIN_THREADS + admin.ADMIN_QUEUE):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            held.append(s)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as over:
            over.sendall(b"GET / HTTP/1.0\r\n\r\n")
            refused = b"".join(iter(lambda: over.recv(4096), b""))
        assert refused.startswith(b"HTTP/1.0 503 ") and b"admin HTTP busy" in refused
        assert threading.active_count() <= threads_before + admin.ADMIN_THREADS + 1  # + serve_forever's
        release.set()
        answers = [b"".join(iter(lambda s=s: s.recv(4096), b"")) for s in held]
        assert all(a.startswith(b"HTTP/1.0 200 ") and a.endswith(b"ok\n") for a in answers)
    finally:
        release.set()
        for s in held:
            s.close()
        server.shutdown()
        server.server_close()
        serving.join(10)


def test_the_gc_409_says_since_when() -> None:
    """The busy answer's time is UTC and its age one decimal: what an operator compares."""
    assert admin.busy_answer(1_800_000_000.0, 1_800_000_012.34) == {
        "error": "a forced GC pass is running since 2027-01-15T08:00:00Z (12.3 s): try again when it ends",
        "running_since": "2027-01-15T08:00:00Z"}


@pytest.mark.parametrize("body, reason", [
    (b'{"error": "a forced GC pass is running since X", "running_since": "X"}', "a forced GC pass is running since X"),
    (b"not json", "not json"),
    (b'{"no_error_key": 1}', '{"no_error_key": 1}'),
])
def test_an_admin_error_answer_is_read_for_its_reason(body: bytes, reason: str) -> None:
    """`bk bookie gc` prints a 409's reason as its own line (exit 3): the JSON answer's error
    text, or the raw text of an answer that is not the admin HTTP's JSON."""
    assert admin_error_text(body) == reason
