"""The bookie supervisor: cookie check, one shard process per core, registration, admin HTTP.

Lives in: the bookie's main process (`bk bookie --conf F`). It holds no ledger data.

Cookie: a bookie id owns its directories. The cookie (bookie id, instance id,
directories, shard count) is written to ZooKeeper and into every directory on
first start; afterwards a missing or different local cookie (wiped or swapped
disks) or a shard count change makes the bookie refuse to start under that id,
naming the mismatch, rather than serve with lost data.

Registration: once every shard answers on its port, the supervisor creates the
ephemeral znode listing all shard addresses; a stale one from a killed
predecessor is taken over. A shard that dies is restarted on the same port.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import selectors
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from bookkeeper.bookie.journal.syncer import probe_io_uring
from bookkeeper.config import BookieConfig
from bookkeeper.errors import BKError, CookieMismatchError
from bookkeeper.meta.zk import ZkMetadataStore
from bookkeeper.procs import module_command

log = logging.getLogger("bookkeeper.supervisor")
COOKIE_FILE = "COOKIE"
COOKIE_VERSION = 1
SHARD_START_TIMEOUT_S = 120.0


def expected_cookie(cfg: BookieConfig, instance_id: str) -> dict[str, Any]:
    return {"cookie_version": COOKIE_VERSION, "bookie_id": cfg.id, "instance_id": instance_id,
            "journal_dir": str(Path(cfg.journal_dir).resolve()),
            "ledger_dirs": [str(Path(d).resolve()) for d in cfg.ledger_dirs], "shards": cfg.shards}


def check_cookies(cfg: BookieConfig, store: ZkMetadataStore) -> None:
    """Verify (or, on a brand-new bookie, write) the cookie in ZooKeeper and in every directory."""
    want = expected_cookie(cfg, store.instance_id())
    dirs = [Path(cfg.journal_dir), *map(Path, cfg.ledger_dirs)]
    registered = store.get_cookie(cfg.id)
    local = {}
    for d in dirs:
        f = d / COOKIE_FILE
        local[d] = json.loads(f.read_text()) if f.exists() else None
    if registered is None:
        # Local cookies equal to ours and none in ZooKeeper: a first start that stopped between
        # the two writes. Anything else local (another cluster, another id) is refused.
        if any(c is not None and c != want for c in local.values()):
            raise CookieMismatchError(
                f"cookie mismatch for bookie {cfg.id}: directories carry a cookie but ZooKeeper has none "
                f"(another cluster's disks?)")
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            (d / COOKIE_FILE).write_text(json.dumps(want, sort_keys=True))
        store.create_cookie(cfg.id, want)
        log.info("new bookie %s: cookie written", cfg.id)
        return
    cookie, _ = registered
    for key in ("bookie_id", "instance_id", "journal_dir", "ledger_dirs", "shards"):
        if cookie.get(key) != want[key]:
            raise CookieMismatchError(f"cookie mismatch for bookie {cfg.id}: {key} is {want[key]!r} here "
                                      f"but {cookie.get(key)!r} in the registered cookie")
    for d, c in local.items():
        if c != cookie:
            raise CookieMismatchError(f"cookie mismatch for bookie {cfg.id}: directory {d} "
                                      f"{'has no cookie (wiped?)' if c is None else 'carries a different cookie (swapped?)'}")


def lock_directories(cfg: BookieConfig) -> list[int]:
    """Hold an exclusive lock on every directory for the bookie's life (released when the
    process dies, however it dies): a second copy of a running bookie refuses to start
    instead of replaying, and trimming, the journal under the first one."""
    fds = []
    for d in [Path(cfg.journal_dir), *map(Path, cfg.ledger_dirs)]:
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            for f in fds:
                os.close(f)
            raise BKError(f"directory {d} is in use by another running bookie") from None
        fds.append(fd)
    return fds


class Supervisor:
    """Runs the shard processes of one bookie and keeps its registration."""

    def __init__(self, cfg: BookieConfig, *, parent_pid: int = 0) -> None:
        self.cfg = cfg
        self.parent_pid = parent_pid  # stop when this process is gone (0: never)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.restarts = 0
        self._stop = threading.Event()
        self.store: ZkMetadataStore | None = None

    def _spawn(self, index: int) -> subprocess.Popen[bytes]:
        cmd = module_command("bookkeeper.bookie.shard", "--index", str(index), "--parent-pid", str(os.getpid()),
                             "--config-json", json.dumps(self.cfg.to_dict()))
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)

    def _wait_ready(self, index: int) -> None:
        """Until the shard itself says READY (its replay done, its port bound): a port answered
        by some other process does not count."""
        proc = self.procs[index]
        assert proc.stdout is not None
        deadline = time.monotonic() + SHARD_START_TIMEOUT_S
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if sel.select(timeout=0.2):
                    line = proc.stdout.readline()
                    if line.startswith(b"READY"):
                        return
                    if not line:
                        proc.wait()
                        raise BKError(f"shard {index} exited with code {proc.returncode} during start")
        raise BKError(f"shard {index} was not ready within {SHARD_START_TIMEOUT_S}s")

    def registration(self) -> dict[str, Any]:
        return {"bookie_id": self.cfg.id, "rack": self.cfg.rack, "readonly": self.cfg.readonly,
                "shards": [{"host": self.cfg.address, "port": self.cfg.port_of_shard(i)}
                           for i in range(self.cfg.shards)], "pid": os.getpid()}

    def run(self) -> int:
        cfg = self.cfg
        locks = lock_directories(cfg)
        self.store = ZkMetadataStore(cfg.metadata_uri, session_timeout_ms=cfg.zk_session_timeout_ms)
        try:
            check_cookies(cfg, self.store)
            self._choose_syncer()
            for i in range(cfg.shards):
                self.procs[i] = self._spawn(i)
            for i in range(cfg.shards):
                self._wait_ready(i)
            http = self._start_http() if cfg.http_port else None  # up before clients can find us
            self.store.register_bookie(cfg.id, self.registration(), readonly=cfg.readonly)
            self.store.zk.add_listener(self._on_zk_state)
            log.info("bookie %s up: %d shard(s) on ports %s", cfg.id, cfg.shards,
                     [cfg.port_of_shard(i) for i in range(cfg.shards)])
            print(f"BOOKIE READY {cfg.id}", flush=True)
            self._monitor()
            if http is not None:
                http.shutdown()
            return 0
        finally:
            self._shutdown()
            for fd in locks:
                os.close(fd)

    def _choose_syncer(self) -> None:
        """io_uring only where a child process could use it: otherwise every shard gets the
        thread syncer, said once here (not once per shard, nor as a crashing shard)."""
        if self.cfg.journal_sync != "io_uring":
            return
        reason = probe_io_uring(self.cfg.journal_dir)
        if reason is not None:
            log.warning("io_uring unavailable (%s): journal falls back to thread-based fdatasync", reason)
            self.cfg = dataclasses.replace(self.cfg, journal_sync="thread")

    def _on_zk_state(self, state: str) -> None:
        if state == "CONNECTED" and self.store is not None and not self._stop.is_set():
            # After a session loss the ephemeral registration is gone: put it back.
            threading.Thread(target=self._reregister, daemon=True).start()

    def _reregister(self) -> None:
        try:
            assert self.store is not None
            self.store.register_bookie(self.cfg.id, self.registration(), readonly=self.cfg.readonly)
        except Exception:
            log.exception("re-registration failed")

    def _monitor(self) -> None:
        while not self._stop.wait(0.2):
            if self.parent_pid and os.getppid() != self.parent_pid:
                log.warning("parent process %d is gone: stopping", self.parent_pid)
                return
            for i, proc in list(self.procs.items()):
                if proc.poll() is not None:
                    log.warning("shard %d exited (code %s): restarting", i, proc.returncode)
                    self.restarts += 1
                    time.sleep(min(2.0, 0.1 * self.restarts))
                    self.procs[i] = self._spawn(i)
                    try:
                        self._wait_ready(i)
                    except BKError as e:
                        log.error("%s", e)

    def stop(self, *_: Any) -> None:
        self._stop.set()

    def _shutdown(self) -> None:
        self._stop.set()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.store is not None:
            try:
                if self.store.connected:
                    self.store.unregister_bookie(self.cfg.id, readonly=self.cfg.readonly)
            except Exception as e:  # ZooKeeper gone: the ephemeral node dies with the session anyway
                log.warning("could not unregister from ZooKeeper: %s", e)
            finally:
                self.store.close()

    def _start_http(self) -> Any:
        """Admin HTTP: /heartbeat and Prometheus /metrics, on a daemon thread."""
        from prometheus_client import CollectorRegistry, Gauge, make_wsgi_app

        registry = CollectorRegistry()
        up = Gauge("bookie_shards_up", "shard processes running", registry=registry)
        restarts = Gauge("bookie_shard_restarts", "shard restarts since start", registry=registry)
        metrics = make_wsgi_app(registry)

        def app(environ: dict[str, Any], start_response: Any) -> Any:
            up.set(sum(1 for p in self.procs.values() if p.poll() is None))
            restarts.set(self.restarts)
            if environ.get("PATH_INFO") == "/heartbeat":
                start_response("200 OK", [("Content-Type", "text/plain")])
                return [b"OK\n"]
            return metrics(environ, start_response)

        class Quiet(WSGIRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

        server = make_server(self.cfg.bind_address or "0.0.0.0", self.cfg.http_port, app, handler_class=Quiet)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


def run_bookie(cfg: BookieConfig) -> int:
    """Run a bookie in the foreground until SIGTERM/SIGINT.

    BK_PARENT_PID (set by bookkeeper.testing): stop gracefully when that process dies, so a
    killed test run or sandbox never leaves bookies behind.
    """
    sup = Supervisor(cfg, parent_pid=int(os.environ.get("BK_PARENT_PID", "0") or 0))
    signal.signal(signal.SIGTERM, sup.stop)
    signal.signal(signal.SIGINT, sup.stop)
    return sup.run()
