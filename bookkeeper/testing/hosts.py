"""Test hosts: network namespaces on one bridge, each with its own address, files and sshd.

Design note
-----------
Multi-host tests (Ansible over SSH, a ZooKeeper quorum, Spark standalone, partitions) need
hosts that are real to everything above the kernel, yet must leave nothing on the machine and
must not touch its network. ``TestHosts`` makes them out of namespaces:

* **Network.** One network namespace per host, ``<prefix>-<name>`` (``ip netns add``), and one
  more, ``<prefix>-br``, holding the bridge ``br0``. Each host's veth pair is created inside the
  bridge's namespace with its peer sent straight into the host's namespace as ``eth0``, so no
  interface ever appears in the root namespace. The host's address is in a /24 of
  ``10.213.0.0/16`` that no live run uses (chosen under a file lock, so concurrent pytest-xdist
  workers get distinct subnets); that /24 exists only inside the run's namespaces. Hosts get
  .1, .2, ... in the order of their names; .254 is the bridge, their default route, which has
  nowhere further to send a packet (anything for elsewhere is "network unreachable" at once).
  Each host has its own loopback, up.
* **Files.** Each host has a persistent mount namespace (``unshare --mount=<file>``; the file is
  under ``/run/bk-test-hosts/mnt``, which is bind-mounted onto itself and made private once, as
  the kernel requires for a namespace file) in which every ``private_paths`` entry is
  bind-mounted from ``workdir/<name>/<path>``: hosts writing ``/srv/...`` never see each other's
  files. A private path missing on the machine is created (``mkdir -p``) first. The workdir, the
  Python the hosts run (its venv and base prefix) and the source tree stay visible at their own
  paths on every host, even when they lie under a private path such as ``/tmp`` (a checkout in
  /tmp, pytest's tmp dirs), so the fixture's key and ssh_config, a test's artefacts and the
  programs can be passed by path, like a shared file system. The netns files copied into a new mount namespace are unmounted in
  it, so a host never pins another run's namespaces.
* **Names.** Each host has a UTS namespace whose hostname is its name, and an ``/etc/hosts``
  (bound from ``workdir/_hosts/etc_hosts``) naming every host with its address, so software
  that asks "who am I" or resolves a peer by name gets the test addresses. root's shell rc
  files (``/root/.bashrc``...) are replaced by a plain one on the hosts: a fresh machine's
  root, not the developer's (whose pyenv rehash would run, and lock, for every ssh command).
* **Processes.** ``Host.run`` / ``Host.popen`` run argv under ``nsenter --net --mount --uts``;
  ``/usr/bin/python3`` and the venv are the machine's (shared file system). ``Host.pids`` is
  every process in the host's network namespace (``ip netns pids``).
* **SSH.** Each host runs Debian's ``sshd`` on port 22 of its address (its own config, host keys
  made once per run, ``AuthorizedKeysFile`` the fixture's public key, root by key only).
  ``TestHosts.ssh_config`` names every host by name, so ``ssh -F <ssh_config> zk1 true`` works
  from any host: Ansible's controller runs inside one of them (e.g. a host named ``ctl``) and
  all its traffic stays between the namespaces.
* **Faults.** ``Host.partition("drop" | "reset", peers)`` loads an nftables table ``inet bktest``
  in the host's namespace dropping (or rejecting with a TCP reset, ICMP for the rest) every
  packet to and from the peers' addresses; the host's own loopback is untouched. ``Host.heal``
  deletes the table. ``Host.kill_processes`` signals every process of the host except, when
  asked, its sshd (listener and session processes): "stop the host's processes".
* **Cleanup.** ``stop()`` kills every process of every host namespace (SIGTERM, then SIGKILL
  after a short grace), unmounts the mount namespace files, deletes the namespaces and the state
  file; it is idempotent and registered with ``atexit``. A run writes its owner pid (and that
  process's start time, against pid reuse) to ``/run/bk-test-hosts/<prefix>.json`` BEFORE it
  makes anything, so a run killed at any point is found and removed by the next ``start()``.
  For humans: ``python -m bookkeeper.testing.hosts --cleanup`` removes every stale run.

``namespaces_unavailable()`` says in one line why none of this can run here (not root, a tool
missing, a namespace cannot be made); test modules skip with it.

Only the standard library is used.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import fcntl
import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["Host", "HostsError", "TestHosts", "cleanup_stale", "namespaces_unavailable", "partition_ruleset"]

STATE_DIR = Path("/run/bk-test-hosts")
MOUNT_DIR = STATE_DIR / "mnt"  # persistent mount-namespace files: must sit on a private mount
NETNS_DIR = Path("/run/netns")
SUBNET_BASE = "10.213"  # the run takes 10.213.N.0/24 for a free N
BRIDGE = "br0"
SSHD = "/usr/sbin/sshd"
NFT_TABLE = "bktest"
TERM_GRACE_S = 2.0  # SIGTERM, then SIGKILL after this long
ENTER_WAIT_S = 10.0  # nsenter's setns takes microseconds; only a stuck machine takes this
KILL_WAIT_S = 10.0  # then the namespaces are deleted whatever still runs (it dies with them)
TOOLS = ("ip", "nsenter", "unshare", "nft", "ssh", "ssh-keygen", "mount", "umount")
PARTITION_MODES = ("drop", "reset")
# What every host shares with the machine: the system, and where the fixture keeps its state.
SYSTEM_DIRS = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/proc", "/sys", "/dev", "/run")


_RUN_NUMBERS = itertools.count()  # this process's runs


class HostsError(RuntimeError):
    """A test-hosts operation failed (a namespace, mount or sshd could not be set up)."""


def _sh(argv: list[str], *, check: bool = True, input: str | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run a root-namespace setup command; a failure names the command and its stderr."""
    proc = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=timeout)
    if check and proc.returncode != 0:
        raise HostsError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def namespaces_unavailable() -> str | None:
    """None when test hosts can be made here; else one line saying why (a skip reason)."""
    if os.geteuid() != 0:
        return "test hosts need root (network and mount namespaces, nftables)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if not os.access(SSHD, os.X_OK):
        missing.append(SSHD)
    if missing:
        return f"test hosts need {', '.join(missing)} (make installs openssh-server, nftables, iproute2)"
    probe = f"bkprobe{os.getpid()}"
    made = _sh(["ip", "netns", "add", probe], check=False)
    _sh(["ip", "netns", "delete", probe], check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    return None


# ---- state files and stale runs -------------------------------------------------------------

def _start_time(pid: int) -> str | None:
    """A process's start time (clock ticks since boot): tells a live owner from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _owner_alive(state: dict[str, object]) -> bool:
    """Whether the process that made a run still lives (same pid, same start time)."""
    pid = state.get("owner_pid")
    return isinstance(pid, int) and _start_time(pid) == state.get("owner_start")


def _read_states() -> list[tuple[Path, dict[str, object]]]:
    """Every run's state file; a half-written one counts as an empty state (stale)."""
    found = []
    for path in sorted(STATE_DIR.glob("*.json")):
        try:
            found.append((path, json.loads(path.read_text())))
        except (OSError, ValueError):
            found.append((path, {}))
    return found


class _Lock:
    """The machine-wide lock under which runs pick subnets and clean stale runs."""

    def __enter__(self) -> _Lock:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(STATE_DIR / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)


def _netns_pids(netns: str) -> list[int]:
    proc = _sh(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _kill_netns_processes(namespaces: list[str]) -> None:
    """SIGTERM every process of the namespaces, then SIGKILL what is left after a grace."""
    pids = [p for ns in namespaces for p in _netns_pids(ns)]
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_S
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = [p for ns in namespaces for p in _netns_pids(ns)]
    deadline = time.monotonic() + KILL_WAIT_S
    while pids and time.monotonic() < deadline:  # bounded: a process stuck in D state stays
        _signal_all(pids, signal.SIGKILL)
        time.sleep(0.05)
        pids = [p for ns in namespaces for p in _netns_pids(ns)]


def _remove_run(prefix: str) -> None:
    """Remove everything a run made: its processes, mount-ns files and namespaces.

    Found by the prefix, not from the state file, so that a run killed before it recorded a
    namespace leaves nothing either. The workdir is the caller's (evidence): it stays.
    """
    namespaces = [ns.name for ns in NETNS_DIR.glob(f"{prefix}-*")] if NETNS_DIR.is_dir() else []
    _kill_netns_processes(namespaces)
    for mnt in MOUNT_DIR.glob(f"{prefix}-*"):
        _sh(["umount", "--lazy", str(mnt)], check=False)
        mnt.unlink(missing_ok=True)
    for ns in namespaces:
        _sh(["ip", "netns", "delete", ns], check=False)
    for stash in STATE_DIR.glob(f"{prefix}-*.keep*"):  # left by a run killed mid-setup
        with contextlib.suppress(OSError):
            stash.rmdir()


def cleanup_stale() -> list[str]:
    """Remove every run whose owner process is dead; returns their prefixes."""
    removed = []
    with _Lock():
        for path, state in _read_states():
            if not _owner_alive(state):
                _remove_run(path.stem)
                path.unlink(missing_ok=True)
                removed.append(path.stem)
    return removed


def _free_subnet() -> int:
    """The N of a 10.213.N.0/24 no live run holds (the caller holds the lock)."""
    used = {state.get("subnet") for _, state in _read_states()}
    for n in range(256):
        if n not in used:
            return n
    raise HostsError("all 256 test-host subnets of 10.213.0.0/16 are in use")


def _ensure_private_mount_dir() -> None:
    """Make MOUNT_DIR a private mount: a mount-namespace file may not sit on a shared one."""
    MOUNT_DIR.mkdir(parents=True, exist_ok=True)
    if _sh(["mountpoint", "-q", str(MOUNT_DIR)], check=False).returncode != 0:
        _sh(["mount", "--bind", str(MOUNT_DIR), str(MOUNT_DIR)])
    _sh(["mount", "--make-private", str(MOUNT_DIR)])


# ---- hosts --------------------------------------------------------------------------------------

class Host:
    """One test host: a network namespace, a mount namespace, an address and an sshd."""

    def __init__(self, hosts: TestHosts, name: str, address: str) -> None:
        self.name = name
        self.address = address
        self._hosts = hosts
        self.netns = f"{hosts.prefix}-{name}"
        self.mount_file = MOUNT_DIR / self.netns
        self.uts_file = MOUNT_DIR / f"{self.netns}.uts"
        self.sshd: subprocess.Popen[Any] | None = None

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address!r})"

    def backing_dir(self, path: str | Path) -> Path:
        """The root-namespace directory behind a private path (or a path under one)."""
        path = Path(path)
        for private in self._hosts.private_paths:
            if path == Path(private) or Path(private) in path.parents:
                return self._hosts.workdir / self.name / path.relative_to("/")
        raise ValueError(f"{path} is not under a private path of {self.name} "
                         f"({', '.join(self._hosts.private_paths)})")

    def _enter(self, argv: list[str] | str, cwd: str | Path | None = None) -> list[str]:
        """argv wrapped to run inside this host's network, mount and UTS namespaces."""
        command = ["sh", "-c", argv] if isinstance(argv, str) else list(argv)
        # cd inside the host, where a private path is the host's own (nsenter's --wd would
        # resolve it in the root namespace, and --wdns is not in every util-linux).
        wd = ["sh", "-c", 'cd "$0" && exec "$@"', str(cwd)] if cwd is not None else []
        return ["nsenter", f"--net={NETNS_DIR / self.netns}", f"--mount={self.mount_file}",
                f"--uts={self.uts_file}", "--", *wd, *command]

    def run(self, argv: list[str] | str, *, check: bool = True, timeout: float = 120,
            env: dict[str, str] | None = None, input: str | None = None,
            cwd: str | Path | None = None) -> subprocess.CompletedProcess[str]:
        """Run a command on this host (a str through ``sh -c``) and capture its output."""
        proc = subprocess.run(self._enter(argv, cwd), capture_output=True, text=True,
                              timeout=timeout, env=env, input=input)
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, argv, proc.stdout, proc.stderr)
        return proc

    def popen(self, argv: list[str] | str, **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start a long-running process on this host; ``stop()`` kills it with the host.

        ``popen_kwargs`` are ``subprocess.Popen``'s; ``cwd`` is the directory inside the host.
        """
        cwd = popen_kwargs.pop("cwd", None)
        proc = subprocess.Popen(self._enter(argv, cwd), **popen_kwargs)
        self._wait_entered(proc)
        return proc

    def _wait_entered(self, proc: subprocess.Popen[Any]) -> None:
        """Return once the new process is in the host's namespace (or has already exited).

        Until nsenter has entered, the process is in the root namespace: ``pids()`` would
        miss it and ``stop()`` would not kill it.
        """
        netns_inode = os.stat(NETNS_DIR / self.netns).st_ino
        deadline = time.monotonic() + ENTER_WAIT_S
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if os.stat(f"/proc/{proc.pid}/ns/net").st_ino == netns_inode:
                    return
            except OSError:
                pass
            time.sleep(0.001)
        if proc.poll() is None:
            raise HostsError(f"{self.name}: process {proc.pid} did not enter the host in {ENTER_WAIT_S} s")

    def pids(self) -> list[int]:
        """Every process in this host's network namespace."""
        return _netns_pids(self.netns)

    def _sshd_pids(self) -> set[int]:
        """The sshd listener and its sshd descendants (session processes)."""
        if self.sshd is None or self.sshd.poll() is not None:
            return set()
        keep = {self.sshd.pid}
        children = _children()
        frontier = [self.sshd.pid]
        while frontier:
            for child in children.get(frontier.pop(), []):
                if _comm(child).startswith("sshd"):
                    keep.add(child)
                    frontier.append(child)
        return keep

    def kill_processes(self, sig: int = signal.SIGKILL, *, keep_sshd: bool = True) -> list[int]:
        """Signal every process of the host (a "stop the host's processes" fault).

        With ``keep_sshd`` the sshd listener and its session processes survive, so the host
        can still be reached to start things again; whatever those sessions run is signalled.
        Returns the pids signalled.
        """
        keep = self._sshd_pids() if keep_sshd else set()
        victims = [pid for pid in self.pids() if pid not in keep]
        _signal_all(victims, sig)
        return victims

    def partition(self, mode: str = "drop", peers: list[Host] | None = None) -> None:
        """Cut this host off from ``peers`` (default: every other host) with nftables."""
        targets = peers if peers is not None else [h for h in self._hosts if h is not self]
        if not targets:
            raise ValueError(f"{self.name}: no peers to partition from")
        self._nft(partition_ruleset(mode, [h.address for h in targets]))

    def heal(self) -> None:
        """Undo ``partition``: delete the nftables table (nothing happens if there is none)."""
        self._nft(f"table inet {NFT_TABLE}\ndelete table inet {NFT_TABLE}\n")

    def _nft(self, ruleset: str) -> None:
        self.run(["nft", "-f", "-"], input=ruleset, timeout=30)


def partition_ruleset(mode: str, peer_addresses: list[str]) -> str:
    """The nftables script that replaces the ``inet bktest`` table with a partition.

    "drop" silently drops every packet to or from the peers (connects time out both ways).
    "reset" rejects TCP with a reset and everything else with ICMP port-unreachable, so
    connects fail at once both ways; the rejects' own answers must get through: a peer's SYN
    is answered by a reset leaving on the output hook (let out), and a local connect's reset
    comes back over lo with the peer's address (input from lo passes, as does the host's own
    loopback). Declaring the table before deleting it makes the delete safe on a healed host;
    the whole script is one nft transaction.
    """
    if mode not in PARTITION_MODES:
        raise ValueError(f"partition mode must be one of {PARTITION_MODES}, not {mode!r}")
    peers = "{ " + ", ".join(peer_addresses) + " }"
    if mode == "drop":
        rules_in = [f"ip saddr {peers} drop"]
        rules_out = [f"ip daddr {peers} drop"]
    else:
        reject = ["meta l4proto tcp reject with tcp reset", "reject with icmpx type port-unreachable"]
        rules_in = ["iif lo accept", *(f"ip saddr {peers} {r}" for r in reject)]
        rules_out = [f"ip daddr {peers} tcp flags & rst == rst accept",
                     f"ip daddr {peers} icmp type destination-unreachable accept",
                     *(f"ip daddr {peers} {r}" for r in reject)]
    return (f"table inet {NFT_TABLE}\ndelete table inet {NFT_TABLE}\n"
            f"table inet {NFT_TABLE} {{\n"
            f"{_chain('input', rules_in)}{_chain('output', rules_out)}}}\n")


def _chain(hook: str, rules: list[str]) -> str:
    body = "".join(f"    {rule}\n" for rule in rules)
    return f"  chain {hook} {{\n    type filter hook {hook} priority 0; policy accept;\n{body}  }}\n"


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, for every process on the machine."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


# ---- the fixture -------------------------------------------------------------------------------

class TestHosts:
    """N test hosts on one bridge; a context manager (or ``start()`` / ``stop()``).

    ``workdir`` holds each host's private directories (``workdir/<name>/srv``...), the ssh key,
    ``ssh_config`` and sshd logs; it is visible at its own path on every host. Each entry of
    ``private_paths`` (absolute; created on the machine with ``mkdir -p`` if missing) is private
    per host.
    """

    __test__ = False  # a fixture, not a pytest test class

    def __init__(self, workdir: Path, names: list[str], *,
                 private_paths: tuple[str, ...] = ("/srv",)) -> None:
        _check_names(names)
        _check_private_paths(private_paths)
        self.workdir = Path(workdir).resolve()
        self.names = list(names)
        self.private_paths = tuple(private_paths)
        # Unique among live runs: a dead process's runs (its pid reused) go before we claim.
        self.prefix = f"bkt{os.getpid()}n{next(_RUN_NUMBERS)}"
        self.run_dir = self.workdir / "_hosts"
        self.ssh_key = self.run_dir / "id_ed25519"
        self.ssh_config = self.run_dir / "ssh_config"
        self.etc_hosts = self.run_dir / "etc_hosts"
        self.shell_rc = self.run_dir / "shell_rc"
        self._hosts: dict[str, Host] = {}
        self._started = False

    def __getitem__(self, name: str) -> Host:
        return self._hosts[name]

    def __iter__(self) -> Iterator[Host]:
        return iter(self._hosts.values())

    def __len__(self) -> int:
        return len(self._hosts)

    @property
    def state_file(self) -> Path:
        return STATE_DIR / f"{self.prefix}.json"

    def ssh_argv(self, host_name: str, command: str | list[str]) -> list[str]:
        """The ssh argv that runs ``command`` on a host (from inside any host)."""
        if host_name not in self._hosts:
            raise KeyError(f"no test host named {host_name!r}")
        remote = command if isinstance(command, str) else " ".join(map(shlex.quote, command))
        return ["ssh", "-F", str(self.ssh_config), host_name, remote]

    def __enter__(self) -> TestHosts:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> TestHosts:
        """Make the hosts; on any failure everything made so far is removed again."""
        if self._started:
            return self
        reason = namespaces_unavailable()
        if reason is not None:
            raise HostsError(reason)
        cleanup_stale()
        self._started = True
        atexit.register(self.stop)
        try:
            self._claim()
            self._make_keys()
            self._make_network()
            self._write_etc_hosts()
            for host in self:
                self._make_mounts(host)
            self._write_ssh_config()
            for host in self:
                self._start_sshd(host)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Remove every process, namespace, mount-ns file and the state file; idempotent."""
        if not self._started:
            return
        self._started = False
        atexit.unregister(self.stop)
        # No lock needed: while the state file names a live owner, no other run touches it.
        _remove_run(self.prefix)
        for host in self:  # reap the sshds we started (killed with everything else)
            if host.sshd is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.sshd.wait(timeout=KILL_WAIT_S)
        self.state_file.unlink(missing_ok=True)

    # -- setup steps --

    def _claim(self) -> None:
        """Pick a free subnet and record the run BEFORE making anything, under the lock."""
        with _Lock():
            _ensure_private_mount_dir()
            subnet = _free_subnet()
            state = {"owner_pid": os.getpid(), "owner_start": _start_time(os.getpid()),
                     "subnet": subnet, "names": self.names, "workdir": str(self.workdir)}
            tmp = self.state_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            tmp.rename(self.state_file)
        self.subnet = f"{SUBNET_BASE}.{subnet}.0/24"
        self.gateway = f"{SUBNET_BASE}.{subnet}.254"
        for i, name in enumerate(self.names):
            self._hosts[name] = Host(self, name, f"{SUBNET_BASE}.{subnet}.{i + 1}")

    def _make_keys(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for key in (self.ssh_key, self.run_dir / "ssh_host_ed25519_key"):
            if not key.exists():
                _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", self.prefix, "-f", str(key)])

    def _make_network(self) -> None:
        """The bridge's namespace, then each host's namespace wired to the bridge."""
        bridge_ns = f"{self.prefix}-br"
        _sh(["ip", "netns", "add", bridge_ns])
        _sh(["ip", "-n", bridge_ns, "link", "add", BRIDGE, "type", "bridge"])
        _sh(["ip", "-n", bridge_ns, "addr", "add", f"{self.gateway}/24", "dev", BRIDGE])
        _sh(["ip", "-n", bridge_ns, "link", "set", BRIDGE, "up"])
        # The hosts' gateway answers every packet for elsewhere at once with "network
        # unreachable". Left to routing it would drop them silently (no forwarding) or answer
        # a few a second (the kernel's fixed route-error limit): a host's DNS lookups (the
        # machine's resolv.conf) would wait seconds for timeouts. nft's reject, unlimited here.
        _sh(["nsenter", f"--net={NETNS_DIR / bridge_ns}", "--", "sysctl", "-q", "-w",
             "net.ipv4.icmp_ratelimit=0"])
        _sh(["nsenter", f"--net={NETNS_DIR / bridge_ns}", "--", "nft", "-f", "-"], input=(
            f"table inet {NFT_TABLE} {{\n  chain prerouting {{\n"
            f"    type filter hook prerouting priority 0; policy accept;\n"
            f"    ip daddr != {self.subnet} reject with icmpx type no-route\n  }}\n}}\n"))
        for i, host in enumerate(self):
            _sh(["ip", "netns", "add", host.netns])
            # Both ends are born in the bridge's namespace and eth0 goes straight to the host's:
            # nothing of the run ever appears in the root namespace.
            _sh(["ip", "-n", bridge_ns, "link", "add", f"v{i}", "type", "veth",
                 "peer", "name", "eth0", "netns", host.netns])
            _sh(["ip", "-n", bridge_ns, "link", "set", f"v{i}", "master", BRIDGE, "up"])
            _sh(["ip", "-n", host.netns, "link", "set", "lo", "up"])
            _sh(["ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0"])
            _sh(["ip", "-n", host.netns, "link", "set", "eth0", "up"])
            # A default route, as real hosts have (Ansible's ansible_default_ipv4 is the host's
            # address). The gateway is the bridge's namespace, which has nowhere to send a
            # packet for elsewhere: it answers "network unreachable" and nothing leaves the run.
            _sh(["ip", "-n", host.netns, "route", "add", "default", "via", self.gateway])

    def _write_etc_hosts(self) -> None:
        """The hosts' /etc/hosts: every host's name resolves to its address on every host.

        With each host's hostname its own name, what asks "who am I" (Java's getLocalHost,
        Spark's and ZooKeeper's defaults) finds the host's address, not the machine's.
        """
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback",
                 *(f"{h.address} {h.name}" for h in self)]
        self.etc_hosts.write_text("\n".join(lines) + "\n")
        self.shell_rc.write_text("# A test host's root shell: plain, whatever the machine's is.\n")

    def _make_mounts(self, host: Host) -> None:
        """Persistent mount and UTS namespaces: private paths, /etc/hosts and the hostname."""
        host.uts_file.touch()
        _sh(["unshare", f"--uts={host.uts_file}", "hostname", host.name])
        host.mount_file.touch()
        _sh(["unshare", f"--mount={host.mount_file}", "--propagation", "private", "true"])
        for private in self.private_paths:
            host.backing_dir(private).mkdir(parents=True, exist_ok=True)
            Path(private).mkdir(parents=True, exist_ok=True)
        _sh(["nsenter", f"--mount={host.mount_file}", "--", "sh", "-ec", self._mount_script(host)])

    def _mount_script(self, host: Host) -> str:
        """The shell script that sets up a host's fresh mount namespace (run inside it)."""
        q = shlex.quote
        script = [
            # Netns files copied from the root namespace would pin other runs' namespaces.
            "findmnt -rn -t nsfs -o TARGET | while read -r m; do umount -l \"$m\"; done",
            f"mount --bind {q(str(self.etc_hosts))} /etc/hosts",
            *(f"mount --bind {q(str(self.shell_rc))} {q(str(rc))}" for rc in _root_shell_rcs()),
        ]
        binds = [f"mount --bind {q(str(host.backing_dir(p)))} {q(p)}" for p in self.private_paths]
        # A private path that covers a shared directory: set that aside first, then put it back
        # over the private directory, so it stays the same shared directory on every host.
        kept = [(q(str(STATE_DIR / f"{host.netns}.keep{i}")), q(str(d)))
                for i, d in enumerate(shared_under(self.private_paths, self._shared_dirs()))]
        aside = [line for stash, d in kept for line in (f"mkdir -p {stash}", f"mount --bind {d} {stash}")]
        back = [line for stash, d in kept for line in (f"mkdir -p {d}", f"mount --move {stash} {d}", f"rmdir {stash}")]
        return "\n".join([*script, *aside, *binds, *back])

    def _shared_dirs(self) -> list[Path]:
        """What every host must see as the machine has it: the workdir, the Python the hosts
        run, the source tree the tests and programs come from."""
        source = Path(__file__).resolve().parents[2]
        return [self.workdir, Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), source]

    def _write_ssh_config(self) -> None:
        blocks = [f"Host {h.name}\n  HostName {h.address}\n" for h in self]
        common = (f"Host *\n  User root\n  IdentityFile {self.ssh_key}\n  IdentitiesOnly yes\n"
                  "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
                  "  BatchMode yes\n  ConnectTimeout 10\n")
        self.ssh_config.write_text("".join(blocks) + common)

    def _start_sshd(self, host: Host) -> None:
        """Start the host's sshd and wait until it answers on port 22 of its address."""
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        config = self.run_dir / f"sshd_config.{host.name}"
        config.write_text(
            f"Port 22\nListenAddress {host.address}\n"
            f"HostKey {self.run_dir / 'ssh_host_ed25519_key'}\n"
            f"AuthorizedKeysFile {self.ssh_key}.pub\n"
            f"PidFile {self.run_dir / f'sshd.{host.name}.pid'}\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            "AcceptEnv LANG LC_*\nSubsystem sftp /usr/lib/openssh/sftp-server\n")
        log = open(self.run_dir / f"sshd.{host.name}.log", "ab")
        with log:
            host.sshd = host.popen([SSHD, "-D", "-e", "-f", str(config)], stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._wait_sshd(host)

    def _wait_sshd(self, host: Host) -> None:
        probe = (f"import socket,time\nfor _ in range(200):\n"
                 f"    try:\n        socket.create_connection(('{host.address}', 22), 1).close(); break\n"
                 f"    except OSError: time.sleep(0.05)\nelse: raise SystemExit(1)\n")
        if host.run(["/usr/bin/python3", "-c", probe], check=False, timeout=30).returncode != 0:
            log = (self.run_dir / f"sshd.{host.name}.log").read_text(errors="replace")
            raise HostsError(f"sshd on {host.name} ({host.address}) did not listen: {log[-2000:]}")


def _root_shell_rcs() -> list[Path]:
    """root's shell start-up files on this machine, which each host replaces with a plain one.

    sshd runs every command through root's login shell, and Debian's bash reads ~/.bashrc
    then. A developer's rc (pyenv's rehash takes a lock file in the shared home) would run
    on every host for every command: slow, and a host's killed session leaves the lock
    behind for the whole machine.
    """
    home = Path("/root")
    return [home / rc for rc in (".bashrc", ".profile", ".bash_profile", ".bash_login")
            if (home / rc).is_file()]


def _check_names(names: list[str]) -> None:
    """Host names become ssh aliases and namespace names: short, plain, distinct."""
    if not names:
        raise ValueError("TestHosts needs at least one host name")
    if len(set(names)) != len(names):
        raise ValueError(f"host names must be distinct: {names}")
    if len(names) > 250:
        raise ValueError("at most 250 test hosts fit one /24")
    for name in names:
        if not (name.isascii() and name.replace("-", "").isalnum() and name[0].isalpha()
                and len(name) <= 32 and name != "br"):
            raise ValueError(f"bad host name {name!r}: letters, digits and '-', starting "
                             f"with a letter, at most 32 characters, not 'br'")


def shared_under(private_paths: tuple[str, ...], shared: list[Path]) -> list[Path]:
    """The shared directories a private path would hide (at or under it), outermost only: one
    inside another comes back with it.

    | private | shared                     | kept    |
    | /tmp    | /tmp/w, /tmp/w/venv, /opt  | /tmp/w  |
    | /srv    | /tmp/w                     | (none)  |
    | /tmp/w  | /tmp/w                     | /tmp/w  |
    """
    hidden = sorted({d for d in shared for p in map(Path, private_paths) if p == d or p in d.parents})
    return [d for d in hidden if not any(o in d.parents for o in hidden)]


def _check_private_paths(paths: tuple[str, ...]) -> None:
    """A private path may be any directory but one whose hiding would break every host."""
    for path in paths:
        p = Path(path)
        if not p.is_absolute() or p == Path("/") or ".." in p.parts:
            raise ValueError(f"private path {path!r} must be an absolute directory other than /")
        needed = [*map(Path, SYSTEM_DIRS), STATE_DIR]
        hidden = [n for n in needed if n == p or p in n.parents]
        if hidden:
            raise ValueError(f"private path {path!r} would hide {hidden[0]}, which the hosts "
                             f"share with the machine")


def main(argv: list[str] | None = None) -> int:
    """``python -m bookkeeper.testing.hosts --cleanup``: remove every stale run."""
    parser = argparse.ArgumentParser(prog="python -m bookkeeper.testing.hosts",
                                     description="Test hosts in network namespaces.")
    parser.add_argument("--cleanup", action="store_true",
                        help="remove every run whose owner process is dead")
    args = parser.parse_args(argv)
    if not args.cleanup:
        parser.print_help()
        return 2
    removed = cleanup_stale()
    print(f"removed {len(removed)} stale run(s)" + (f": {', '.join(removed)}" if removed else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
