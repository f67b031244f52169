"""The Ansible deployment (ansible/), run for real: `inventory/local.ini` deploying
ZooKeeper + 3 bookies on this machine, secure as every deployment is by default (the
roles' lint, units and variables: test_ansible_roles.py).

Reference: docs/api.md section 9, issue 9 item 2 and issue 23 item 6. The deployment tests
share one deployment (module fixture), in the order of this file: site.yml deploys with
`tls = optional` (everything else secure: token authentication, roles, ZooKeeper
credentials and its TLS port) and `bk simpletest` passes over TLS with the client token;
a second site.yml changes nothing; rolling_restart.yml -e bookie_tls=require moves the
bookies to `require` one at a time under a TLS writer that sees no error; then a plain
client and a client without a token are refused, each with its reason, and no znode is
open to world; one bookie's changed variable restarts only that bookie. teardown.yml
-e purge=true stops everything, checked by pid.

Hosts without systemd (containers, CI) run the services under a private supervisord
in the test's directory, chosen automatically. Where systemd runs, the tests ask for
supervisor explicitly, so that they never install units into the host's systemd.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kazoo.client import KazooClient
from kazoo.security import Permissions

import bookkeeper.sync
from bookkeeper import DigestType
from bookkeeper.bookie.admin_client import AdminHTTPError, admin_request
from bookkeeper.errors import AuthenticationError
from bookkeeper.testing.cluster import children_of, free_port_block
from tests.ansible_tools import ANSIBLE_DIR, VENV_BIN, ansible_env, failures, recap, tool

# A hang guard, not a performance bound: a first site.yml takes ~100 s alone on two cores and
# 300-450 s beside the fault harness and a third test worker under `make test`.
PLAYBOOK_TIMEOUT_S = 900
pytestmark = [pytest.mark.slow, pytest.mark.runtime(300), pytest.mark.timeout(PLAYBOOK_TIMEOUT_S + 120)]
BOOKIES = ("bookie1", "bookie2", "bookie3")

# -- the local deployment -----------------------------------------------------------

@dataclass
class Deployment:
    """inventory/local.ini deployed under `base` (its private supervisord included)."""

    base: Path
    zk_port: int
    port_base: int
    wheel: Path
    extra_vars: list[str] = field(default_factory=list)
    #: Output and duration of the first site.yml run (the fixture's).
    first_run: str = ""
    first_run_s: float = 0.0
    #: Every pid the deployment ran (pid -> its cmdline then), to check after the teardown.
    seen: dict[int, bytes] = field(default_factory=dict)

    @property
    def metadata_uri(self) -> str:
        """ZooKeeper's TLS port (local.ini: port_base + 1)."""
        return f"zk+tls://127.0.0.1:{self.port_base + 1}/ledgers"

    @property
    def pki(self) -> Path:
        """The controller's trust material (local.ini: pki_dir)."""
        return self.base / "pki"

    @property
    def zk_auth(self) -> str:
        return f"digest:bookkeeper:{(self.pki / 'zk_password').read_text().strip()}"

    def client_settings(self, *, tls: str = "require", token: str | None = "client") -> dict[str, str]:
        """BookKeeper.connect keywords of an application: the CA, the role-minted token named
        `token` (read from its file), the ZooKeeper credentials."""
        settings = {"tls": tls, "tls_ca_file": str(self.pki / "ca" / "ca.pem"), "zk_auth": self.zk_auth}
        if token:
            settings |= {"auth_provider": "token", "auth_token": f"file:{self.pki / 'tokens' / token}.token"}
        return settings

    def set_extra_var(self, name: str, value: str) -> None:
        """Every later playbook run gets -e name=value (replacing an earlier value)."""
        kept = [v for v in self.extra_vars[1::2] if not v.startswith(f"{name}=")]
        self.extra_vars = [x for v in [*kept, f"{name}={value}"] for x in ("-e", v)]

    @property
    def supervisord_conf(self) -> Path:
        return self.base / "supervisor" / "supervisord.conf"

    def playbook(self, name: str, *extra: str, inventory: Path | None = None, build_wheel: bool = False) -> str:
        """Run ansible/NAME against local.ini (or `inventory`); return its output, failing on rc != 0.
        build_wheel: the role builds the wheel itself, in a fresh directory and a fresh isolated
        build environment, as a controller without a prebuilt wheel does."""
        wheel = [] if build_wheel else ["-e", f"bookie_wheel={self.wheel}"]
        cmd = [tool("ansible-playbook"), "-i", str(inventory or ANSIBLE_DIR / "inventory" / "local.ini"),
               str(ANSIBLE_DIR / name), "-e", f"bk_local_base_dir={self.base}",
               "-e", f"bk_local_zk_port={self.zk_port}", "-e", f"bk_local_port_base={self.port_base}",
               *wheel, *self.extra_vars, *extra]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=PLAYBOOK_TIMEOUT_S, env=ansible_env(),
                             stdin=subprocess.DEVNULL)
        assert run.returncode == 0, (f"{name} exited {run.returncode}; failed tasks:\n{failures(run.stdout)}\n"
                                     f"output:\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}")
        return run.stdout

    def service_pids(self) -> dict[str, int]:
        """Pid of each supervisor program (the bookie's supervisor process, ZooKeeper's JVM); 0 if not running."""
        names = ["bk-local-zookeeper", *(f"bk-local-{b}" for b in BOOKIES)]
        out = {}
        for name in names:
            r = subprocess.run(["supervisorctl", "-c", str(self.supervisord_conf), "pid", name],
                               capture_output=True, text=True, timeout=30)
            out[name] = int(r.stdout.strip()) if r.stdout.strip().isdigit() else 0
        self._remember(out.values())
        return out

    def _remember(self, pids: Iterable[int]) -> None:
        for pid in pids:
            for p in (pid, *children_of(pid)):
                if p and p not in self.seen:
                    try:
                        self.seen[p] = Path(f"/proc/{p}/cmdline").read_bytes()
                    except OSError:
                        pass

    def remember_all(self) -> None:
        pidfile = self.base / "supervisor" / "supervisord.pid"
        if pidfile.exists():
            self._remember([int(pidfile.read_text().strip())])
        self.service_pids()

    def still_running(self) -> list[int]:
        """Pids seen earlier that still run the same command line."""
        alive = []
        for pid, cmdline in self.seen.items():
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes() == cmdline:
                    alive.append(pid)
            except OSError:
                continue
        return alive


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, built_wheel: Path) -> Iterator[Deployment]:
    """site.yml with local.ini into a temp dir; teardown.yml -e purge=true afterwards, then
    every process it ran is checked gone by pid (leftovers are killed, and fail the test)."""
    base = tmp_path_factory.mktemp("ansible-local")
    # Secure, with TLS offered rather than required: test_rolling_restart... moves it to require.
    extra = ["-e", "bookie_tls=optional"]
    if Path("/run/systemd/system").is_dir():
        extra += ["-e", "zookeeper_service_manager=supervisor", "-e", "bookie_service_manager=supervisor"]
    dep = Deployment(base=base, zk_port=free_port_block(1), port_base=free_port_block(40), wheel=built_wheel,
                     extra_vars=extra)
    started = time.monotonic()
    try:
        dep.first_run = dep.playbook("site.yml")
        dep.first_run_s = time.monotonic() - started
        dep.remember_all()
        yield dep
    finally:
        dep.remember_all()
        try:
            dep.playbook("teardown.yml", "-e", "purge=true")
        finally:
            leftovers = dep.still_running()
            for pid in leftovers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        assert not leftovers, f"still running after teardown.yml: {leftovers}"
        assert not dep.supervisord_conf.exists() and not (base / "bookie1").exists(), sorted(base.rglob("*"))[:20]


