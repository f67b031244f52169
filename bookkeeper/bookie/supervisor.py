"""The bookie supervisor: cookie check, one shard process per core, registration, admin HTTP.

Lives in: the bookie's main process (`bk bookie --conf F`). It holds no ledger data.

Cookie: a bookie id owns its directories. The cookie (bookie id, instance id,
directories, shard count) is written to ZooKeeper and into every directory on
first start; afterwards a missing or different local cookie (wiped or swapped
disks) or a shard count change makes the bookie refuse to start under that id,
naming the mismatch, rather than serve with lost data.

Registration: once every shard answers on its port, the supervisor creates the
ephemeral znode listing all shard addresses; a stale one from a killed
predecessor is taken over. A shard that dies is restarted on the same port. Once
registered it tells systemd READY=1 (a Type=notify unit, sdnotify.py), and STOPPING=1
when a graceful stop begins.

Maintenance switch: an operator can switch the bookie read-only
(PUT /api/v1/bookie/state/readonly); the switch is kept in READONLY_FILE in the journal
dir, next to the cookie, so a restart keeps it until it is switched back.
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
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from bookkeeper.bookie import control
from bookkeeper.bookie.admin import start_admin_http
from bookkeeper.bookie.files import write_atomic
from bookkeeper.bookie.journal.syncer import probe_io_uring
from bookkeeper.bookie.sdnotify import sd_notify
from bookkeeper.bookie.state import READONLY, WRITABLE, DirState, bookie_state, measure_dir, next_dir_state
from bookkeeper.config import BookieConfig
from bookkeeper.errors import BKError, BookieStartError, CookieMismatchError, ZooKeeperUnreachableError
from bookkeeper.meta.zk import ZkMetadataStore
from bookkeeper.meta.zk_security import zk_security_from
from bookkeeper.procs import module_command
from bookkeeper.testing_switches import switches_from_env, warn_switches

log = logging.getLogger("bookkeeper.supervisor")
COOKIE_FILE = "COOKIE"
COOKIE_VERSION = 1
READONLY_FILE = "READONLY"  # the operator's maintenance switch, JSON {"readonly": bool, "changed_ms": N}
SHARD_START_TIMEOUT_S = 120.0
# A bookie started while ZooKeeper is down (a host booting before its ZooKeeper) keeps trying
# this long, backing off, before it gives up: a service manager that sees an exit within a
# second marks the service failed for good (supervisord's startsecs), and the operator who
# typed a wrong address still hears about it within a minute, with each attempt's reason.
ZK_START_WAIT_S = 60.0
ZK_START_RETRY_MAX_S = 8.0
FAILED_SHARD_RESTART_S = 5.0  # a shard whose journal failed is restarted this long after, once its disk has room


def start_autorecovery(cfg: BookieConfig) -> Any:
    """The auditor candidate and a replication worker inside this bookie (autorecovery = true)."""
    from bookkeeper.autorecovery import AutoRecoveryService
    from bookkeeper.autorecovery.service import bookie_client_trust

    service = AutoRecoveryService(cfg.metadata_uri, lost_bookie_delay_s=cfg.lost_bookie_delay_s,
                                  open_ledger_rereplication_grace_s=cfg.open_ledger_rereplication_grace_s,
                                  audit_interval_s=cfg.audit_interval_s, bookie_id=cfg.id,
                                  client_kwargs=bookie_client_trust(cfg))
    service.start()
    return service


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


def load_readonly_switch(directory: str | os.PathLike[str]) -> bool:
    """The operator's maintenance switch as persisted in the bookie's journal dir: off when it
    was never set. A file that cannot be read keeps the bookie read-only (said in the log):
    an operator meant something, and writable is the state that can do harm."""
    path = Path(directory) / READONLY_FILE
    try:
        value = json.loads(path.read_text())["readonly"]
    except FileNotFoundError:
        return False
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.error("maintenance switch %s unreadable (%s): read-only until an operator sets it again", path, e)
        return True
    if not isinstance(value, bool):
        log.error("maintenance switch %s holds %r, not a bool: read-only until an operator sets it again",
                  path, value)
        return True
    return value


def save_readonly_switch(directory: str | os.PathLike[str], on: bool) -> None:
    """Persist the maintenance switch (atomically: a crash leaves the old value or the new)."""
    data = json.dumps({"readonly": on, "changed_ms": int(time.time() * 1000)}).encode()
    write_atomic(Path(directory) / READONLY_FILE, data)


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
            raise BookieStartError(f"directory {d} is in use by another running bookie") from None
        fds.append(fd)
    return fds



def connect_at_start(cfg: BookieConfig, *, wait_s: float = ZK_START_WAIT_S,
                     clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep) -> ZkMetadataStore:
    """The bookie's ZooKeeper session, retried with back-off for up to wait_s while no server
    can be reached (each attempt's reason logged); the last attempt's error after that."""
    deadline, delay = clock() + wait_s, 1.0
    while True:
        try:
            return ZkMetadataStore(cfg.metadata_uri, session_timeout_ms=cfg.zk_session_timeout_ms,
                                   security=zk_security_from(cfg))
        except ZooKeeperUnreachableError as e:
            if clock() + delay > deadline:
                raise
            log.warning("%s; trying again in %.0f s", e, delay)
            sleep(delay)
            delay = min(delay * 2, ZK_START_RETRY_MAX_S)

class Supervisor:
    """Runs the shard processes of one bookie, keeps its registration and its state."""

    def __init__(self, cfg: BookieConfig, *, parent_pid: int = 0) -> None:
        self.cfg = cfg
        self.parent_pid = parent_pid  # stop when this process is gone (0: never)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.restarts = 0
        self._stop = threading.Event()
        self._wake = threading.Event()  # re-evaluate the state now (a shard failed, a marker moved)
        self._reg_lock = threading.Lock()  # registration moves: monitor thread and ZooKeeper listener
        self.store: ZkMetadataStore | None = None
        self.state, self.reason = WRITABLE, None
        self._registered_readonly: bool | None = None
        self._registration_failed = False  # the last attempt failed: the next check tries again
        self._shard_states: dict[int, str | None] = {}  # as each shard reported it at the last check
        self._decommissioning = False
        self.manual_readonly = False  # the operator's maintenance switch (loaded in run())
        self._eval_lock = threading.Lock()  # _evaluate: the monitor thread and an operator's switch
        self._ready_notified = False
        self.dirs = [DirState(str(Path(cfg.journal_dir).resolve()), "journal"),
                     *(DirState(str(Path(d).resolve()), "ledger") for d in cfg.ledger_dirs)]
        self.failed_shards: dict[int, str] = {}
        self._failed_since: dict[int, float] = {}
        self.autorecovery: Any = None
        # Test-only switches (bookkeeper/testing_switches.py): an unknown name stops the bookie
        # here, before it locks a directory or connects; the shards inherit the environment.
        self.test_switches = switches_from_env()

    def _spawn(self, index: int) -> subprocess.Popen[bytes]:
        """Start shard `index`; its configuration goes through its stdin, never its command line:
        the config holds secrets (zk_auth, auth_token) and any local user reads a command line."""
        cmd = module_command("bookkeeper.bookie.shard", "--index", str(index), "--parent-pid", str(os.getpid()))
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdin is not None
        with proc.stdin:
            proc.stdin.write(json.dumps(self.cfg.to_dict()).encode())
        return proc

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
                        raise BookieStartError(f"shard {index} exited with code {proc.returncode} during start")
        raise BookieStartError(f"shard {index} was not ready within {SHARD_START_TIMEOUT_S}s")

    def registration(self) -> dict[str, Any]:
        return {"bookie_id": self.cfg.id, "rack": self.cfg.rack, "readonly": self.state == READONLY,
                "shards": [{"host": self.cfg.address, "port": self.cfg.port_of_shard(i)}
                           for i in range(self.cfg.shards)], "http_port": self.cfg.http_port, "pid": os.getpid()}

    def run(self) -> int:
        cfg = self.cfg
        warn_switches(log, self.test_switches, f"bookie {cfg.id}")
        locks = lock_directories(cfg)
        self.store = connect_at_start(cfg)
        http = None
        try:
            check_cookies(cfg, self.store)
            self.manual_readonly = load_readonly_switch(cfg.journal_dir)
            if self.manual_readonly:
                log.warning("bookie %s starts read-only: an operator's maintenance switch is on (%s)", cfg.id,
                            Path(cfg.journal_dir) / READONLY_FILE)
            self._choose_syncer()
            signal.signal(signal.SIGUSR1, lambda *_: self._wake.set())  # a shard failed: look now
            for i in range(cfg.shards):
                self.procs[i] = self._spawn(i)
            for i in range(cfg.shards):
                self._wait_ready(i)
            http = start_admin_http(self) if cfg.http_port else None  # up before clients can find us
            self.store.zk.DataWatch(self.store.decommissioning_path(cfg.id), self._on_decommission_marker)
            self._evaluate()  # measures the disks and registers (read-only if they are full)
            self.store.zk.add_listener(self._on_zk_state)
            if cfg.autorecovery:
                self.autorecovery = start_autorecovery(cfg)
            log.info("bookie %s up: %d shard(s) on ports %s, %s", cfg.id, cfg.shards,
                     [cfg.port_of_shard(i) for i in range(cfg.shards)], self.state)
            print(f"BOOKIE READY {cfg.id}", flush=True)
            self._monitor()
            return 0
        finally:
            if self.autorecovery is not None:
                self.autorecovery.stop()
            if http is not None:
                http.shutdown()
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

    # -- state: writable or read-only --------------------------------------------
    def _on_decommission_marker(self, data: bytes | None, stat: Any) -> None:
        self._decommissioning = stat is not None
        self._wake.set()

    def _measure_disks(self) -> None:
        cfg = self.cfg
        for i, prev in enumerate(self.dirs):
            try:  # the journal's pool counts as free: the shards give it back (state.journal_space)
                usage = measure_dir(prev.path, prev.kind, warn=cfg.disk_usage_warn, lwm=cfg.disk_usage_lwm).usage
            except OSError as e:  # the disk is gone: as good as full
                log.error("cannot measure %s dir %s: %s", prev.kind, prev.path, e)
                usage = 1.0
            now = next_dir_state(prev, usage, warn=cfg.disk_usage_warn, threshold=cfg.disk_usage_threshold,
                                 lwm=cfg.disk_usage_lwm)
            if now.warned and not prev.warned:
                log.warning("%s dir %s is %.0f%% full (warning at %.0f%%)", now.kind, now.path, usage * 100,
                            cfg.disk_usage_warn * 100)
            if now.full != prev.full:
                log.warning("%s dir %s is %.0f%% full: %s", now.kind, now.path, usage * 100,
                            "full (read-only threshold)" if now.full else "usable again (under the low-water mark)")
            self.dirs[i] = now

    def _poll_shards(self) -> None:
        """Which shards failed (their journal), and restart a failed one once its disk has room."""
        self._shard_states = {}
        for i in list(self.procs):
            try:
                st = control.call(control.socket_name(os.getpid(), i), {"op": "stats"}, timeout_s=2.0)
            except (OSError, ValueError):
                continue  # restarting, or busy: its exit is seen by the monitor
            self._shard_states[i] = st.get("state")
            if st.get("failed"):
                self.failed_shards[i] = st["failed"]
                self._failed_since.setdefault(i, time.monotonic())
            else:
                self.failed_shards.pop(i, None)
                self._failed_since.pop(i, None)
        journal_full = any(d.full for d in self.dirs if d.kind == "journal")
        for i, since in list(self._failed_since.items()):
            if not journal_full and time.monotonic() - since > FAILED_SHARD_RESTART_S and self.procs[i].poll() is None:
                log.warning("shard %d failed (%s): restarting it", i, self.failed_shards[i])
                self.procs[i].terminate()  # drains and checkpoints; the monitor starts it again
                del self._failed_since[i]

    def _evaluate(self) -> None:
        """Measure, decide (state.bookie_state) and, on a change, move shards and registration.
        Serialized: the monitor thread and an operator's switch (admin HTTP thread) both call it."""
        with self._eval_lock:
            self._measure_disks()
            self._poll_shards()
            state, reason = bookie_state(forced=self.cfg.readonly, decommissioning=self._decommissioning,
                                         dirs=self.dirs, failed_shards=self.failed_shards,
                                         manual=self.manual_readonly)
            changed = (state, reason) != (self.state, self.reason)
            self.state, self.reason = state, reason
            # A shard may have turned itself read-only (its journal dir filled between two checks):
            # the bookie's state is the supervisor's to decide, and every shard follows it.
            out_of_step = any(s != state for s in self._shard_states.values())
            if changed or out_of_step:
                if changed:
                    log.warning("bookie %s is now %s%s", self.cfg.id, state, f": {reason}" if reason else "")
                self._tell_shards()
            if changed or self._registered_readonly is None or self._registration_failed:
                self._register()
            if changed and self._ready_notified:
                sd_notify(f"STATUS={self._status_line()}")
            self._notify_ready()

    def _status_line(self) -> str:
        return f"{self.cfg.id} {self.state}" + (f": {self.reason}" if self.reason else "")

    def _notify_ready(self) -> None:
        """READY=1 to systemd once, when the bookie is first registered (its shards all serve by then)."""
        if self._ready_notified or self._registered_readonly is None or self._registration_failed:
            return
        self._ready_notified = True
        sd_notify(f"READY=1\nSTATUS={self._status_line()}")

    def set_readonly_switch(self, on: bool) -> None:
        """The operator's maintenance switch: persisted first (a restart keeps it), then in force
        (shards and registration follow before this returns). The bookie is writable only when
        neither the switch nor any other rule (a full disk, ...) holds it read-only."""
        save_readonly_switch(self.cfg.journal_dir, on)
        if on != self.manual_readonly:
            log.warning("bookie %s: maintenance switch %s by an operator", self.cfg.id, "on" if on else "off")
        self.manual_readonly = on
        self._evaluate()

    def readiness(self) -> str | None:
        """None when the bookie is registered in ZooKeeper and every shard serves; else why not
        (/api/v1/bookie/is_ready, for probes and deploy tools)."""
        if self._stop.is_set():
            return "stopping"
        registered_readonly = self._registered_readonly
        if registered_readonly is None or self._registration_failed or self.store is None:
            return "not registered in ZooKeeper yet"
        down = sorted(i for i, p in self.procs.items() if p.poll() is not None)
        if down:
            return f"shard(s) {down} not running"
        silent = sorted(set(self.procs) - set(self.shard_call({"op": "stats"}, timeout_s=2.0)))
        if silent:
            return f"shard(s) {silent} not answering"
        try:
            listed = self.cfg.id in self.store.bookie_ids(readonly=registered_readonly)
        except Exception as e:  # kazoo's errors have no common root worth naming here
            return f"ZooKeeper not answering: {type(e).__name__}: {e}"
        return None if listed else "registration missing in ZooKeeper (session lost?)"

    def _tell_shards(self) -> None:
        for i in list(self.procs):
            try:
                control.call(control.socket_name(os.getpid(), i),
                             {"op": "readonly", "on": self.state == READONLY, "reason": self.reason}, timeout_s=5.0)
            except (OSError, ValueError) as e:
                log.warning("shard %d: could not set its state (%s); it gets it once back", i, e)

    def _register(self) -> None:
        """Registration under available/ or available/readonly/ as the state says: the new one
        first, then the old one removed, so the bookie is never missing from both."""
        assert self.store is not None
        readonly = self.state == READONLY
        with self._reg_lock:
            try:
                self.store.register_bookie(self.cfg.id, self.registration(), readonly=readonly)
                if self._registered_readonly is not None and self._registered_readonly != readonly:
                    self.store.unregister_bookie(self.cfg.id, readonly=self._registered_readonly)
                self._registered_readonly = readonly
                self._registration_failed = False
            except Exception:
                self._registration_failed = True
                log.exception("registration as %s failed: retried at the next check", self.state)

    def _on_zk_state(self, state: str) -> None:
        if state == "CONNECTED" and self.store is not None and not self._stop.is_set():
            # After a session loss the ephemeral registration is gone: put it back.
            threading.Thread(target=self._register, daemon=True).start()

    def _monitor(self) -> None:
        next_check = time.monotonic() + self.cfg.disk_check_interval_s
        while not self._stop.is_set():
            woken = self._wake.wait(0.2)
            self._wake.clear()
            if self.parent_pid and os.getppid() != self.parent_pid:
                log.warning("parent process %d is gone: stopping", self.parent_pid)
                return
            for i, proc in list(self.procs.items()):
                if proc.poll() is not None and not self._stop.is_set():
                    self._restart_shard(i)
                    woken = True
            if woken or time.monotonic() >= next_check:
                # A failed shard (its restart waits on its disk) or a failed registration is
                # looked at every second; otherwise every disk_check_interval_s.
                self._evaluate()
                soon = self.failed_shards or self._registration_failed
                next_check = time.monotonic() + (1.0 if soon else self.cfg.disk_check_interval_s)

    def _restart_shard(self, index: int) -> None:
        log.warning("shard %d exited (code %s): restarting", index, self.procs[index].returncode)
        self.restarts += 1
        time.sleep(min(2.0, 0.1 * self.restarts))
        self.procs[index] = self._spawn(index)
        try:
            self._wait_ready(index)
        except BKError as e:
            log.error("%s", e)
            return
        self.failed_shards.pop(index, None)
        self._failed_since.pop(index, None)
        try:
            control.call(control.socket_name(os.getpid(), index),
                         {"op": "readonly", "on": self.state == READONLY, "reason": self.reason}, timeout_s=5.0)
        except (OSError, ValueError) as e:
            log.warning("shard %d: could not set its state (%s)", index, e)

    def stop(self, *_: Any) -> None:
        self._stop.set()
        self._wake.set()

    def _shutdown(self) -> None:
        self._stop.set()
        sd_notify("STOPPING=1")
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
                if self.store.connected and self._registered_readonly is not None:
                    self.store.unregister_bookie(self.cfg.id, readonly=self._registered_readonly)
            except Exception as e:  # ZooKeeper gone: the ephemeral node dies with the session anyway
                log.warning("could not unregister from ZooKeeper: %s", e)
            finally:
                self.store.close()

    # -- what the admin endpoints serve ------------------------------------------
    def shard_call(self, request: dict[str, Any], *, timeout_s: float = 5.0,
                   shards: Iterable[int] | None = None) -> dict[int, dict[str, Any]]:
        """Ask every running shard (or those of `shards` that run) at once; shards that cannot
        answer are left out."""
        out: dict[int, dict[str, Any]] = {}

        def one(i: int) -> None:
            try:
                out[i] = control.call(control.socket_name(os.getpid(), i), request, timeout_s=timeout_s)
            except (OSError, ValueError) as e:
                log.warning("shard %d did not answer %s: %s", i, request.get("op"), e)

        asked = list(self.procs) if shards is None else [i for i in shards if i in self.procs]
        threads = [threading.Thread(target=one, args=(i,)) for i in asked]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out


def run_bookie(cfg: BookieConfig) -> int:
    """Run a bookie in the foreground until SIGTERM/SIGINT.

    BK_PARENT_PID (set by bookkeeper.testing): stop gracefully when that process dies, so a
    killed test run or sandbox never leaves bookies behind.
    """
    sup = Supervisor(cfg, parent_pid=int(os.environ.get("BK_PARENT_PID", "0") or 0))
    signal.signal(signal.SIGTERM, sup.stop)
    signal.signal(signal.SIGINT, sup.stop)
    return sup.run()
