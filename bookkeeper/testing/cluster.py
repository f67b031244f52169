"""A local cluster of real processes: one ZooKeeper and N bookies (each a supervisor
plus its shard processes), with kill / hang / restart helpers.

Everything binds and advertises 127.0.0.1 unless the cluster is given another `address`
(a test host's, so Spark executors or clients on other hosts reach it directly).

Used by the tests, by `bk sandbox` and `make run`; usable by anyone who wants a
throw-away cluster. Every process is started here and stopped here by its pid.
"""
from __future__ import annotations

import errno
import json
import os
import random
import socket
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException
from kazoo.handlers.threading import KazooTimeoutError

from bookkeeper.procs import module_command
from bookkeeper.security.tokens import generate_keys_file, mint_token, read_keys_file
from bookkeeper.testing.zookeeper import ZooKeeperServer, port_in_use

if TYPE_CHECKING:
    from bookkeeper.testing.pki import TestPKI

BOOKIE_START_TIMEOUT_S = 60.0
_LOOPBACK = "127.0.0.1"  # where a cluster binds unless given an address
# bookie id -> (registration data, id of the ZooKeeper session owning its ephemeral znode)
Registrations = dict[str, tuple[dict[str, Any], int]]


def children_of(pid: int) -> list[int]:
    """Direct child pids of a process (Linux /proc)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


# Ports free_port_block handed out in this process (never handed out twice).
_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()


def _bindable(port: int, address: str) -> bool:
    """False when the port is taken; an address that is not one of this host's is the caller's
    mistake, named, not a port that happens to be busy 500 times."""
    with socket.socket() as s:
        try:
            s.bind((address, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            raise ValueError(f"cannot bind {address}:{port} ({e}): is {address!r} an address of this host?") from e
    return True


def free_port_block(count: int = 1, *, address: str = _LOOPBACK) -> int:
    """A base port with `count` consecutive ports free on `address` (loopback by default),
    below the ephemeral range.

    Why below it: a port picked from the ephemeral range can be taken by any outgoing
    connection (a ZooKeeper client, say) between the pick and the server's bind. Under
    pytest-xdist each worker picks from its own slice of the range: two workers could
    otherwise both find a block free and race to bind it (a bookie binds a second after
    its pick). Within one process a port is handed out once: a cluster picks every
    bookie's block before any bookie binds, so two picks could otherwise overlap (seen:
    one bookie's block 12920-12921, the next one's 12921-12922, and a shard that could
    not bind).
    """
    lo, hi = 10_000, _ephemeral_range()[0]
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker.startswith("gw") and workers > 1:
        width = (hi - lo) // workers
        lo += width * int(worker[2:])
        hi = lo + width
    hi -= count
    rng = random.Random()
    with _HANDED_OUT_LOCK:
        for _ in range(500):
            base = rng.randrange(lo, hi)
            block = range(base, base + count)
            if not _HANDED_OUT.isdisjoint(block) or not all(_bindable(p, address) for p in block):
                continue
            _HANDED_OUT.update(block)
            return base
    raise RuntimeError(f"no block of {count} free ports on {address}")


class LocalBookie:
    """One bookie process (`bk bookie --conf`) of a LocalCluster.

    With a `pki`, the bookie gets a certificate naming its own bookie id (its port is chosen
    here, before it starts) and `tls = "require"` against that CA; `extra` may override any of it.
    `address` is what it binds and advertises, and its bookie id's host.
    """

    def __init__(self, directory: Path, metadata_uri: str, *, index: int, shards: int,
                 journal_sync: str, extra: dict[str, Any] | None = None, pki: TestPKI | None = None,
                 env: dict[str, str] | None = None, address: str = _LOOPBACK) -> None:
        self.dir = directory
        self.address = address
        self.env = dict(env or {})
        self.dir.mkdir(parents=True, exist_ok=True)
        self.index = index
        self.port = free_port_block(shards, address=address)
        trust: dict[str, Any] = {}
        if pki is not None:
            cert, key = pki.bookie(str((extra or {}).get("bookie_id") or f"{address}:{self.port}"))
            trust = {"tls": "require", "tls_cert_file": cert, "tls_key_file": key, "tls_ca_file": pki.ca_file}
        self.conf = {
            "metadata_uri": metadata_uri, "bind_address": address, "advertised_address": address,
            "port": self.port, "shards": shards, "journal_dir": str(self.dir / "journal"),
            "ledger_dirs": [str(self.dir / "ledgers")], "journal_sync": journal_sync,
            "zk_session_timeout_ms": 4000,
            # Small zero-filled journal files: many bookies start in a test run (override for benches).
            "journal_preallocate_bytes": 4 << 20, **trust, **(extra or {}),
        }
        self.conf_path = self.dir / "bookie.toml"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bookie_id(self) -> str:
        return self.conf.get("bookie_id") or f"{self.address}:{self.port}"

    @property
    def http_port(self) -> int:
        """The admin HTTP port (`/metrics`, `/api/v1/...`) on `address`; 0 when it has none."""
        return int(self.conf.get("http_port", 0))

    @property
    def rack(self) -> str:
        """The rack the bookie registers, which rack-aware placement reads."""
        return str(self.conf.get("rack", "/default-rack"))

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def shard_pids(self) -> list[int]:
        return children_of(self.pid) if self.pid else []

    def write_conf(self) -> None:
        lines = []
        for k, v in self.conf.items():
            lines.append(f"{k} = {json.dumps(v)}")
        self.conf_path.write_text("\n".join(lines) + "\n")

    def start(self) -> None:
        self.write_conf()
        log = open(self.dir / "bookie.log", "ab")
        self.proc = subprocess.Popen(module_command("bookkeeper.cli.main", "-v", "bookie", "--conf",
                                                     str(self.conf_path)), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                     start_new_session=True,
                                     env={**os.environ, **self.env, "BK_PARENT_PID": str(os.getpid())})
        log.close()

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (graceful: journal drained, checkpoint), SIGKILL if it hangs."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            shards = self.shard_pids()
            self.proc.send_signal(signal.SIGCONT)
            for pid in shards:
                _signal(pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def kill(self) -> None:
        """kill -9 of the supervisor and every shard: a crash of the whole bookie."""
        if self.proc is None:
            return
        for pid in self.shard_pids():
            _signal(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc = None

    def hang(self) -> None:
        """SIGSTOP the supervisor and every shard: a bookie that stops answering but keeps its sockets."""
        if self.proc is None:
            return
        _signal(self.proc.pid, signal.SIGSTOP)
        for pid in self.shard_pids():
            _signal(pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after hang()."""
        if self.proc is None:
            return
        for pid in self.shard_pids():
            _signal(pid, signal.SIGCONT)
        _signal(self.proc.pid, signal.SIGCONT)

    def kill_shard(self, shard_index: int) -> int:
        """kill -9 of one shard process (the supervisor restarts it); returns the killed pid."""
        pid = self.shard_pid(shard_index)
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait_shard_replaced(self, shard_index: int, old_pid: int, timeout_s: float = 60.0) -> int:
        """Until a process other than old_pid runs as shard `shard_index`; returns its pid. Why
        not just wait for the port: kill -9 is asynchronous, and a killed shard on a loaded
        machine may still accept a connection before it is gone."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                pid = self.shard_pid(shard_index)
                if pid != old_pid:
                    return pid
            except RuntimeError:
                pass  # between the old one's exit and the new one's exec
            if time.monotonic() > deadline:
                raise RuntimeError(f"shard {shard_index} of {self.bookie_id} was not restarted:\n{self.log_tail()}")
            time.sleep(0.05)

    def shard_pid(self, shard_index: int) -> int:
        for pid in self.shard_pids():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--index" in cmd and cmd[cmd.index(b"--index") + 1] == str(shard_index).encode():
                return pid
        raise RuntimeError(f"bookie {self.bookie_id} has no running shard {shard_index}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join((self.dir / "bookie.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def choose_zk_port(*, zk_port: int | None, prefer_zk_port: int | None, address: str = _LOOPBACK) -> int:
    """ZooKeeper's port: `zk_port` if given (taken or not: starting then says it is taken),
    else `prefer_zk_port` if it can be bound on `address` now, else a free one (0 or None: not given).

    Why a preference: the sandbox takes ZooKeeper's usual 2181 when it can, so programs
    written for the default URI reach it unchanged; a second sandbox (or a ZooKeeper of the
    system) already there must not stop it from starting.
    """
    if zk_port and prefer_zk_port:
        raise ValueError("give zk_port (this port) or prefer_zk_port (this port if free), not both")
    if zk_port:
        return zk_port
    if prefer_zk_port and not port_in_use(prefer_zk_port, address):
        return prefer_zk_port
    return free_port_block(address=address)


class LocalCluster:
    """ZooKeeper + N bookies on 127.0.0.1 (or `address`: each binds and advertises it, and
    `metadata_uri` names it) under one directory.

    The defaults suit tests: ports picked at random, every bookie in one rack, no admin HTTP,
    and with more than one bookie, shards not pinned to cores (`pin_shards` false: pinning is
    per bookie, as if it had the host to itself, so every bookie's shard 0 would share the first
    core; measured with `bk bench neighbour`, 3 bookies of 1 shard on 2 cores: pinned, the bulk
    peak 53,000 adds/s and a W=1 writer's p99.9 beside 30 % bulk 21 ms; unpinned, 70,000 and
    2.6 ms). A cluster of one bookie pins, as production does.
    `bk sandbox` asks for more, so a newcomer sees the whole operator surface:
    `prefer_zk_port=2181` (ZooKeeper's usual port when free; `zk.port` says which it took),
    `http_ports=True` (each bookie gets its own admin HTTP port, `LocalBookie.http_port`) and
    `racks=True` (bookie i registers rack `/rack-<i+1>`, so rack-aware placement has the
    distinct racks it asks for instead of degrading on every ledger). A `bookie_conf` or
    `add_bookie` key (`http_port`, `rack`) overrides what these options give.

    Trust, for the tests of TLS and authentication: with `pki` (bookkeeper.testing.pki.TestPKI)
    every bookie gets a certificate for its own bookie id and `tls = "require"`; `bookie_trust`
    adds the bookies' other trust keys (`tls`, `tls_client_auth`, `auth_provider`,
    `authz_file`, ...). With `auth_provider = "token"` and no `auth_token_keys_file`, the
    cluster makes a keys file (`token_keys_file`). `client_trust(principal)` gives the
    `connect` keywords of a client acting as that principal.
    """

    TOKEN_KEY_ID = "test-1"

    def __init__(self, directory: str | os.PathLike[str], *, bookies: int = 3, shards: int = 2,
                 journal_sync: str = "io_uring", zk_port: int | None = None, prefer_zk_port: int | None = None,
                 http_ports: bool = False, racks: bool = False,
                 bookie_conf: dict[str, Any] | None = None, pki: TestPKI | None = None,
                 bookie_trust: dict[str, Any] | None = None, bookie_env: dict[str, str] | None = None,
                 address: str = _LOOPBACK) -> None:
        self.dir = Path(directory)
        self.address = address
        self.bookie_env = dict(bookie_env or {})
        self.dir.mkdir(parents=True, exist_ok=True)
        self.zk = ZooKeeperServer(self.dir / "zookeeper", address=address,
                                  port=choose_zk_port(zk_port=zk_port, prefer_zk_port=prefer_zk_port,
                                                      address=address))
        self.shards = shards
        self.journal_sync = journal_sync
        self.http_ports = http_ports
        self.racks = racks
        self.bookie_conf = bookie_conf or {}
        self.pki = pki
        self.bookie_trust = dict(bookie_trust or {})
        self.token_keys_file = str(self.bookie_trust.get("auth_token_keys_file", ""))
        if self.bookie_trust.get("auth_provider") == "token" and not self.token_keys_file:
            self.token_keys_file = str(self.dir / "token-keys.toml")
            generate_keys_file(self.token_keys_file, self.TOKEN_KEY_ID)
            self.bookie_trust["auth_token_keys_file"] = self.token_keys_file
        self.bookies: list[LocalBookie] = []
        self._initial = bookies

    @property
    def metadata_uri(self) -> str:
        return self.zk.metadata_uri("/ledgers")

    def start(self) -> LocalCluster:
        self.zk.start()
        try:
            for _ in range(self._initial):
                self.add_bookie(wait=False)
            self.wait_registered()
        except BaseException:
            self.stop()
            raise
        return self

    def add_bookie(self, *, wait: bool = True, env: dict[str, str] | None = None, **conf: Any) -> LocalBookie:
        """Start one more bookie (its conf: the cluster's options, then bookie_conf, then `conf`;
        its environment: ours, then the cluster's bookie_env, then `env`: test-only switches)."""
        index = len(self.bookies)
        options: dict[str, Any] = {"pin_shards": self._initial <= 1}  # the class doc says why
        if self.http_ports:
            options["http_port"] = free_port_block(address=self.address)
        if self.racks:
            options["rack"] = f"/rack-{index + 1}"
        b = LocalBookie(self.dir / f"bookie-{index}", self.metadata_uri, index=index, shards=self.shards,
                        journal_sync=self.journal_sync, pki=self.pki, env={**self.bookie_env, **(env or {})},
                        address=self.address,
                        extra={**options, **self.bookie_trust, **self.bookie_conf, **conf})
        self.bookies.append(b)
        b.start()
        if wait:
            self.wait_registered([b])
        return b

    def token(self, principal: str, ttl_s: float = 3600.0, *, key_id: str | None = None) -> str:
        """A token for `principal` signed with the cluster's token keys (`key_id`: one of the
        keys file's, by default the one the cluster made)."""
        if not self.token_keys_file:
            raise ValueError("this cluster has no token keys (bookie_trust auth_provider = 'token')")
        kid = key_id or self.TOKEN_KEY_ID
        secret = read_keys_file(self.token_keys_file).get(kid)
        if secret is None:
            raise ValueError(f"no key {kid!r} in {self.token_keys_file}")
        return mint_token(subject=principal, ttl_s=ttl_s, key_id=kid, secret=secret)

    def client_trust(self, principal: str | None = None, *, auth: str | None = None,
                     ttl_s: float = 3600.0) -> dict[str, Any]:
        """`BookKeeper.connect` keywords of a client of this cluster acting as `principal`.

        TLS (`require`) against the cluster's CA when it has a pki, with a client certificate
        for the principal (mTLS) when there is one; then the AUTH plug-in `auth` (default: the
        bookies' auth_provider): "mtls" (the certificate's CN is the principal) or "token" (a
        token for the principal, valid ttl_s). No principal: TLS only, no credentials.
        """
        kwargs: dict[str, Any] = {}
        if self.pki is not None:
            kwargs.update(tls="require", tls_ca_file=self.pki.ca_file)
            if principal is not None:
                cert, key = self.pki.client(principal)
                kwargs.update(tls_cert_file=cert, tls_key_file=key)
        provider = auth if auth is not None else str(self.bookie_trust.get("auth_provider", ""))
        if principal is not None and provider:
            kwargs["auth_provider"] = provider
            if provider == "token":
                kwargs["auth_token"] = self.token(principal, ttl_s)
        return kwargs

    def _read_registrations(self) -> Registrations:
        """Writable registrations: bookie id -> (its data, the session that owns the ephemeral znode)."""
        auth = str(self.bookie_conf.get("zk_auth", ""))  # the bookies' credential reads what they wrote
        zk = KazooClient(hosts=self.zk.connect_string,
                         auth_data=[("digest", auth.split(":", 1)[1])] if auth.startswith("digest:") else None)
        zk.start(timeout=10)
        try:
            base = "/ledgers/available"
            if not zk.exists(base):
                return {}
            out = {}
            for child in zk.get_children(base):
                if child == "readonly":
                    continue
                try:
                    data, stat = zk.get(f"{base}/{child}")
                    out[child] = (json.loads(data), stat.ephemeralOwner)
                except Exception:
                    continue
            return out
        finally:
            zk.stop()
            zk.close()

    def registrations(self) -> dict[str, dict[str, Any]]:
        """Writable registrations: bookie id -> its data (shard addresses, pid, ...)."""
        return {bookie: data for bookie, (data, _) in self._read_registrations().items()}

    def registration_sessions(self) -> dict[str, int]:
        """bookie id -> the ZooKeeper session that holds its registration now."""
        return {bookie: owner for bookie, (_, owner) in self._read_registrations().items()}

    def _wait_until(self, bookies: list[LocalBookie], timeout_s: float, what: str,
                    ready: Callable[[LocalBookie, Registrations, set[int]], bool], *,
                    live_sessions: bool = False) -> None:
        """Until ready(bookie, registrations, live session ids) holds for each bookie (the live
        sessions are read only when asked for); a bookie process that exits fails at once."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                regs = self._read_registrations()
                live = self.zk.session_ids() if live_sessions else set()
            except (KazooException, KazooTimeoutError, OSError):  # ZooKeeper down or restarting: not yet
                regs, live = {}, set()
            waiting = [b for b in bookies if not ready(b, regs, live)]
            if not waiting:
                return
            for b in waiting:
                if b.proc is not None and b.proc.poll() is not None:
                    raise RuntimeError(f"bookie {b.bookie_id} exited with {b.proc.returncode}:\n{b.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"bookies not {what} within {timeout_s}s: "
                                   f"{[(b.bookie_id, regs.get(b.bookie_id), b.log_tail()) for b in waiting]}")
            time.sleep(0.1)

    def wait_registered(self, bookies: list[LocalBookie] | None = None,
                        timeout_s: float = BOOKIE_START_TIMEOUT_S) -> None:
        """Until each bookie's current process holds its registration (a stale one does not count)."""
        def ready(b: LocalBookie, regs: Registrations, _live: set[int]) -> bool:
            return b.pid is not None and regs.get(b.bookie_id, ({}, 0))[0].get("pid") == b.pid

        self._wait_until(self.bookies if bookies is None else bookies, timeout_s, "registered", ready)

    def wait_sessions_live(self, bookies: list[LocalBookie] | None = None, *,
                           expired: dict[str, int] | None = None,
                           timeout_s: float = BOOKIE_START_TIMEOUT_S) -> None:
        """Until each bookie's current process holds its registration under a session that has a
        live connection to ZooKeeper, and not under the session `expired` names for it.

        Why more than wait_registered: after a ZooKeeper restart every registration is back at
        once, before its bookie has reconnected, and it vanishes if the bookie does not reconnect
        within its session timeout; and a bookie whose session expired proves it noticed only by
        registering again under a new session.
        """
        gone = expired or {}

        def ready(b: LocalBookie, regs: Registrations, live: set[int]) -> bool:
            data, owner = regs.get(b.bookie_id, ({}, 0))
            return b.pid is not None and data.get("pid") == b.pid and owner in live and owner != gone.get(b.bookie_id)

        self._wait_until(self.bookies if bookies is None else bookies, timeout_s,
                         "registered under a live session", ready, live_sessions=True)

    def restart_zookeeper(self, down_s: float = 0.0) -> None:
        """Stop the cluster's ZooKeeper and start it again after down_s (same port and data)."""
        self.zk.restart(down_s)

    def wait_shards_up(self, bookie: LocalBookie, timeout_s: float = 60.0) -> None:
        """Until every shard port of the bookie accepts connections."""
        deadline = time.monotonic() + timeout_s
        for i in range(self.shards):
            while True:
                try:
                    with socket.create_connection((bookie.address, bookie.port + i), timeout=0.5):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"shard {i} of {bookie.bookie_id} not up:\n{bookie.log_tail()}")
                    time.sleep(0.05)

    def restart_bookie(self, bookie: LocalBookie) -> None:
        if bookie.pid:
            bookie.stop()
        bookie.start()
        self.wait_registered([bookie])

    def stop(self) -> None:
        """Stop every bookie (kill -9 if a graceful stop fails or is interrupted), then ZooKeeper."""
        try:
            for b in self.bookies:
                try:
                    b.stop()
                except BaseException:
                    b.kill()
                    raise
        finally:
            for b in self.bookies:
                b.kill()
            self.zk.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
