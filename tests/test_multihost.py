"""Ansible across hosts, over SSH, and faults between them (issue 24 items 2 and 3).

Eight test hosts (bookkeeper.testing.hosts: network namespaces on one bridge, each with its
address, its own /srv and /tmp, and an sshd): zk1..zk3 run a ZooKeeper quorum, bk1..bk4 a
bookie each, advertising their host's address, and ctl is the controller and the client
host: ansible-playbook runs inside it and reaches the others by SSH with the fixture's key,
and every client check and load runs there, so all traffic stays between the namespaces.
The deployment is the secure default (TLS, tokens, ZooKeeper credentials, quorum TLS) with
production-shaped paths under /srv, installed offline: the wheel and a wheelhouse of its
dependencies come from the controller, the hosts reach no index.

The tests share one deployment (module fixture) in the order of this file: site.yml deploys
a "previous" wheel (this tree's, relabelled) and the smoke checks pass from ctl; a second
site.yml changes nothing; rolling_restart.yml, then the upgrade to this tree's wheel (site.yml,
one bookie at a time), then the ZooKeeper leader killed, a bookie host cut off (silent drop,
then reset) and a bookie host lost for good each run under load from ctl and end with no
anomaly and no writer error (the writers' longest stall printed per step); auto-recovery
re-replicates the lost host's ledgers and `bk decommission` retires it; teardown.yml
-e purge=true leaves no process and no directory on any host.

The load is `bk verify run` on ctl (writers on 3/2/2 and 3/3/2 ledgers, a tailer, a stream,
every operation in a JSONL history): one run per step, acknowledging adds before the step's
playbook or fault sequence (which the test drives itself) starts, and ended by SIGINT when it
is over, after which it reads everything back and checks it; at the end `bk verify check`
re-checks every step's history offline.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bookkeeper.testing.hosts import Host, TestHosts, namespaces_unavailable
from bookkeeper.testing.waiting import wait_until
from bookkeeper.verify.history import has_acknowledged_add
from tests.ansible_tools import ANSIBLE_DIR, ansible_env, failures, recap, role_tasks_play, tool
from tests.conftest import REPO

REASON = namespaces_unavailable()
# A hang guard per playbook, not a performance bound. Alone on two cores the module takes
# ~285 s (deploy 67 s, second run 41 s, restart 22 s, upgrade 65 s, the faults 10-33 s each,
# teardown 16 s), plus the session's wheel build (~30 s) when it is the first to need it.
PLAYBOOK_TIMEOUT_S = 900
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.slow,
              pytest.mark.runtime(330), pytest.mark.timeout(PLAYBOOK_TIMEOUT_S + 300)]

ZOOKEEPERS = ("zk1", "zk2", "zk3")
BOOKIES = ("bk1", "bk2", "bk3", "bk4")
HOSTS = (*ZOOKEEPERS, *BOOKIES, "ctl")
CTL = "/srv/ctl"  # the controller's files on ctl: inventory, trust material, wheels
SUPERVISOR_CONF = "/srv/supervisor/supervisord.conf"
BOOKIE_PORT = 3181
BK = str(Path(sys.executable).parent / "bk")
# The load of a step: one bk verify run from before the step's start to its end, when SIGINT
# ends it (--seconds is only a bound: the playbook's hang guard and then some). 500 adds/s
# leaves the two cores' CPU to the playbooks, which are bound by it.
VERIFY = ["verify", "run", "--seconds", str(PLAYBOOK_TIMEOUT_S + 60), "--writers", "2", "--ensembles",
          "3/2/2,3/3/2", "--tailers", "1", "--streams", "1", "--rate", "500", "--keep", "--json"]
VERIFY_END_TIMEOUT_S = 300  # its read-back and check after SIGINT (a few seconds)
PREVIOUS_LABEL = "previous"
# How long auto-recovery may take to move a lost host's copies (lost_bookie_delay_s is 5 s).
RECOVERY_TIMEOUT_S = 240


def _step(name: str, started: float) -> None:
    print(f"step {name}: {time.monotonic() - started:.1f}s", flush=True)


# -- the wheels ---------------------------------------------------------------------

def relabel_wheel(wheel: Path, label: str, out_dir: Path) -> Path:
    """The same wheel under version `<version>+<label>` (its dist-info renamed, METADATA's
    Version and RECORD's hashes rewritten): a second, distinct package of this tree for the
    rolling upgrade, made in a second instead of another 90 s build."""
    name, version, rest = wheel.name.split("-", 2)
    new_version = f"{version}+{label}"
    old_info, new_info = f"{name}-{version}.dist-info/", f"{name}-{new_version}.dist-info/"
    out = out_dir / f"{name}-{new_version}-{rest}"
    records = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            path = new_info + item.filename[len(old_info):] if item.filename.startswith(old_info) else item.filename
            if path == new_info + "RECORD":
                continue
            data = src.read(item)
            if path == new_info + "METADATA":
                data = data.replace(f"\nVersion: {version}\n".encode(), f"\nVersion: {new_version}\n".encode(), 1)
            dst.writestr(zipfile.ZipInfo(path, item.date_time), data, zipfile.ZIP_DEFLATED)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append(f"{path},sha256={digest},{len(data)}")
        dst.writestr(new_info + "RECORD", "\n".join([*records, f"{new_info}RECORD,,"]) + "\n")
    return out


def wheelhouse_dir() -> Path:
    """The controller's cached wheelhouse: one per interpreter and pinned requirements."""
    requirements = (REPO / "requirements.txt").read_bytes()
    tag = f"{sys.implementation.cache_tag}-{hashlib.sha256(requirements).hexdigest()[:16]}"
    return REPO / "build" / f"wheelhouse-{tag}"


def make_wheelhouse(wheel: Path, work: Path) -> Path:
    """The wheelhouse, made by the role's own task (tasks_from: wheelhouse.yml) here in the
    root namespace, which reaches the package index: ctl, the controller, reaches none. Once
    per interpreter and requirements; a later run finds it and changes nothing."""
    play = work / "wheelhouse.yml"
    role_tasks_play(play, "localhost", "bookie", "wheelhouse.yml", "Make the bookies' wheelhouse")
    run = subprocess.run([tool("ansible-playbook"), "-i", "localhost,", "-c", "local", str(play),
                          "-e", f"bookie_wheel={wheel}", "-e", f"bookie_wheelhouse={wheelhouse_dir()}",
                          "-e", f"bookie_source_dir={REPO}", "-e", f"ansible_python_interpreter={sys.executable}"],
                         capture_output=True, text=True,
                         timeout=PLAYBOOK_TIMEOUT_S, env=ansible_env(), stdin=subprocess.DEVNULL)
    assert run.returncode == 0, f"{failures(run.stdout)}\n{run.stdout[-3000:]}{run.stderr[-2000:]}"
    return wheelhouse_dir()


# -- the deployment ---------------------------------------------------------------

def inventory(hosts: TestHosts) -> str:
    """The generated inventory: every host by address over SSH as root with the fixture's
    key, everything under each host's private /srv, the private supervisord (no systemd
    here), the bookies' venv on the controller's own interpreter (the wheel is built for
    it), auto-recovery on, and the offline install from the cached wheelhouse. The bookies
    and ZooKeeper run as root and the zookeeper user Debian's package made: the hosts share
    the machine's /etc/passwd, so the roles must not add users."""
    python = os.path.realpath(Path(sysconfig.get_config_var("BINDIR") or sys.base_prefix, "python3"))
    zk = "\n".join(f"{name} ansible_host={hosts[name].address}" for name in ZOOKEEPERS)
    bookies = "\n".join(f"{name} ansible_host={hosts[name].address}" for name in BOOKIES)
    return f"""# Generated by tests/test_multihost.py for its test hosts.
[zookeeper]
{zk}

[bookies]
{bookies}

[all:vars]
ansible_user=root
ansible_ssh_private_key_file={hosts.ssh_key}
ansible_ssh_common_args='-F {hosts.ssh_config}'
ansible_python_interpreter=/usr/bin/python3
pki_dir={CTL}/pki
supervisord_dir=/srv/supervisor
zookeeper_service_manager=supervisor
bookie_service_manager=supervisor

[zookeeper:vars]
zookeeper_create_user=false
zookeeper_config_dir=/srv/zookeeper/conf
zookeeper_data_dir=/srv/zookeeper/data
zookeeper_log_dir=/srv/zookeeper/log
zookeeper_heap_mb=128
zookeeper_force_sync=false
zookeeper_jvm_opts="{{{{ ['-XX:+UseSerialGC', '-XX:TieredStopAtLevel=1'] }}}}"

[bookies:vars]
bookie_user=root
bookie_group=root
bookie_create_user=false
bookie_install_dir=/srv/bookkeeper
bookie_config_dir=/srv/bookkeeper/etc
bookie_data_dir=/srv/bookkeeper/data
bookie_log_dir=/srv/bookkeeper/log
bookie_python={python}
bookie_system_packages="{{{{ [] }}}}"
bookie_wheelhouse={wheelhouse_dir()}
bookie_advertised_address="{{{{ ansible_host }}}}"
bookie_id="{{{{ ansible_host }}}}:{BOOKIE_PORT}"
bookie_shards=1
bookie_journal_preallocate_bytes=4194304
bookie_autorecovery=true
bookie_lost_bookie_delay_s=5
"""


@dataclass
class Cluster:
    """The deployment on the test hosts, driven from ctl."""

    hosts: TestHosts
    wheel: Path
    previous_wheel: Path
    #: -e of every playbook run (the wheel the cluster runs now).
    extra_vars: list[str] = field(default_factory=list)
    first_run: str = ""
    #: the bk verify report of every step under load, with its history's path on ctl.
    loads: dict[str, dict[str, Any]] = field(default_factory=dict)
    torn_down: bool = False

    @property
    def ctl(self) -> Host:
        return self.hosts["ctl"]

    @property
    def pki(self) -> Path:
        """The controller's trust material, as the test (root namespace) sees it."""
        return self.ctl.backing_dir(f"{CTL}/pki")

    @property
    def metadata_uri(self) -> str:
        return "zk+tls://" + ",".join(f"{self.hosts[z].address}:2281" for z in ZOOKEEPERS) + "/ledgers"

    def bookie_id(self, name: str) -> str:
        return f"{self.hosts[name].address}:{BOOKIE_PORT}"

    def client_env(self, token: str = "admin") -> dict[str, str]:
        """bk's and the load's settings on ctl: the CA, a role-minted token, the ZooKeeper credentials."""
        password = (self.pki / "zk_password").read_text().strip()
        return {**os.environ, "BK_METADATA_URI": self.metadata_uri, "BK_TLS": "require",
                "BK_TLS_CA_FILE": f"{CTL}/pki/ca/ca.pem", "BK_AUTH_PROVIDER": "token",
                "BK_AUTH_TOKEN": f"file:{CTL}/pki/tokens/{token}.token", "BK_ZK_AUTH": f"digest:bookkeeper:{password}"}

    def playbook(self, name: str, *extra: str) -> str:
        """ansible-playbook on ctl; its output, failing on rc != 0 with the failed tasks."""
        env = {**ansible_env(), "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg")}
        run = self.ctl.run([tool("ansible-playbook"), "-i", f"{CTL}/inventory.ini", str(ANSIBLE_DIR / name),
                            *self.extra_vars, *extra], check=False, timeout=PLAYBOOK_TIMEOUT_S, env=env,
                           cwd=str(ANSIBLE_DIR))
        assert run.returncode == 0, (f"{name} exited {run.returncode}; failed tasks:\n{failures(run.stdout)}\n"
                                     f"output:\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}")
        return run.stdout

    def under_load(self, step: str, action: Callable[[], Any]) -> Any:
        """Run `action` (a playbook, a fault sequence) under one `bk verify run` on ctl with the
        client token, started first and ended by SIGINT when the action is over (the load then
        stops, everything is read back and checked): no anomaly, no writer error. The writers'
        longest stall is printed. Returns what `action` returned."""
        name = step.replace(" ", "-")
        history, files = f"{CTL}/verify/{name}.jsonl", self.ctl.backing_dir(f"{CTL}/verify")
        with open(files / f"{name}.out", "w+") as out, open(files / f"{name}.err", "w+") as err:
            load = self.ctl.popen([BK, *VERIFY, "--history", history], env=self.client_env("client"),
                                  stdout=out, stderr=err, stdin=subprocess.DEVNULL)
            started = time.monotonic()
            try:
                wait_until(f"bk verify under {step} acknowledging adds", lambda: load.poll() is not None
                           or has_acknowledged_add(files / f"{name}.jsonl"), timeout_s=60, every_s=0.2)
                assert load.poll() is None, f"bk verify exited {load.returncode} before {step}"
                try:
                    result, failure = action(), None
                except Exception as e:  # raised below, once the load's report is kept
                    result, failure = None, e
            finally:  # a failed action still ends the load and keeps its history for the final check
                load.send_signal(signal.SIGINT)
                try:
                    load.wait(timeout=VERIFY_END_TIMEOUT_S)
                finally:
                    if load.poll() is None:
                        load.kill()
                        load.wait()
            out.seek(0)
            err.seek(0)
            report_text, errors = out.read(), err.read()
        assert load.returncode in (0, 1) and report_text.strip(), \
            f"bk verify under {step} exited {load.returncode}: {report_text[-2000:]}{errors[-3000:]}"
        report: dict[str, Any] = json.loads(report_text)
        report["history_file"] = history
        self.loads[step] = report  # kept for the final offline check, whatever it says
        if failure is not None:
            raise failure
        assert not report["anomalies"] and not report["writer_errors"], \
            (step, {k: report[k] for k in ("anomalies", "writer_errors", "writer_error_samples")})
        _step(step, started)
        print(f"load under {step}: {report['ops']} ops, {report['acked']} acknowledged, {report['ledgers']} ledgers, "
              f"{report['takeovers']} takeovers, writers' longest stall {report['longest_stall_s']:.2f}s, "
              f"check {report['check_seconds']:.2f}s", flush=True)
        return result

    def bk(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`bk ARGS` on ctl with the admin token."""
        run = self.ctl.run([BK, *args], check=False, timeout=timeout, env=self.client_env())
        assert not check or run.returncode == 0, f"bk {' '.join(args)}: {run.stdout}{run.stderr}"
        return run

    def writable_bookies(self) -> list[str]:
        return sorted(b["bookie_id"] for b in json.loads(self.bk("bookies", "list", "--json").stdout))

    def supervisor_pid(self, host: str, program: str) -> int:
        """The pid of a supervisor program on a host; 0 when it does not run."""
        out = self.hosts[host].run(["supervisorctl", "-c", SUPERVISOR_CONF, "pid", program], check=False).stdout
        return int(out.strip()) if out.strip().isdigit() else 0

    def ledger_bookies(self) -> dict[str, list[str]]:
        """Every ledger's bookies (over all its ensembles), read on ctl."""
        run = self.ctl.run([sys.executable, "-c", LEDGERS], env=self.client_env(), check=False, timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
        ledgers: dict[str, list[str]] = json.loads(run.stdout)
        return ledgers

    def zk_mode(self, name: str) -> str:
        """A ZooKeeper server's Mode (leader, follower ...) from `srvr` on its host's plain port; '' if none."""
        script = ("exec 3<>/dev/tcp/127.0.0.1/2181 && printf srvr >&3 && cat <&3")
        run = self.hosts[name].run(["bash", "-c", script], check=False, timeout=15)
        return next((line.split(":", 1)[1].strip() for line in run.stdout.splitlines() if line.startswith("Mode:")), "")

    def wait_writable(self, count: int, timeout_s: float = 120) -> list[str]:
        def writable() -> list[str]:
            bookies = self.writable_bookies()
            return bookies if len(bookies) == count else []

        return wait_until(f"{count} writable bookies", writable, timeout_s=timeout_s, every_s=2)

    def host_processes(self, host: Host) -> list[str]:
        """The host's processes other than its sshd: '<pid> <command line>'."""
        out = []
        for pid in host.pids():
            try:
                if Path(f"/proc/{pid}/comm").read_text().startswith("sshd"):
                    continue
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                out.append(f"{pid} {cmdline}")
            except OSError:
                continue
        return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, built_wheel: Path) -> Iterator[Cluster]:
    """The hosts, the inventory and the first site.yml (with the previous wheel); at the end
    teardown.yml -e purge=true unless a test ran it, and the hosts removed whatever failed."""
    work = tmp_path_factory.mktemp("multihost")
    started = time.monotonic()
    make_wheelhouse(built_wheel, work)
    _step("wheelhouse", started)
    hosts = TestHosts(work / "hosts", list(HOSTS), private_paths=("/srv", "/tmp"))
    started = time.monotonic()
    with hosts:
        _step("hosts", started)
        ctl_dir = hosts["ctl"].backing_dir(CTL)
        (ctl_dir / "dist").mkdir(parents=True)
        (ctl_dir / "verify").mkdir()
        wheel = Path(shutil.copy(built_wheel, ctl_dir / "dist"))
        previous = relabel_wheel(wheel, PREVIOUS_LABEL, ctl_dir / "dist")
        (ctl_dir / "inventory.ini").write_text(inventory(hosts))
        dep = Cluster(hosts=hosts, wheel=Path(CTL, "dist", wheel.name), previous_wheel=Path(CTL, "dist", previous.name),
                      extra_vars=["-e", f"bookie_wheel={CTL}/dist/{previous.name}"])
        try:
            started = time.monotonic()
            dep.first_run = dep.playbook("site.yml")
            _step("deploy (site.yml, previous wheel)", started)
            yield dep
        finally:
            if not dep.torn_down:
                dep.playbook("teardown.yml", "-e", "purge=true")


# -- the tests, in order --------------------------------------------------------------

@pytest.mark.timeout(PLAYBOOK_TIMEOUT_S + 600)
def test_site_deploys_a_quorum_and_four_bookies_that_pass_smoke_checks_from_ctl(cluster: Cluster) -> None:
    """site.yml on 3 ZooKeeper hosts + 4 bookie hosts: every host changed, none failed; the
    quorum has one leader and two followers talking TLS 1.3 to each other; from ctl (neither
    ZooKeeper nor a bookie) `bk bookies list` shows the 4 bookies writable at their hosts'
    addresses and `bk simpletest` (3/2/2) passes with the client token."""
    first = recap(cluster.first_run)
    assert set(first) == set(ZOOKEEPERS + BOOKIES), first
    assert all(changed > 0 and failed == 0 for changed, _, failed in first.values()), first
    assert cluster.writable_bookies() == sorted(cluster.bookie_id(b) for b in BOOKIES)
    modes = sorted(cluster.zk_mode(z) for z in ZOOKEEPERS)
    assert modes == ["follower", "follower", "leader"], modes
    for z in ZOOKEEPERS:
        zoo_cfg = (cluster.hosts[z].backing_dir("/srv") / "zookeeper" / "conf" / "zoo.cfg").read_text()
        assert "sslQuorum=true\n" in zoo_cfg and f"server.3={cluster.hosts['zk3'].address}:2888:3888\n" in zoo_cfg
        log = (cluster.hosts[z].backing_dir("/srv") / "zookeeper" / "log" / "zookeeper.log").read_text()
        assert "Using TLS encrypted quorum communication" in log and "TLSv1.3" in log, log[-3000:]
    run = cluster.ctl.run([str(Path(sys.executable).parent / "bk"), "simpletest", "-n", "200"],
                          env=cluster.client_env("client"), check=False, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    toml = (cluster.hosts["bk2"].backing_dir("/srv") / "bookkeeper" / "etc" / "bookie.toml").read_text()
    assert f'advertised_address = "{cluster.hosts["bk2"].address}"\n' in toml, toml


def test_second_site_run_changes_nothing(cluster: Cluster) -> None:
    """A second site.yml reports changed=0 on every host, every bookie's pid unchanged."""
    before = {b: cluster.supervisor_pid(b, "bookie") for b in BOOKIES}
    started = time.monotonic()
    second = recap(cluster.playbook("site.yml"))
    _step("second site.yml", started)
    assert second == {h: (0, 0, 0) for h in ZOOKEEPERS + BOOKIES}, second
    assert {b: cluster.supervisor_pid(b, "bookie") for b in BOOKIES} == before


def test_rolling_restart_under_load(cluster: Cluster) -> None:
    """rolling_restart.yml restarts the 4 bookies one at a time under the load: no anomaly,
    no writer error, every bookie a new pid."""
    before = {b: cluster.supervisor_pid(b, "bookie") for b in BOOKIES}
    cluster.under_load("rolling restart", lambda: cluster.playbook("rolling_restart.yml"))
    after = {b: cluster.supervisor_pid(b, "bookie") for b in BOOKIES}
    assert all(after[b] not in (0, before[b]) for b in BOOKIES), (before, after)


def test_rolling_upgrade_to_the_new_wheel_under_load(cluster: Cluster) -> None:
    """site.yml --limit bookies (the bookies' upgrade, ansible/README.md) with this tree's
    wheel replaces the previous one on each bookie, restarting them one at a time under the
    load: every bookie then runs the new package (a new pid, the venv's version without the
    previous label), with no anomaly and no writer error, and ZooKeeper is left alone."""
    before = {b: cluster.supervisor_pid(b, "bookie") for b in BOOKIES}
    zookeepers = {z: cluster.supervisor_pid(z, "zookeeper") for z in ZOOKEEPERS}
    assert all(zookeepers.values()), zookeepers
    cluster.extra_vars = ["-e", f"bookie_wheel={cluster.wheel}"]
    result = recap(cluster.under_load("rolling upgrade", lambda: cluster.playbook("site.yml", "--limit", "bookies")))
    assert set(result) == set(BOOKIES) and all(c > 0 and u == f == 0 for c, u, f in result.values()), result
    assert {z: cluster.supervisor_pid(z, "zookeeper") for z in ZOOKEEPERS} == zookeepers
    version = cluster.wheel.name.split("-")[1]
    for b in BOOKIES:
        installed = cluster.hosts[b].run(["/srv/bookkeeper/venv/bin/python", "-c",
                                          "import importlib.metadata as m; print(m.version('bookkeeper-py'))"])
        assert installed.stdout.strip() == version, (b, installed.stdout)
        assert cluster.supervisor_pid(b, "bookie") not in (0, before[b]), b


def test_zookeeper_leader_killed_and_back_under_load(cluster: Cluster) -> None:
    """The quorum's leader host loses its processes (ZooKeeper and its supervisord) under the
    load; the two others elect a leader, the writers go on; its supervisord started again
    brings the server back as a follower."""
    leader = next(z for z in ZOOKEEPERS if cluster.zk_mode(z) == "leader")

    def fault() -> None:
        started = time.monotonic()
        assert cluster.hosts[leader].kill_processes()
        elected = wait_until("a new ZooKeeper leader", lambda: next(
            (z for z in ZOOKEEPERS if z != leader and cluster.zk_mode(z) == "leader"), None), timeout_s=60, every_s=0.5)
        _step(f"ZooKeeper leader {leader} killed, {elected} elected", started)
        time.sleep(5)
        cluster.hosts[leader].run(["env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "supervisord", "-c",
                                   SUPERVISOR_CONF])
        wait_until(f"{leader} back as a follower", lambda: cluster.zk_mode(leader) == "follower", timeout_s=90,
                   every_s=1)
        _step(f"ZooKeeper {leader} back", started)

    cluster.under_load("ZooKeeper leader kill", fault)


def test_partition_of_a_bookie_host_drop_then_reset_under_load(cluster: Cluster) -> None:
    """bk2 cut off from every other host for 20 s by silent drops, healed, then for 5 s by
    resets, healed: the writers replace it and see no error, nothing acknowledged is lost;
    bk2 is writable again afterwards."""
    bk2 = cluster.hosts["bk2"]

    def fault() -> None:
        try:
            bk2.partition("drop")
            time.sleep(20)
            bk2.heal()
            time.sleep(3)
            bk2.partition("reset")
            time.sleep(5)
        finally:
            bk2.heal()
        time.sleep(2)

    cluster.under_load("partition of bk2", fault)
    cluster.wait_writable(len(BOOKIES))


LEDGERS = """
import asyncio, json, os
from bookkeeper import BookKeeper
from bookkeeper.cli.common import client_settings
async def main():
    async with await BookKeeper.connect(os.environ["BK_METADATA_URI"], **client_settings()) as bk:
        out = {}
        async for lid in bk.list_ledgers():
            segments = (await bk.ledger_metadata(lid)).to_json_dict()["ensembles"]
            out[lid] = sorted({b for s in segments for b in s["bookies"]})
    print(json.dumps(out))
asyncio.run(main())
"""


def test_loss_of_a_bookie_host_for_good(cluster: Cluster) -> None:
    """bk4's processes killed and its directories removed under the load: no anomaly, no
    writer error; auto-recovery re-replicates its copies (of every ledger the earlier steps
    kept) until no ledger's ensemble names it and nothing is under-replicated, and `bk
    decommission` retires it: 3 writable bookies left."""
    lost = cluster.hosts["bk4"]
    lost_id = cluster.bookie_id("bk4")
    naming_before = [lid for lid, bookies in cluster.ledger_bookies().items() if lost_id in bookies]
    assert naming_before, "no ledger has a copy on bk4: nothing to re-replicate"

    def fault() -> None:
        lost.kill_processes()
        for path in lost.backing_dir("/srv").iterdir():  # its contents: the directory is the host's /srv mount
            shutil.rmtree(path)
        time.sleep(10)

    started = time.monotonic()
    cluster.under_load("loss of bk4", fault)

    def replicated() -> list[str]:
        ensembles = cluster.ledger_bookies()
        naming = [lid for lid, bookies in ensembles.items() if lost_id in bookies]
        under = json.loads(cluster.bk("autorecovery", "list", "--json").stdout)
        return [] if naming or under else list(ensembles)

    ledgers = wait_until("the lost bookie's ledgers re-replicated", replicated, timeout_s=RECOVERY_TIMEOUT_S,
                         every_s=5)
    _step(f"bk4 lost: {len(naming_before)} ledgers had copies on it, all {len(ledgers)} fully replicated "
          "without it", started)
    cluster.bk("decommission", lost_id, "--timeout-s", "120", timeout=180)
    _step("bk4 decommissioned", started)
    assert cluster.writable_bookies() == sorted(cluster.bookie_id(b) for b in BOOKIES[:3])


def test_bk_verify_check_over_every_history_finds_nothing_lost(cluster: Cluster) -> None:
    """`bk verify check` re-reads every round's history of every step offline: no anomaly,
    nothing lost; the checker's time per million operations printed."""
    assert set(cluster.loads) == {"rolling restart", "rolling upgrade", "ZooKeeper leader kill", "partition of bk2",
                                  "loss of bk4"}, cluster.loads.keys()
    ops, seconds = 0, 0.0
    for step, report in cluster.loads.items():
        assert report["acked"] > 0, step
        run = cluster.ctl.run([BK, "verify", "check", report["history_file"], "--json"], check=False, timeout=300)
        checked = json.loads(run.stdout)
        assert run.returncode == 0 and not checked["anomalies"], (report["history_file"], checked["anomalies"])
        ops, seconds = ops + checked["ops"], seconds + checked["check_seconds"]
    print(f"bk verify check: {ops} ops in {seconds:.2f}s, {seconds / max(ops, 1) * 1e6:.1f}s per 10^6 ops; "
          "acknowledged per step:", {step: report["acked"] for step, report in cluster.loads.items()})


def test_teardown_purges_every_host(cluster: Cluster) -> None:
    """teardown.yml -e purge=true: no process but sshd left on any ZooKeeper or bookie host,
    the roles' directories gone (ctl keeps Ansible's ssh connections for a minute)."""
    started = time.monotonic()
    cluster.playbook("teardown.yml", "-e", "purge=true")
    cluster.torn_down = True
    _step("teardown.yml -e purge=true", started)
    left = {name: cluster.host_processes(cluster.hosts[name]) for name in ZOOKEEPERS + BOOKIES}
    assert not any(left.values()), left
    for name in ZOOKEEPERS + BOOKIES:
        srv = cluster.hosts[name].backing_dir("/srv")
        assert not [p for p in ("zookeeper/data", "zookeeper/conf", "bookkeeper/etc", "bookkeeper/data",
                                "bookkeeper/venv", "supervisor/supervisord.conf") if (srv / p).exists()], \
            (name, sorted(srv.rglob("*"))[:20])