# Its set-up is the module's deployment: the wheel's build (when this test is the first to need
# it) and a site.yml run of up to PLAYBOOK_TIMEOUT_S, more than the suite's 300 s per test.
@pytest.mark.timeout(PLAYBOOK_TIMEOUT_S + 360)
def test_site_deploys_zookeeper_and_three_bookies_and_simpletest_passes(deployment: Deployment) -> None:
    """site.yml deploys ZooKeeper + 3 bookies from the wheel, secure: `bk simpletest` (3/2/2)
    passes over TLS with the client token and the ZooKeeper credentials on ZooKeeper's TLS
    port; every key, token and password is 0600 on the controller and readable by the bookie's
    user alone on the host."""
    print(f"first site.yml run: {deployment.first_run_s:.1f}s")
    first = recap(deployment.first_run)
    assert set(first) == {"zk1", *BOOKIES}, first
    assert all(changed > 0 and failed == 0 for changed, _, failed in first.values()), first
    assert all(deployment.service_pids().values())
    env = {**os.environ, **{f"BK_{k.upper()}": v for k, v in deployment.client_settings().items()}}
    test = subprocess.run([str(VENV_BIN / "bk"), "simpletest", "--metadata-uri", deployment.metadata_uri],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=env)
    assert test.returncode == 0, test.stdout + test.stderr
    toml = (deployment.base / "bookie2" / "bookie.toml").read_text()
    assert f"port = {deployment.port_base + 20}\n" in toml and f"http_port = {deployment.port_base + 25}\n" in toml
    assert 'tls = "optional"\n' in toml and 'auth_provider = "token"\n' in toml, toml
    assert f'metadata_uri = "{deployment.metadata_uri}"\n' in toml, toml
    secrets = [*deployment.pki.rglob("*key*"), *deployment.pki.rglob("*.token"), deployment.pki / "zk_password",
               *(deployment.base / "bookie2" / "trust").glob("*key*"), *(deployment.base / "bookie2" / "trust").glob("*.token")]
    assert len(secrets) >= 10 and all(p.stat().st_mode & 0o777 == 0o600 for p in secrets), \
        {str(p): oct(p.stat().st_mode & 0o777) for p in secrets}
    assert deployment.pki.stat().st_mode & 0o777 == 0o700


