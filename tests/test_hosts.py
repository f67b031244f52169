"""Test hosts (issue 24 item 1): real network namespaces on one bridge, private paths, sshd.

Every test here makes real namespaces, real sshd processes and real nftables tables; the
module skips (with the reason) only where ``namespaces_unavailable()`` says they cannot be made.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bookkeeper.testing.hosts import (
    MOUNT_DIR, NETNS_DIR, STATE_DIR, Host, TestHosts, namespaces_unavailable, shared_under,
)
from bookkeeper.testing.waiting import wait_until

REASON = namespaces_unavailable()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""),
              pytest.mark.timeout(60)]

# A one-connection-at-a-time TCP server: answers every connection with the host's name.
SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(16)
print("ready", flush=True)
while True:
    c, _ = s.accept(); c.sendall(sys.argv[3].encode()); c.close()
"""
# Connects and prints what it read, or the errno name / "timeout" of the failure.
CLIENT = """
import errno, socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), float(sys.argv[3]))
    print(c.recv(100).decode())
except socket.timeout:
    print("timeout")
except OSError as e:
    print(errno.errorcode.get(e.errno, str(e)))
"""
PORT = 7000
SERVERS: list[subprocess.Popen[str]] = []  # reaped once the hosts (and so they) are stopped


def _serve(host: Host, address: str) -> subprocess.Popen[str]:
    proc = host.popen([sys.executable, "-c", SERVER, address, str(PORT), host.name],
                      stdout=subprocess.PIPE, text=True)
    SERVERS.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _connect(client: Host, address: str, timeout_s: float = 5.0) -> str:
    """What a TCP connect from ``client`` to ``address`` gets: the server's name or an error."""
    return client.run([sys.executable, "-c", CLIENT, address, str(PORT), str(timeout_s)]).stdout.strip()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestHosts]:
    """Three hosts with /srv and /tmp private; a server on each host's address."""
    with TestHosts(tmp_path_factory.mktemp("hosts"), ["a", "b", "c"],
                   private_paths=("/srv", "/tmp")) as made:
        for host in made:
            _serve(host, host.address)
        yield made
    for server in SERVERS:
        server.wait(timeout=10)
        assert server.stdout is not None
        server.stdout.close()


def _ipv4(host: Host) -> list[tuple[str, str]]:
    out = host.run(["ip", "-4", "-o", "addr", "show"]).stdout
    return sorted((line.split()[1], line.split()[3]) for line in out.splitlines())


def test_each_host_sees_only_its_own_address_and_loopback(hosts: TestHosts) -> None:
    """A host's network is its own: lo up with 127.0.0.1, eth0 with its /24 address, no other."""
    addresses = {h.address for h in hosts}
    assert len(addresses) == 3
    for host in hosts:
        assert _ipv4(host) == [("eth0", f"{host.address}/24"), ("lo", "127.0.0.1/8")]
        links = host.run(["ip", "-o", "link", "show"]).stdout
        assert [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()] == ["lo", "eth0"]
        assert "state UP" in links.splitlines()[1] or "LOWER_UP" in links.splitlines()[1]


def test_hosts_know_their_names_and_each_other_by_name(hosts: TestHosts) -> None:
    """hostname is the host's name; names resolve to the test addresses on every host."""
    who_am_i = "import socket; print(socket.gethostname(), socket.gethostbyname(socket.gethostname()))"
    for host in hosts:
        assert host.run([sys.executable, "-c", who_am_i]).stdout.split() == [host.name, host.address]
        for peer in hosts:
            assert host.run(["getent", "hosts", peer.name]).stdout.split() == [peer.address, peer.name]
    assert hosts["a"].run(hosts.ssh_argv("b", "hostname")).stdout == "b\n"


def test_elsewhere_is_unreachable_and_nothing_leaves_the_run(hosts: TestHosts) -> None:
    """The default route ends at the bridge's namespace: an outside address is unreachable."""
    a = hosts["a"]
    route = a.run(["ip", "route", "get", "192.0.2.1"]).stdout
    assert f"via {hosts.gateway} dev eth0 src {a.address}" in route
    assert _connect(a, "192.0.2.1", 10.0) == "ENETUNREACH"
    # Every time, not a few a second: name lookups that fall through to the machine's DNS
    # server must fail at once, not wait for resolver timeouts.
    burst = ("import socket\nfor _ in range(20):\n    try: socket.create_connection(('192.0.2.1', 80), 10)\n"
             "    except OSError as e: print(e.errno)\n")
    assert a.run([sys.executable, "-c", burst]).stdout.split() == [str(errno.ENETUNREACH)] * 20


