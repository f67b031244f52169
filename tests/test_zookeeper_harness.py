"""The ZooKeeper test harness starts a real server, serves clients, and cleans up."""

from __future__ import annotations

import os
import socket

import pytest
from kazoo.client import KazooClient

from bookkeeper.testing.cluster import free_port_block
from bookkeeper.testing.zookeeper import ZooKeeperServer, free_port


@pytest.mark.timeout(60)
def test_start_roundtrip_stop_leaves_no_process(tmp_path) -> None:
    zk = ZooKeeperServer(tmp_path / "zk")
    with zk:
        pid = zk.pid
        assert pid is not None
        assert zk.connect_string == f"127.0.0.1:{zk.port}"
        assert zk.metadata_uri() == f"zk://127.0.0.1:{zk.port}/ledgers"

        client = KazooClient(hosts=zk.connect_string, timeout=10)
        client.start(timeout=15)
        try:
            client.create("/ledgers/harness", b"hello", makepath=True)
            data, stat = client.get("/ledgers/harness")
            assert data == b"hello"
            assert stat.version == 0
        finally:
            client.stop()
            client.close()

    assert zk.pid is None
    assert not os.path.exists(f"/proc/{pid}"), "ZooKeeper JVM still alive after stop()"
    zk.stop()  # idempotent


@pytest.mark.timeout(60)
def test_start_fails_clearly_when_port_taken(tmp_path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", free_port()))
        squatter.listen()
        port = squatter.getsockname()[1]

        zk = ZooKeeperServer(tmp_path / "zk", port=port)
        with pytest.raises(RuntimeError, match=rf"port {port} on 127\.0\.0\.1 is already in use"):
            zk.start()
        assert zk.pid is None


def test_port_blocks_of_one_process_never_overlap() -> None:
    """A cluster picks every bookie's block before any binds: 500 two-port blocks from one
    process share no port (independent random picks in a worker's slice overlapped ~30 times
    in 500, and a shard then failed to bind)."""
    bases = [free_port_block(2) for _ in range(500)]
    assert len({p for base in bases for p in (base, base + 1)}) == 1000