def test_second_site_run_from_a_freshly_built_wheel_changes_nothing(deployment: Deployment) -> None:
    """Idempotence as a controller sees it: the second site.yml builds the wheel again (a new
    temporary directory, a new isolated build environment: the role's own build) and reports
    changed=0 for every host, with every bookie's pid unchanged. It fails if two builds of
    one commit differ (the role would reinstall and restart every bookie)."""
    before = deployment.service_pids()
    output = deployment.playbook("site.yml", build_wheel=True)
    print(next(line for line in output.splitlines()[::-1] if line.startswith("bookie1")))
    second = recap(output)
    assert second == {host: (0, 0, 0) for host in ("zk1", *BOOKIES)}, second
    assert deployment.service_pids() == before


def _write_until(uri: str, settings: dict[str, str], stop: threading.Event, acked: list[tuple[int, bytes]],
                 errors: list[BaseException], ledger: list[int]) -> None:
    """One long-lived writer (E=2, Qw=Qa=2 on 3 bookies: a replacement always exists)."""
    try:
        with bookkeeper.sync.BookKeeper.connect(uri, **settings) as bk:
            lh = bk.create_ledger(ensemble=2, write_quorum=2, ack_quorum=2, digest=DigestType.CRC32C,
                                  password=b"rolling")
            ledger.append(lh.ledger_id)
            deadline = time.monotonic() + PLAYBOOK_TIMEOUT_S + 30
            i = 0
            while not stop.is_set() and time.monotonic() < deadline:
                data = b"rolling %06d" % i
                acked.append((lh.add_entry(data), data))
                i += 1
                time.sleep(0.005)
            lh.close()
    except BaseException as e:  # handed to the test thread
        errors.append(e)


def test_rolling_restart_moves_tls_optional_to_require_under_a_writer(deployment: Deployment) -> None:
    """rolling_restart.yml -e bookie_tls=require restarts every bookie (one at a time) with
    `tls = require` while a TLS writer with a token appends: the writer sees no error and every
    acknowledged entry reads back."""
    before = deployment.service_pids()
    settings = deployment.client_settings()
    stop = threading.Event()
    acked: list[tuple[int, bytes]] = []
    errors: list[BaseException] = []
    ledger: list[int] = []
    writer = threading.Thread(target=_write_until,
                              args=(deployment.metadata_uri, settings, stop, acked, errors, ledger), daemon=True)
    writer.start()
    try:
        deadline = time.monotonic() + 30
        while len(acked) < 50 and not errors and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(acked) >= 50 and not errors, errors
        started = time.monotonic()
        output = deployment.playbook("rolling_restart.yml", "-e", "bookie_tls=require")
        print(f"rolling_restart.yml: {time.monotonic() - started:.1f}s, {len(acked)} entries acknowledged")
    finally:
        stop.set()
        writer.join(timeout=60)
    assert not writer.is_alive()
    assert not errors, repr(errors[0])
    rolled = recap(output)
    assert set(rolled) == set(BOOKIES) and all(failed == 0 for _, _, failed in rolled.values()), rolled
    deployment.set_extra_var("bookie_tls", "require")  # the inventory of the cluster now
    after = deployment.service_pids()
    assert all(after[f"bk-local-{b}"] not in (0, before[f"bk-local-{b}"]) for b in BOOKIES), (before, after)
    assert after["bk-local-zookeeper"] == before["bk-local-zookeeper"]
    for b in BOOKIES:
        assert 'tls = "require"\n' in (deployment.base / b / "bookie.toml").read_text(), b

    assert [eid for eid, _ in acked] == list(range(len(acked)))
    with bookkeeper.sync.BookKeeper.connect(deployment.metadata_uri, **settings) as bk:
        rh = bk.open_ledger(ledger[0], password=b"rolling", digest=DigestType.CRC32C)
        assert rh.last_add_confirmed == len(acked) - 1
        assert [(e.entry_id, e.data) for e in rh.read(0, rh.last_add_confirmed)] == acked
        assert len(rh.metadata.ensembles) > 1, "no bookie of the writer's ensemble was restarted under it"
        bk.delete_ledger(ledger[0])