def test_nothing_of_the_run_is_in_the_root_namespace(hosts: TestHosts) -> None:
    """No test address, route or interface of the run in the root namespace."""
    def root(*argv: str) -> str:
        return subprocess.run(["ip", *argv], capture_output=True, text=True, check=True).stdout
    assert "10.213." not in root("-4", "-o", "addr", "show") + root("route", "show")
    # A veth whose peer lives in one of the run's namespaces would name it ("link-netns ...").
    assert hosts.prefix not in root("-o", "link", "show")
    assert hosts.prefix not in root("-d", "-o", "link", "show", "type", "bridge")


def test_tcp_between_hosts_on_their_addresses(hosts: TestHosts) -> None:
    """Every host reaches every other host's server by its address across the bridge."""
    for client in hosts:
        for server in hosts:
            assert _connect(client, server.address) == server.name


def test_private_paths_are_private_per_host(hosts: TestHosts) -> None:
    """/srv/x written on a is in a's backing dir only: not on b, not in the root's /srv."""
    name = f"bkt-{hosts.prefix}-x"
    hosts["a"].run(f"echo from-a > /srv/{name} && echo tmp-a > /tmp/{name}")
    assert (hosts["a"].backing_dir("/srv") / name).read_text() == "from-a\n"
    assert hosts["a"].backing_dir(f"/srv/{name}") == hosts["a"].backing_dir("/srv") / name
    assert not Path("/srv", name).exists() and not Path("/tmp", name).exists()
    on_b = hosts["b"].run(f"ls /srv/{name} /tmp/{name}", check=False)
    assert on_b.returncode != 0 and on_b.stdout == ""
    assert hosts["a"].run(f"cat /srv/{name} /tmp/{name}").stdout == "from-a\ntmp-a\n"
    assert hosts["a"].run(["cat", name], cwd="/srv").stdout == "from-a\n"  # cwd is the host's /srv
    with pytest.raises(ValueError, match="not under a private path"):
        hosts["a"].backing_dir("/var")


def test_workdir_stays_visible_on_every_host_under_a_private_tmp(hosts: TestHosts) -> None:
    """The workdir (under /tmp here) is the same directory on every host: the ssh key is there."""
    assert str(hosts.workdir).startswith("/tmp/")
    marker = hosts.workdir / "shared-marker"
    marker.write_text("shared\n")
    for host in hosts:
        assert host.run(["cat", str(marker)]).stdout == "shared\n"
        assert host.run(["test", "-r", str(hosts.ssh_key)], check=False).returncode == 0


def test_ssh_from_one_host_to_another(hosts: TestHosts) -> None:
    """ssh -F ssh_config b, run on a, reaches b's sshd by its name and runs there."""
    out = hosts["a"].run(hosts.ssh_argv("b", "ip -4 -o addr show eth0")).stdout
    assert hosts["b"].address in out and hosts["a"].address not in out
    assert hosts.ssh_argv("c", ["echo", "two words"])[-1] == "echo 'two words'"
    plain = hosts["c"].run(["ssh", "-F", str(hosts.ssh_config), "a", "cat /srv/*x 2>/dev/null; echo ok"])
    assert plain.stdout.endswith("ok\n")
    config = hosts.ssh_config.read_text()
    assert "StrictHostKeyChecking no" in config and "UserKnownHostsFile /dev/null" in config
    with pytest.raises(KeyError):
        hosts.ssh_argv("nosuch", "true")
    if Path("/root/.bashrc").is_file():  # the host's root shell is plain, not the machine's
        assert hosts["a"].run(hosts.ssh_argv("b", "cat /root/.bashrc")).stdout == hosts.shell_rc.read_text()


