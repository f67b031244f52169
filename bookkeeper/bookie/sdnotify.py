"""sd_notify: tell systemd (a `Type=notify` unit) that the bookie is ready, or stopping.

Lives in: the supervisor process (bookie/supervisor.py).

The protocol (sd_notify(3)): one datagram of newline-separated `KEY=VALUE` lines to the
AF_UNIX socket named in $NOTIFY_SOCKET; a name starting with '@' is in Linux's abstract
namespace. Written here in a few lines rather than taken from a library: it is the whole
protocol, and the bookie needs nothing else of systemd. Without $NOTIFY_SOCKET (not under
systemd, or a unit that is not Type=notify) nothing is sent.
"""
from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


def notify_address(value: str) -> str | None:
    """The socket address of a $NOTIFY_SOCKET value, None if it names no AF_UNIX socket.

    '@name' -> the abstract '\\0name'; '/path' -> the path. systemd's other forms (vsock:)
    are for virtual machines' managers, never a bookie's.
    """
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def sd_notify(message: str, *, environ: Mapping[str, str] = os.environ) -> bool:
    """Send `message` (e.g. "READY=1") to the service manager; True if it was sent.

    A failure is logged, never raised: the bookie serves either way (systemd then says the
    start timed out, which the log line explains).
    """
    value = environ.get("NOTIFY_SOCKET", "")
    if not value:
        return False
    address = notify_address(value)
    if address is None:
        log.warning("NOTIFY_SOCKET=%r is not an AF_UNIX socket: %r not sent", value, message)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall(message.encode())
    except OSError as e:
        log.warning("sd_notify %r to %s failed: %s", message, value, e)
        return False
    return True
