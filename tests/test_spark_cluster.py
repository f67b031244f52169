"""Spark standalone on test hosts: executors on two other hosts read the bookies directly.

Reference: issue 24 item 6 and its acceptance ("Spark standalone with executors on two other
hosts: bulk read and streaming results equal the plain client's"); docs/spark.md, "Spark on a
cluster". Four test hosts (bookkeeper.testing.hosts, network namespaces on one bridge, /srv
and /tmp private to each): "store" runs ZooKeeper and 3 bookies binding and advertising its
address; "master" runs the standalone master (the pyspark package's own `spark-class`) and the
driver; "w1" and "w2" run a worker each (1 core, 1 GiB), so each gets one executor (512 MiB).
The programs each host runs are tests/spark_cluster_proc.py's roles; the driver finds the
master in PYSPARK_SUBMIT_ARGS, as docs/spark.md's example programs do on a cluster. The plain
client reads the same ledgers and stream from "master", across the bridge too.

Checked: the bulk read's rows and the streaming query's records equal the plain client's; every
row and record was read by an executor on w1 or w2 (both used), Spark's block managers are the
driver's on master and one executor's on each worker; the bookies advertise store's address.

Why not also run examples/spark_*.py here: each is a Spark application of its own (a driver
JVM and two executors more, ~30 s each on a quiet 2-core machine, minutes under load), and the
module must stay within its share of the suite; the examples run whole in tests/test_spark.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyspark
import pytest

from bookkeeper.testing.cluster import LocalCluster
from bookkeeper.testing.hosts import Host, TestHosts, namespaces_unavailable
from bookkeeper.testing.zookeeper import ZooKeeperServer, find_java

pytestmark = [pytest.mark.cluster, pytest.mark.runtime(90)]
REPO = Path(__file__).resolve().parents[1]
SPARK_HOME = Path(pyspark.__file__).parent
MASTER_PORT = 7077
RUN_TIMEOUT_S = 240  # the driver's whole run: a JVM, two executors, two queries on a busy machine


@dataclass
class SparkCluster:
    """The module's hosts, what the store host announced and the ledgers written to it."""

    hosts: TestHosts
    metadata_uri: str
    bookie_ids: list[str]
    ledger_ids: list[int]
    logs: Path

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def role(self, host: str, *args: str) -> Any:
        """Run a role of tests/spark_cluster_proc.py on a host, with the environment of a driver
        of the standalone cluster (PYSPARK_SUBMIT_ARGS); its JSON output."""
        env = spark_env(self.host(host), PYSPARK_SUBMIT_ARGS=submit_args(self.host("master")))
        proc = self.host(host).run([sys.executable, "-m", "tests.spark_cluster_proc", *args], check=False,
                                   timeout=RUN_TIMEOUT_S, cwd=REPO, env=env)
        assert proc.returncode == 0, f"{args[0]} on {host} failed:\n{proc.stderr[-4000:]}\n{self.log_tails()}"
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def log_tails(self) -> str:
        return "\n".join(f"--- {p.name}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                         for p in sorted(self.logs.glob("*.log")))


def spark_env(host: Host, **more: str) -> dict[str, str]:
    """The environment of every Spark process on `host`: this JRE (ZooKeeper's), the pyspark
    package as SPARK_HOME, this interpreter for Python workers, and the host's own address."""
    java_home = str(Path(os.path.realpath(find_java())).parents[1])
    return {**os.environ, "JAVA_HOME": java_home, "SPARK_HOME": str(SPARK_HOME), "PYSPARK_PYTHON": sys.executable,
            "SPARK_LOCAL_IP": host.address, "SPARK_DAEMON_MEMORY": "256m",
            "SPARK_DAEMON_JAVA_OPTS": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC", **more}


def submit_args(master: Host) -> str:
    """PYSPARK_SUBMIT_ARGS of a driver on the master host: the standalone master, the driver's
    own address (executors connect back to it), one executor of 1 core and 512 MiB per worker,
    C1-only executor JVMs (small queries on a 2-core machine), no UI or progress bars."""
    return (f"--master spark://{master.address}:{MASTER_PORT} --conf spark.driver.host={master.address} "
            f"--conf spark.driver.bindAddress={master.address} --conf spark.executor.memory=512m "
            "--conf spark.executor.cores=1 --conf spark.cores.max=2 --conf spark.sql.shuffle.partitions=2 "
            "--conf spark.executor.extraJavaOptions=-XX:TieredStopAtLevel=1 --conf spark.ui.enabled=false "
            "--conf spark.ui.showConsoleProgress=false pyspark-shell")


def _start(host: Host, argv: list[str], log: Path, **kwargs: Any) -> subprocess.Popen[Any]:
    with open(log, "ab") as out:
        return host.popen(argv, stdout=kwargs.pop("stdout", out), stderr=out, cwd=REPO, **kwargs)


def _spark_class(host: Host, cls: str, *args: str, log: Path) -> subprocess.Popen[Any]:
    """A Spark daemon from the pyspark package's own spark-class (it execs the JVM: the pid is the JVM's)."""
    return _start(host, [str(SPARK_HOME / "bin" / "spark-class"), cls, "--host", host.address, *args], log,
                  env=spark_env(host), stdin=subprocess.DEVNULL)


def _stop(proc: subprocess.Popen[Any]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _announcement(proc: subprocess.Popen[str], log: Path) -> dict[str, Any]:
    """The store role's one JSON line, printed once its cluster is up (EOF: it failed)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the store host's cluster did not start:\n{log.read_text(errors='replace')[-4000:]}"
    return dict(json.loads(line))


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    """ZooKeeper + 3 bookies on store, the master on master, a worker on each of w1 and w2;
    four ledgers and a stream written; everything stopped (and every host removed) at the end."""
    reason = namespaces_unavailable()
    if reason is not None:
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("spark-cluster")
    logs = workdir / "logs"
    logs.mkdir()
    with TestHosts(workdir, ["store", "master", "w1", "w2"], private_paths=("/srv", "/tmp")) as hosts:
        store = _start(hosts["store"], [sys.executable, "-m", "tests.spark_cluster_proc", "store", "/srv/bk",
                                        hosts["store"].address], logs / "store.log",
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        master_url = f"spark://{hosts['master'].address}:{MASTER_PORT}"
        daemons = [_spark_class(hosts["master"], "org.apache.spark.deploy.master.Master", "--port", str(MASTER_PORT),
                                "--webui-port", "8080", log=logs / "master.log")]
        daemons += [_spark_class(hosts[w], "org.apache.spark.deploy.worker.Worker", "--cores", "1", "--memory", "1g",
                                 "--work-dir", "/tmp/spark-work", "--webui-port", "8081", master_url,
                                 log=logs / f"{w}.log") for w in ("w1", "w2")]
        try:
            announced = _announcement(store, logs / "store.log")
            cluster = SparkCluster(hosts, announced["metadata_uri"], announced["bookie_ids"], [], logs)
            cluster.ledger_ids = cluster.role("master", "write", cluster.metadata_uri)
            yield cluster
        finally:
            for daemon in daemons:
                _stop(daemon)
            if store.stdin is not None:
                store.stdin.close()  # the store role stops its cluster at EOF
            try:
                store.wait(60)
            except subprocess.TimeoutExpired:
                store.kill()
                store.wait()


@pytest.fixture(scope="module")
def plain(spark_cluster: SparkCluster) -> dict[str, list[list[Any]]]:
    """What the plain client reads, from the master host."""
    c = spark_cluster
    return dict(c.role("master", "read", c.metadata_uri, json.dumps(c.ledger_ids)))


@pytest.fixture(scope="module")
def spark_run(spark_cluster: SparkCluster) -> dict[str, Any]:
    """The driver's run on the master host: the bulk read and the streaming query."""
    c = spark_cluster
    return dict(c.role("master", "driver", c.metadata_uri, c.host("store").address, ",".join(map(str, c.ledger_ids))))


def test_the_store_hosts_cluster_binds_and_advertises_its_address(spark_cluster: SparkCluster) -> None:
    """LocalCluster(address=...): ZooKeeper's URI and every bookie id name the store's address,
    not loopback, and a client on another host (the master) wrote through them."""
    store = spark_cluster.host("store").address
    assert spark_cluster.metadata_uri.startswith(f"zk://{store}:")
    assert len(spark_cluster.bookie_ids) == 3
    assert all(b.startswith(f"{store}:") for b in spark_cluster.bookie_ids)
    assert len(spark_cluster.ledger_ids) == 4


def test_bulk_read_on_the_cluster_equals_the_plain_clients_read(spark_run: dict[str, Any],
                                                                plain: dict[str, list[list[Any]]]) -> None:
    """The Spark batch source, 16 partitions over four ledgers, read by the executors: the same
    (ledger, entry, bytes) rows as the plain client, each once."""
    assert spark_run["partitions"] == 16
    assert sorted(r[:3] for r in spark_run["rows"]) == sorted(plain["rows"])
    assert len(plain["rows"]) == 300 + 350 + 400 + 450


def test_streaming_query_on_the_cluster_equals_the_plain_clients_read(spark_run: dict[str, Any],
                                                                      plain: dict[str, list[list[Any]]]) -> None:
    """An availableNow query over a stream of three segments, at most 300 records a micro-batch:
    the same (position, txid, bytes) records as the plain client, each once, in several batches."""
    assert sorted(r[:3] for r in spark_run["records"]) == sorted(plain["records"])
    assert len(plain["records"]) == 1000
    assert len({r[4] for r in spark_run["records"]}) >= 4


def test_executors_ran_on_the_worker_hosts_and_the_driver_on_its_own(spark_cluster: SparkCluster,
                                                                     spark_run: dict[str, Any]) -> None:
    """Every row and record was read in an executor on w1 or w2, both of them used; Spark's block
    managers are the driver's at the master's address and one executor's on each worker."""
    workers = {spark_cluster.host(w).address for w in ("w1", "w2")}
    master = spark_cluster.host("master").address
    assert {r[3] for r in spark_run["rows"]} == workers
    assert {r[3] for r in spark_run["records"]} <= workers
    assert spark_run["driver"] == master and master not in workers
    assert sorted(b.rsplit(":", 1)[0] for b in spark_run["block_managers"]) == sorted([master, *workers])


def test_a_harness_address_that_is_not_ipv4_or_not_this_hosts_is_named(tmp_path: Path) -> None:
    """The harness's `address` is checked: ZooKeeper wants one IPv4 address, and a cluster's
    ports are checked on the address itself, so an address this host does not have is named
    at once, not taken for busy ports."""
    with pytest.raises(ValueError, match="address must be one IPv4 address such as 127.0.0.1, got 'store'"):
        ZooKeeperServer(tmp_path / "zk", address="store")
    with pytest.raises(ValueError, match=r"is '192\.0\.2\.1' an address of this host\?"):
        LocalCluster(tmp_path / "cluster", address="192.0.2.1")