def test_partition_drop_times_out_and_heal_restores(hosts: TestHosts) -> None:
    """A silent drop: connects both ways time out; others and a's loopback are unaffected."""
    a, b, c = hosts["a"], hosts["b"], hosts["c"]
    loop = _serve_loopback(a)
    try:
        a.partition("drop", [b])
        assert _connect(a, b.address, 1.0) == "timeout"
        assert _connect(b, a.address, 1.0) == "timeout"
        assert _connect(a, c.address) == "c" and _connect(c, b.address) == "b"
        assert _connect(a, "127.0.0.1") == "a" and _connect(a, a.address) == "a"
        a.heal()
        assert _connect(a, b.address) == "b" and _connect(b, a.address) == "a"
    finally:
        a.heal()
        loop.kill()
        loop.wait(timeout=10)


def test_partition_reset_refuses_at_once_from_every_peer(hosts: TestHosts) -> None:
    """A reset partition (default peers: every other host) fails connects with a refusal."""
    a, b, c = hosts["a"], hosts["b"], hosts["c"]
    try:
        a.partition("reset")
        a.partition("reset")  # replaces the table: calling twice is fine
        for peer in (b, c):
            assert _connect(a, peer.address, 10.0) in ("ECONNREFUSED", "ECONNRESET")
            assert _connect(peer, a.address, 10.0) in ("ECONNREFUSED", "ECONNRESET")
        assert _connect(b, c.address) == "c"
        a.heal()
        a.heal()  # healing a healed host is fine
        assert _connect(a, b.address) == "b" and _connect(c, a.address) == "a"
    finally:
        a.heal()
    with pytest.raises(ValueError, match="partition mode"):
        a.partition("flaky")


def _serve_loopback(host: Host) -> subprocess.Popen[str]:
    """A second server of the host on 127.0.0.1 (its own port space: no clash with eth0's)."""
    return _serve(host, "127.0.0.1")


def test_kill_processes_keeps_sshd_when_asked(hosts: TestHosts) -> None:
    """'Stop the host's processes': everything dies but sshd, which still lets us in."""
    c = hosts["c"]
    sleeper = c.popen(["sleep", "300"])
    remote = hosts["a"].popen(hosts.ssh_argv("c", "sleep 300"))
    wait_until("the ssh session's sleep running", lambda: _has_child_sleep(c, exclude=sleeper.pid), timeout_s=10)
    killed = c.kill_processes(signal.SIGKILL, keep_sshd=True)
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    assert sleeper.pid in killed and c.sshd is not None and c.sshd.pid not in killed
    assert remote.wait(timeout=10) != 0  # its remote command was killed, its session ended
    assert c.sshd.poll() is None
    assert hosts["a"].run(hosts.ssh_argv("c", "echo back")).stdout == "back\n"
    assert _connect(c, c.address, 1.0) == "ECONNREFUSED"  # c's server was one of its processes
    _serve(c, c.address)  # started again for the other tests
    assert _connect(hosts["a"], c.address) == "c"


def _has_child_sleep(host: Host, exclude: int) -> bool:
    """Whether a sleep other than ``exclude`` runs on the host (the one ssh started)."""
    return any(_comm(p) == "sleep" for p in host.pids() if p != exclude)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _run_artifacts(prefix: str) -> list[str]:
    """Whatever of a run still exists: namespaces, mount-ns files, state file."""
    left = [p.name for p in NETNS_DIR.glob(f"{prefix}-*")] if NETNS_DIR.is_dir() else []
    left += [p.name for p in MOUNT_DIR.glob(f"{prefix}-*")]
    left += [p.name for p in STATE_DIR.glob(f"{prefix}.*")]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return left + [line for line in listed.splitlines() if line.startswith(f"{prefix}-")]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_stop_removes_every_namespace_process_and_state_file(tmp_path: Path) -> None:
    """After stop() nothing of the run remains; stop is idempotent; sshd can be killed too."""
    made = TestHosts(tmp_path, ["x", "y"]).start()
    prefix = made.prefix
    assert json.loads(made.state_file.read_text())["owner_pid"] == os.getpid()
    assert made["x"].address.rsplit(".", 1)[0] != "" and len(_run_artifacts(prefix)) >= 3
    sleeper = made["y"].popen(["sleep", "300"])
    # Two sshds and the sleeper (a process caught while it starts may be listed once more).
    pids = wait_until("three processes in the run", lambda: p if len(p := made["x"].pids() + made["y"].pids()) == 3 else None, timeout_s=10)
    sshd = made["x"].sshd
    assert sshd is not None and made["x"].kill_processes(keep_sshd=False) == [sshd.pid]
    assert sshd.wait(timeout=10) == -signal.SIGKILL
    made.stop()
    assert sleeper.wait(timeout=10) != 0
    assert _run_artifacts(prefix) == []
    assert not [p for p in pids if _alive(p)]
    made.stop()


