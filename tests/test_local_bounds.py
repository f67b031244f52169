"""Bounds on a bookie's local surfaces (issue 23, item 3): the shard control socket serves
only its own uid (SO_PEERCRED), and the admin HTTP runs one forced GC at a time on a bounded
number of request threads.

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
from collections.abc import Callable
from typing import Any

import pytest
import uvloop

from bookkeeper.bookie import control

_NO_ANSWER = 3  # the child's exit code when the socket closed without a byte
_ANSWERED = 4


def _ask_as(uid: int, name: str) -> int:
    """Fork a child that becomes `uid`, asks the control socket to make the shard writable, and
    exits _NO_ANSWER if the socket closed (or reset) without answering; the parent waits and returns that."""
    gid = pwd.getpwuid(uid).pw_gid
    pid = os.fork()
    if pid == 0:  # the child: nothing but system calls (this process has threads), then _exit
        code = 1
        try:
            os.setgid(gid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(10.0)
                s.connect(name)
                s.sendall(b'{"op": "readonly", "on": false, "reason": ""}\n')
                code = _NO_ANSWER if s.recv(1 << 16) == b"" else _ANSWERED
        except (ConnectionResetError, BrokenPipeError):  # closed with the request unread
            code = _NO_ANSWER
        except OSError:
            code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


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