def _first_add(uri: str, settings: dict[str, str]) -> None:
    with bookkeeper.sync.BookKeeper.connect(uri, **settings) as bk:
        lh = bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, digest=DigestType.CRC32C, password=b"refused")
        try:
            lh.add_entry(b"never stored")
        finally:
            bk.delete_ledger(lh.ledger_id)


def _znodes(zk: KazooClient, path: str) -> Iterator[tuple[str, list[Any]]]:
    """Every znode under `path` (itself included) with its ACL."""
    yield path, zk.get_acls(path)[0]
    for child in zk.get_children(path):
        yield from _znodes(zk, f"{path.rstrip('/')}/{child}")


def test_plain_and_tokenless_clients_are_refused_and_no_znode_is_open_to_world(deployment: Deployment) -> None:
    """Against the bookies now at `require`: a plain client is refused naming TLS, a TLS client
    without a token naming authentication, each an AuthenticationError (not a timeout); the
    admin HTTP serves /metrics over TLS to the admin token, 401 without a token and 403 to a
    POST with the client token (no admin role); a walk of ZooKeeper's tree (over its TLS
    port, with the credentials) finds no znode under the metadata root that world may change."""
    with pytest.raises(AuthenticationError, match="TLS required"):  # tls_ca_file stays: ZooKeeper's TLS
        _first_add(deployment.metadata_uri, deployment.client_settings(tls="off"))
    with pytest.raises(AuthenticationError, match="authentication required"):
        _first_add(deployment.metadata_uri, deployment.client_settings(token=None))
    admin = f"127.0.0.1:{deployment.port_base + 15}"  # bookie1's admin HTTP, on TLS
    tokens, ca = deployment.pki / "tokens", str(deployment.pki / "ca" / "ca.pem")
    assert "bookkeeper_" in admin_request(admin, "GET", "/metrics", tls_ca_file=ca, token=f"file:{tokens}/admin.token")
    with pytest.raises(AdminHTTPError) as no_token:
        admin_request(admin, "GET", "/metrics", tls_ca_file=ca)
    with pytest.raises(AdminHTTPError) as not_admin:
        admin_request(admin, "POST", "/api/v1/bookie/gc", tls_ca_file=ca, token=f"file:{tokens}/client.token")
    assert (no_token.value.status, not_admin.value.status) == (401, 403), (no_token.value, not_admin.value)
    zk = KazooClient(hosts=f"127.0.0.1:{deployment.port_base + 1}", use_ssl=True, verify_certs=True,
                     ca=str(deployment.pki / "ca" / "ca.pem"),
                     auth_data=[("digest", deployment.zk_auth.removeprefix("digest:"))])
    zk.start(timeout=30)
    try:
        nodes = list(_znodes(zk, "/ledgers"))
    finally:
        zk.stop()
        zk.close()
    change = Permissions.WRITE | Permissions.CREATE | Permissions.DELETE | Permissions.ADMIN
    assert len(nodes) >= 10, nodes  # registrations, cookies, ledgers, the id generator ...
    assert not [(p, acls) for p, acls in nodes if any(a.id.scheme == "world" and a.perms & change for a in acls)]
    print(f"{len(nodes)} znodes walked, none that world may change")


def test_changed_variable_restarts_only_that_bookie(deployment: Deployment, tmp_path: Path) -> None:
    """A host var changed for bookie2 (its gc_interval_s) rewrites its bookie.toml and restarts
    bookie2 alone: the other bookies and ZooKeeper keep their pids and report changed=0."""
    inventory = tmp_path / "inventory"
    (inventory / "host_vars").mkdir(parents=True)
    shutil.copy(ANSIBLE_DIR / "inventory" / "local.ini", inventory / "local.ini")
    (inventory / "host_vars" / "bookie2.yml").write_text("---\nbookie_gc_interval_s: 30\n")
    before = deployment.service_pids()
    result = recap(deployment.playbook("site.yml", inventory=inventory / "local.ini"))
    after = deployment.service_pids()
    assert result["bookie2"][0] > 0 and all(result[h] == (0, 0, 0) for h in ("zk1", "bookie1", "bookie3")), result
    assert after["bk-local-bookie2"] not in (0, before["bk-local-bookie2"]), (before, after)
    assert {k: v for k, v in after.items() if k != "bk-local-bookie2"} == \
        {k: v for k, v in before.items() if k != "bk-local-bookie2"}
    assert "gc_interval_s = 30.0\n" in (deployment.base / "bookie2" / "bookie.toml").read_text()