def test_a_killed_run_is_removed_by_the_next_start(tmp_path: Path) -> None:
    """kill -9 of a run's owner leaves its namespaces and sshd; the next start removes them."""
    script = ("import sys, time\nfrom pathlib import Path\nfrom bookkeeper.testing.hosts import TestHosts\n"
              "h = TestHosts(Path(sys.argv[1]), ['s1', 's2']).start()\n"
              "print(h.prefix, h['s1'].sshd.pid, h['s2'].popen(['sleep', '300']).pid, flush=True)\n"
              "time.sleep(300)\n")
    owner = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "stale")],
                             stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    prefix, *orphans = owner.stdout.readline().split()
    owner.kill()
    owner.wait(timeout=10)
    owner.stdout.close()
    assert _run_artifacts(prefix) and all(_alive(int(p)) for p in orphans)
    with TestHosts(tmp_path / "next", ["n1"]) as fresh:
        assert _run_artifacts(prefix) == []
        assert not [p for p in orphans if _alive(int(p))]
        assert fresh["n1"].run(["true"]).returncode == 0


def test_cleanup_command_removes_a_killed_run(tmp_path: Path) -> None:
    """python -m bookkeeper.testing.hosts --cleanup, the humans' way, removes a dead run."""
    script = ("import sys, time\nfrom pathlib import Path\nfrom bookkeeper.testing.hosts import TestHosts\n"
              "h = TestHosts(Path(sys.argv[1]), ['k1']).start()\nprint(h.prefix, flush=True)\n"
              "time.sleep(300)\n")
    owner = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    prefix = owner.stdout.readline().strip()
    assert _run_artifacts(prefix)
    out = subprocess.run([sys.executable, "-m", "bookkeeper.testing.hosts", "--cleanup"],
                         capture_output=True, text=True, check=True).stdout
    assert prefix not in out and _run_artifacts(prefix)  # a live owner's run is left alone
    owner.kill()
    owner.wait(timeout=10)
    owner.stdout.close()
    out = subprocess.run([sys.executable, "-m", "bookkeeper.testing.hosts", "--cleanup"],
                         capture_output=True, text=True, check=True).stdout
    assert prefix in out and _run_artifacts(prefix) == []


@pytest.mark.parametrize("names, paths, match", [
    ([], ("/srv",), "at least one"),
    (["a", "a"], ("/srv",), "distinct"),
    (["a b"], ("/srv",), "bad host name"),
    (["1a"], ("/srv",), "bad host name"),
    (["br"], ("/srv",), "bad host name"),
    (["a"], ("srv",), "absolute"),
    (["a"], ("/",), "absolute"),
    (["a"], ("/run",), "would hide"),
    (["a"], ("/proc",), "would hide"),
    (["a"], ("/etc",), "would hide"),
    (["a"], ("/dev",), "would hide"),
])
def test_bad_names_and_private_paths_are_refused(tmp_path: Path, names: list[str],
                                                 paths: tuple[str, ...], match: str) -> None:
    """Bad input gets a clear error before anything is made."""
    with pytest.raises(ValueError, match=match):
        TestHosts(tmp_path, names, private_paths=paths)


@pytest.mark.parametrize("private, shared, kept", [
    (("/tmp",), ["/tmp/w", "/tmp/w/venv", "/opt"], ["/tmp/w"]),
    (("/srv",), ["/tmp/w"], []),
    (("/tmp/w",), ["/tmp/w"], ["/tmp/w"]),
    (("/srv", "/tmp"), ["/tmp/ci/.venv", "/tmp/ci", "/srv/x"], ["/srv/x", "/tmp/ci"]),
])
def test_shared_directories_under_a_private_path_are_kept(private: tuple[str, ...], shared: list[str],
                                                          kept: list[str]) -> None:
    """A checkout, venv or workdir under a private /tmp stays the machine's on every host."""
    assert shared_under(private, [Path(d) for d in shared]) == [Path(d) for d in kept]
