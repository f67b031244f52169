"""ZooKeeper ACLs, sealed ledger passwords, `bk zk secure` and ZooKeeper's TLS port (issue 23 item 4).

Against a real ZooKeeper (Debian's 3.8, bookkeeper/testing/zookeeper.py) with a TLS 1.3 port
and certificates made here (trustme). Every writer of the project's znodes runs through a
store with credentials (registrations, cookies, the id generator, ledgers, decommissioning,
under-replication marks, locks and election, streams, their segments and writer locks), then
the whole tree is walked: nothing is open to `world`. A tree written in the open is secured
by `bk zk secure` while a metadata writer with the credentials creates and closes ledgers
all along: 0 errors, and afterwards every znode is closed, every password sealed, and a
client without credentials (connected before) is refused each change with the reason.

Reference: docs/metadata.md (ACLs, sealed passwords), docs/api.md (`bk zk secure`).
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import trustme
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from kazoo.client import KazooClient
from kazoo.security import ACL, Id, Permissions

from bookkeeper import BookKeeper
from bookkeeper.autorecovery.replicator import UnreplicableError
from bookkeeper.autorecovery.replicator import _password as replicator_password
from bookkeeper.cli.zk import add_zk_parsers
from bookkeeper.errors import ConfigError, MetadataAuthError, ZooKeeperUnreachableError
from bookkeeper.meta.ledger_metadata import DigestType, LedgerMetadata, LedgerState, check_password, password_digest
from bookkeeper.meta.sealing import SealError, load_private_key, public_bytes, seal, unseal, write_private_key
from bookkeeper.meta.streams import Segment, StreamMeta, StreamStore
from bookkeeper.meta.underreplication import UnderReplicationManager
from bookkeeper.meta.zk import ZkMetadataStore, ledger_path, parse_metadata_uri
from bookkeeper.meta.zk_security import (SecurityDoc, ZkSecurity, digest_credentials, digest_id, kazoo_options,
                                         node_acls, zk_security_from)
from bookkeeper.stream import Namespace
from bookkeeper.testing.cluster import LocalCluster
from bookkeeper.testing.waiting import wait_until
from bookkeeper.testing.zookeeper import ZooKeeperServer
from tests.conftest import run

ADMIN = "digest:admin:s3cret-pw"
READER = "ro:ro-pw"
PASSWORD = b"the-ledger-password"


# -- decisions and primitives -------------------------------------------------------
@pytest.mark.parametrize("auth, user, password", [
    ("digest:bk:pw", "bk", "pw"),
    ("digest:bk:p:w:x", "bk", "p:w:x"),   # the password may hold colons
])
def test_digest_credentials(auth: str, user: str, password: str) -> None:
    assert digest_credentials(auth) == (user, password)


@pytest.mark.parametrize("auth", ["digest:", "digest:bk", "digest::pw", "digest:bk:", "sasl:x", "plain:bk:pw"])
def test_bad_credentials_are_a_config_error(auth: str) -> None:
    with pytest.raises(ConfigError, match="digest:USER:PASSWORD"):
        digest_credentials(auth)


def test_kazoo_options_carry_credentials_and_tls() -> None:
    assert kazoo_options(ZkSecurity(), tls=False) == {}
    assert kazoo_options(ZkSecurity(auth="digest:bk:pw"), tls=False) == {"auth_data": [("digest", "bk:pw")]}
    with pytest.raises(ConfigError, match="pure-sasl"):  # not installed here: said at once, not at connect
        kazoo_options(ZkSecurity(auth="sasl"), tls=False)
    tls = kazoo_options(ZkSecurity(tls_ca_file="/ca.pem"), tls=True)
    assert tls["use_ssl"] and tls["verify_certs"] and tls["check_hostname"] and tls["ca"] == "/ca.pem"
    with pytest.raises(ConfigError, match="tls_ca_file"):
        kazoo_options(ZkSecurity(), tls=True)


def test_security_names_no_password() -> None:
    s = ZkSecurity(auth="digest:bk:hunter2")
    assert "hunter2" not in repr(s) and s.principal == "bk"
    assert ZkSecurity().principal == "anonymous" and ZkSecurity(auth="sasl").principal == "sasl"


def test_zk_security_from_a_config_without_a_seal_key() -> None:
    cfg = argparse.Namespace(zk_auth="digest:a:b", tls_ca_file="ca", tls_cert_file="c", tls_key_file="k")
    assert zk_security_from(cfg) == ZkSecurity(auth="digest:a:b", tls_ca_file="ca", tls_cert_file="c",
                                               tls_key_file="k", seal_key_file="")


def test_node_acls_never_name_world() -> None:
    ro = digest_id("ro", "pw")
    assert node_acls(None) == [ACL(Permissions.ALL, Id("auth", ""))]
    assert node_acls(ro) == [ACL(Permissions.ALL, Id("auth", "")), ACL(Permissions.READ, Id("digest", ro))]
    assert ro.startswith("ro:") and ro != "ro:pw"  # a hash, not the password


SHA256_OF_A = hashlib.sha256(b"bookkeeper-py:a").hexdigest()  # the digest's first form


@pytest.mark.parametrize("digest, password, ok", [
    (SHA256_OF_A, b"a", True),
    (SHA256_OF_A, b"b", False),
    (password_digest(b"a"), b"a", True),
    (password_digest(b"a"), b"b", False),
    ("scrypt$16384$8$1$!!$!!", b"a", False),      # damaged: matches nothing, raises nothing
    ("scrypt$x", b"a", False),
    ("", b"", False),
], ids=["sha256-right", "sha256-wrong", "scrypt-right", "scrypt-wrong", "scrypt-damaged", "scrypt-short", "empty"])
def test_check_password(digest: str, password: bytes, ok: bool) -> None:
    assert check_password(password, digest) is ok


def test_digests_are_salted_scrypt() -> None:
    one, two = password_digest(b"a"), password_digest(b"a")
    assert one.startswith("scrypt$16384$8$1$") and one != two


def test_seal_opens_only_with_its_key_and_for_its_ledger() -> None:
    key, other = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    box = seal(public_bytes(key), PASSWORD, 7)
    assert base64.b64encode(PASSWORD).decode() not in box and PASSWORD.decode() not in box
    assert unseal(key, box, 7) == PASSWORD
    assert seal(public_bytes(key), PASSWORD, 7) != box  # a fresh ephemeral key per seal
    with pytest.raises(SealError, match="sealed to key .* private key held here is key"):
        unseal(other, box, 7)
    with pytest.raises(SealError, match="sealed for another ledger"):
        unseal(key, box, 8)
    damaged = box[:-4] + ("AAAA" if not box.endswith("AAAA") else "BBBB")
    with pytest.raises(SealError, match="does not open"):
        unseal(key, damaged, 7)
    with pytest.raises(SealError, match="unknown form"):
        unseal(key, "v9.x.y", 7)


def test_seal_key_file_is_0600_and_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "seal.pem"
    key = write_private_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert public_bytes(load_private_key(path)) == public_bytes(key)
    with pytest.raises(SealError, match="not overwriting"):
        write_private_key(path)
    (tmp_path / "junk.pem").write_text("junk")
    (tmp_path / "junk.pem").chmod(0o600)
    with pytest.raises(SealError, match="no unencrypted PEM private key"):
        load_private_key(tmp_path / "junk.pem")
    path.chmod(0o644)
    with pytest.raises(SealError, match=r"readable or writable by every user \(mode 0644\): chmod 600 it"):
        load_private_key(path)


def test_security_doc_round_trip() -> None:
    doc = SecurityDoc(seal_public_key=bytes(range(32)), readonly=digest_id("ro", "pw"))
    assert SecurityDoc.from_json(doc.to_json()) == doc
    assert SecurityDoc.from_json(None) == SecurityDoc()


# -- a real ZooKeeper with a TLS port ----------------------------------------------------
class Pki:
    def __init__(self, base: Path) -> None:
        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1", "localhost")
        key = serialization.load_pem_private_key(cert.private_key_pem.bytes(), None)
        pkcs8 = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())
        self.server_pem = base / "zk-server.pem"  # ZooKeeper's PEM key store: PKCS#8 key, then the chain
        self.server_pem.write_bytes(pkcs8 + b"".join(b.bytes() for b in cert.cert_chain_pems))
        self.ca = base / "ca.pem"
        ca.cert_pem.write_to_path(str(self.ca))
        self.other_ca = base / "other-ca.pem"
        trustme.CA().cert_pem.write_to_path(str(self.other_ca))


@pytest.fixture(scope="module")
def zk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ZooKeeperServer, Pki]]:
    base = tmp_path_factory.mktemp("zksec")
    pki = Pki(base)
    with ZooKeeperServer(base / "zk", tls_cert_file=pki.server_pem, tls_ca_file=pki.ca) as server:
        yield server, pki


def _uri(zk: tuple[ZooKeeperServer, Pki], root: str) -> str:
    return zk[0].metadata_uri(root, tls=False)


def _md(store: ZkMetadataStore, password: bytes = PASSWORD) -> LedgerMetadata:
    lid = store.allocate_ledger_id()
    return LedgerMetadata(ledger_id=lid, ensemble_size=1, write_quorum=1, ack_quorum=1, digest=DigestType.MAC,
                          password_digest=password_digest(password), ensembles={0: ["127.0.0.1:1"]},
                          password=password)


def _walk(kz: KazooClient, root: str) -> Iterator[tuple[str, list[ACL]]]:
    stack = [root]
    while stack:
        path = stack.pop()
        yield path, kz.get_acls(path)[0]
        stack.extend(f"{path}/{c}" for c in kz.get_children(path))


def bk_cli(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`bk` as a subprocess, with only these of the BK_ settings."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BK_")}
    return subprocess.run([sys.executable, "-m", "bookkeeper.cli.main", *argv], capture_output=True, text=True,
                          timeout=60, env={**clean, **env}, stdin=subprocess.DEVNULL)


def _superuser(server: ZooKeeperServer, auth: str = ADMIN) -> KazooClient:
    """A raw kazoo client with the writing principal's credentials, to walk the tree."""
    user, password = digest_credentials(auth)
    kz = KazooClient(hosts=server.connect_string, auth_data=[("digest", f"{user}:{password}")])
    kz.start(timeout=10)
    return kz


def _write_everything(store: ZkMetadataStore) -> int:
    """Every kind of znode the project writes, through the project's own writers; the ledger id."""
    store.register_bookie("127.0.0.1:3181", {"rack": "/r1"})
    store.register_bookie("127.0.0.1:3182", {"rack": "/r1"}, readonly=True)
    store.create_cookie("127.0.0.1:3181", {"dirs": ["/x"]})
    store.set_decommissioning("127.0.0.1:3182")
    md = store.create_ledger(_md(store))
    store.write_ledger(md.replace(state=LedgerState.CLOSED))
    urm = UnderReplicationManager(store)
    urm.ensure_layout()
    urm.mark(md.ledger_id, ["127.0.0.1:3182"])
    assert urm.try_lock(md.ledger_id)
    urm.join_election("127.0.0.1:3181")
    urm.set_enabled(False)
    streams = StreamStore(store.zk, store.root)
    streams.ensure_namespace("ns")
    meta = StreamMeta(name="s", ensemble=1, write_quorum=1, ack_quorum=1, retention_max_age_s=None,
                      retention_max_bytes=None, next_seq=0, ctime_ms=0)
    streams.create_stream("ns", meta)
    streams.add_segment("ns", streams.read_stream("ns", "s"), Segment(seq=0, ledger_id=md.ledger_id))
    streams.lock_create("ns", "s", b"writer")
    return md.ledger_id


def test_every_znode_written_with_credentials_is_closed_to_world(zk: tuple[ZooKeeperServer, Pki],
                                                                  tmp_path: Path) -> None:
    seal_key = tmp_path / "seal.pem"
    write_private_key(seal_key)
    root = "/acl-tree/ledgers"  # a parent level too: ensure_path's parents carry the ACL
    bookie = ZkMetadataStore(_uri(zk, root), security=ZkSecurity(auth=ADMIN, seal_key_file=str(seal_key)))
    kz = _superuser(zk[0])
    try:
        lid = _write_everything(bookie)
        nodes = list(_walk(kz, "/acl-tree"))  # the ephemeral ones too: while their session lives
    finally:
        bookie.close()
        kz.stop()
        kz.close()
    kinds = {"available", "readonly", "cookies", "idgen", "decommissioning", "security", "INSTANCEID", "ledgers",
             "locks", "auditorelection", "disabled", "streams", "ns", "s", "segments", "lock"}
    names = {p.rsplit("/", 1)[1] for p, _ in nodes}
    assert kinds <= names, kinds - names
    assert any(n.startswith("candidate-") for n in names) and any(n.startswith("w-") for n in names)
    assert f"L{lid % 10_000:04d}" in names
    admin = Id("digest", digest_id("admin", "s3cret-pw"))
    for path, acls in nodes:
        # idgen is retired (layout 2): read and admin only, so no client allocates from it
        perms = Permissions.READ | Permissions.ADMIN if path.endswith("/idgen") else Permissions.ALL
        assert acls == [ACL(perms, admin)], (path, acls)
    print(f"{len(nodes)} znodes walked, none open to world")


def test_a_ledger_password_is_readable_by_no_client(zk: tuple[ZooKeeperServer, Pki], tmp_path: Path) -> None:
    seal_key = tmp_path / "seal.pem"
    write_private_key(seal_key)
    uri = _uri(zk, "/sealed")
    bookie = ZkMetadataStore(uri, security=ZkSecurity(auth=ADMIN, seal_key_file=str(seal_key)))
    client = ZkMetadataStore(uri, create=False, security=ZkSecurity(auth=ADMIN))
    try:
        created = client.create_ledger(_md(client))
        assert created.password == PASSWORD and created.creator == "admin"  # the creator keeps its own
        data, _ = client.zk.get(_ledger_path(uri, created.ledger_id))
        stored = json.loads(data)
        assert "password" not in stored and stored["sealed_password"].startswith("v1.")
        assert PASSWORD not in data and base64.b64encode(PASSWORD) not in data
        assert stored["creator"] == "admin"
        md = client.read_ledger(created.ledger_id)
        with pytest.raises(SealError, match="sealed and this process holds no private key"):
            client.ledger_password(md)
        assert bookie.ledger_password(md) == PASSWORD and check_password(PASSWORD, md.password_digest)
        shown = json.dumps(md.to_json_dict())  # what `bk ledger metadata` prints
        assert "sealed_password" not in shown and '"password"' not in shown
        # A later metadata write (ensemble change, close) stays sealed.
        client.write_ledger(created.replace(state=LedgerState.CLOSED))
        assert "sealed_password" in json.loads(client.zk.get(_ledger_path(uri, created.ledger_id))[0])
    finally:
        client.close()
        bookie.close()


def _ledger_path(uri: str, ledger_id: int) -> str:
    return ledger_path(parse_metadata_uri(uri)[1], ledger_id)


def test_a_bookie_with_another_seal_key_is_refused(zk: tuple[ZooKeeperServer, Pki], tmp_path: Path) -> None:
    one, two = tmp_path / "one.pem", tmp_path / "two.pem"
    write_private_key(one)
    write_private_key(two)
    uri = _uri(zk, "/two-keys")
    ZkMetadataStore(uri, security=ZkSecurity(auth=ADMIN, seal_key_file=str(one))).close()
    with pytest.raises(SealError, match="every bookie needs the same private key"):
        ZkMetadataStore(uri, security=ZkSecurity(auth=ADMIN, seal_key_file=str(two)))


def _zk_secure(argv: list[str]) -> str:
    parser = argparse.ArgumentParser()
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--metadata-uri", default=argparse.SUPPRESS)
    add_zk_parsers(parser.add_subparsers(dest="cmd", required=True), common)
    args = parser.parse_args(argv)
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert args.func(args) == 0
    return buf.getvalue()


def test_bk_zk_secure_converts_a_live_tree(zk: tuple[ZooKeeperServer, Pki], tmp_path: Path) -> None:
    """An open tree (written without credentials) with a metadata writer that has the
    credentials creating, changing and closing ledgers throughout: 0 errors; then nothing is
    open, every password sealed, and the anonymous store (connected before) is refused each
    change naming why; a second run changes nothing."""
    uri = _uri(zk, "/live")
    anon = ZkMetadataStore(uri)
    _write_everything(anon)
    for _ in range(20):
        anon.create_ledger(_md(anon))
    writer = ZkMetadataStore(uri, create=False, security=ZkSecurity(auth=ADMIN))
    stop, errors, written = threading.Event(), [], [0]

    def write() -> None:
        while not stop.is_set():
            try:
                md = writer.create_ledger(_md(writer))
                md = writer.write_ledger(md.replace(ensembles={0: ["127.0.0.1:1"], 1: ["127.0.0.1:2"]}))
                writer.write_ledger(md.replace(state=LedgerState.CLOSED, last_entry_id=1))
                written[0] += 1
            except Exception as e:  # noqa: BLE001 - every error is counted and shown
                errors.append(e)
    thread = threading.Thread(target=write)
    thread.start()
    seal_key = tmp_path / "seal.pem"
    try:
        wait_until("the writer under way", lambda: written[0] >= 3 or errors, timeout_s=60, every_s=0.01)
        os.environ["BK_ZK_AUTH"] = ADMIN  # the environment, not the command line (ps shows that)
        t0 = time.perf_counter()
        out = _zk_secure(["zk", "secure", "--uri", uri, "--readonly-user", READER, "--seal-key", str(seal_key)])
        took = time.perf_counter() - t0
        before = written[0]
        wait_until("the writer going on on the secured tree", lambda: written[0] >= before + 3 or errors,
                   timeout_s=60, every_s=0.01)
    finally:
        stop.set()
        thread.join()
        os.environ.pop("BK_ZK_AUTH", None)
    print(out, f"conversion {took:.2f} s; the writer made {written[0]} ledgers meanwhile")
    assert errors == [], errors[:3]
    assert stat.S_IMODE(seal_key.stat().st_mode) == 0o600
    assert "s3cret-pw" not in out and "ro-pw" not in out
    kz = _superuser(zk[0])
    try:
        admin, ro = digest_id("admin", "s3cret-pw"), digest_id(*READER.split(":"))
        for path, acls in _walk(kz, "/live"):
            ids = {(a.id.scheme, a.id.id): a.perms for a in acls}
            writer_perms = Permissions.READ | Permissions.ADMIN if path.endswith("/idgen") else Permissions.ALL  # retired
            assert ids == {("digest", admin): writer_perms, ("digest", ro): Permissions.READ}, (path, acls)
        for lid in writer.list_ledgers():
            stored = json.loads(kz.get(_ledger_path(uri, lid))[0])
            assert "password" not in stored and "sealed_password" in stored, lid
    finally:
        kz.stop()
        kz.close()
    bookie = ZkMetadataStore(uri, create=False, security=ZkSecurity(auth=ADMIN, seal_key_file=str(seal_key)))
    try:
        some = next(iter(bookie.list_ledgers()))
        assert bookie.ledger_password(bookie.read_ledger(some)) == PASSWORD
    finally:
        bookie.close()
    # Without credentials: no registration, metadata change, delete or marker.
    md = writer.read_ledger(some)
    refusals = {
        "register": lambda: anon.register_bookie("127.0.0.1:9999", {}),
        "metadata change": lambda: anon.write_ledger(md.replace(state=LedgerState.CLOSED)),
        "delete": lambda: anon.delete_ledger(some),
        "marker": lambda: UnderReplicationManager(anon).mark(some, ["127.0.0.1:9"]),
        "new ledger": lambda: anon.create_ledger(_md(anon)),  # its id may come from a block reserved before
        "stream": lambda: StreamStore(anon.zk, anon.root).lock_create("ns", "s", b"x"),
    }
    for what, call in refusals.items():
        with pytest.raises(MetadataAuthError, match=r"ZooKeeper refused \w+.* on /live.*: no credentials "
                                                    r"\(set zk_auth\)"):
            call()
        print(what, "refused")
    anon.close()
    with pytest.raises(MetadataAuthError, match="no credentials"):
        ZkMetadataStore(uri, create=False)
    with pytest.raises(MetadataAuthError, match="to digest user 'admin'"):
        ZkMetadataStore(uri, create=False, security=ZkSecurity(auth="digest:admin:wrong"))
    reader = ZkMetadataStore(uri, create=False, security=ZkSecurity(auth=f"digest:{READER}"))
    try:
        assert reader.read_ledger(some).ledger_id == some  # a tool that only looks
        with pytest.raises(MetadataAuthError, match="to digest user 'ro'"):
            reader.delete_ledger(some)
    finally:
        reader.close()
    os.environ["BK_ZK_AUTH"] = ADMIN
    try:
        again = _zk_secure(["zk", "secure", "--uri", uri])  # idempotent: the cluster's key is reused
    finally:
        os.environ.pop("BK_ZK_AUTH", None)
    assert "0 ACLs changed" in again and "0 passwords sealed" in again, again
    writer.close()


def test_zookeeper_tls_port(zk: tuple[ZooKeeperServer, Pki]) -> None:
    """kazoo through the project's bounded-connect handler over TLS 1.3 works; a plain client on
    the TLS port starts no session; a server certificate from another CA is refused by name."""
    server, pki = zk
    uri = server.metadata_uri("/tls")
    assert uri.startswith("zk+tls://127.0.0.1:") and str(server.secure_port) in uri
    store = ZkMetadataStore(uri, security=ZkSecurity(auth=ADMIN, tls_ca_file=str(pki.ca)))
    try:
        md = store.create_ledger(_md(store))
        assert store.read_ledger(md.ledger_id).ledger_id == md.ledger_id
        sock = store.zk._connection._socket
        assert sock.version() == "TLSv1.3", sock.version()
    finally:
        store.close()
    plain = uri.replace("zk+tls://", "zk://")
    with pytest.raises(ZooKeeperUnreachableError, match="started no session"):
        ZkMetadataStore(plain, create=False, session_timeout_ms=2_000)
    with pytest.raises(ZooKeeperUnreachableError, match="certificate verify failed"):
        ZkMetadataStore(uri, create=False, session_timeout_ms=2_000,
                        security=ZkSecurity(tls_ca_file=str(pki.other_ca)))


def test_auto_recovery_unseals_with_the_private_key_only(zk: tuple[ZooKeeperServer, Pki], tmp_path: Path) -> None:
    """The replicator's password: unsealed by a store holding password_seal_key_file, and a
    clear UnreplicableError naming what is missing from one that does not."""
    seal_key = tmp_path / "seal.pem"
    write_private_key(seal_key)
    uri = _uri(zk, "/recovery")
    bookie = ZkMetadataStore(uri, security=ZkSecurity(auth=ADMIN, seal_key_file=str(seal_key)))
    client = ZkMetadataStore(uri, create=False, security=ZkSecurity(auth=ADMIN))
    try:
        md = client.read_ledger(client.create_ledger(_md(client)).ledger_id)
        assert md.password is None and md.sealed_password is not None
        assert replicator_password(md, bookie) == PASSWORD
        with pytest.raises(UnreplicableError, match="sealed and this process holds no private key .*"
                                                    "password_seal_key_file.*cannot be re-replicated"):
            replicator_password(md, client)
        with pytest.raises(UnreplicableError, match="does not match its password digest"):
            replicator_password(md.replace(password_digest=password_digest(b"other")), bookie)
    finally:
        client.close()
        bookie.close()


def test_a_cluster_with_credentials_leaves_nothing_open(tmp_path: Path) -> None:
    """3 bookies and a client with zk_auth, the bookies with the seal key: a 3/2/2 ledger, a
    stream and an under-replication mark; then no znode of the tree is open to world, the
    ledgers' passwords are sealed, `bk ledger metadata` prints neither form, and a client
    without credentials is refused at connect."""
    seal_key = tmp_path / "seal.pem"
    write_private_key(seal_key)
    cluster = LocalCluster(tmp_path / "c", bookies=3, shards=1,
                           bookie_conf={"zk_auth": ADMIN, "password_seal_key_file": str(seal_key)})
    cluster.start()
    try:
        uri = cluster.metadata_uri
        for b in cluster.bookies:  # the shards' config comes on stdin: no secret on a command line
            for pid in [b.pid, *b.shard_pids()]:
                assert ADMIN.split(":")[-1].encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()

        async def work() -> int:
            async with await BookKeeper.connect(uri, zk_auth=ADMIN) as bk:
                lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, password=PASSWORD)
                await lh.add_entries([b"entry %d" % i for i in range(20)])
                await lh.close()
                rh = await bk.open_ledger(lh.ledger_id, password=PASSWORD)
                assert [e.data for e in await rh.read(0, 1)] == [b"entry 0", b"entry 1"]
                urm = UnderReplicationManager(bk.store)
                await bk.metadata_call(urm.ensure_layout)
                await bk.metadata_call(urm.mark, lh.ledger_id, ["127.0.0.1:1"])
            async with await Namespace.connect(uri, "default", zk_auth=ADMIN) as ns:
                await ns.create_stream("events", ensemble=3, write_quorum=2, ack_quorum=2)
                async with await ns.open_writer("events") as w:
                    await w.write(b"record")
            return int(lh.ledger_id)
        lid = run(work())
        kz = _superuser(cluster.zk)
        try:
            nodes = list(_walk(kz, "/ledgers"))
            for path, acls in nodes:
                perms = Permissions.READ | Permissions.ADMIN if path.endswith("/idgen") else Permissions.ALL  # retired
                assert [(a.id.scheme, a.perms) for a in acls] == [("digest", perms)], (path, acls)
            names = {p.rsplit("/", 1)[1] for p, _ in nodes}
            assert {"available", "cookies", "underreplication", "streams", "events", "security"} <= names
            assert f"L{lid % 10_000:04d}" in names
            stored = json.loads(kz.get(_ledger_path(uri, lid))[0])
            assert "password" not in stored and stored["sealed_password"].startswith("v1.")
            assert stored["creator"] == "anonymous"  # the principal the bookies know (no auth_provider here)
        finally:
            kz.stop()
            kz.close()
        shown = bk_cli(["ledger", "metadata", str(lid), "--metadata-uri", uri], env={"BK_ZK_AUTH": ADMIN})
        assert shown.returncode == 0, shown.stderr
        assert '"creator": "anonymous"' in shown.stdout and "password\"" not in shown.stdout \
            and "sealed_password" not in shown.stdout
        refused = bk_cli(["ledgers", "list", "--metadata-uri", uri], env={})
        assert refused.returncode == 1 and "no credentials (set zk_auth)" in refused.stderr, refused.stderr
        print(f"{len(nodes)} znodes, none open; anonymous bk: {refused.stderr.strip()}")
    finally:
        cluster.stop()


def test_bk_zk_secure_under_a_writer_of_entries(tmp_path: Path) -> None:
    """A tree laid out and filled without credentials (the cluster's state before its
    migration), then bookies and a writer given zk_auth: the writer adds entries, and rolls to a
    new ledger every 50, through the whole `bk zk secure`: 0 errors; afterwards every znode is
    closed and every ledger's password sealed."""
    seal_key = tmp_path / "seal.pem"
    cluster = LocalCluster(tmp_path / "c", bookies=0, shards=1, bookie_conf={"zk_auth": ADMIN}).start()
    try:
        uri = cluster.metadata_uri
        before = ZkMetadataStore(uri)  # the open tree: layout and ledgers without credentials
        for _ in range(10):
            before.create_ledger(_md(before))
        before.close()
        for _ in range(3):
            cluster.add_bookie(wait=False)
        cluster.wait_registered()
        stop, counts = threading.Event(), {"entries": 0, "ledgers": 0}

        async def write() -> None:
            async with await BookKeeper.connect(uri, zk_auth=ADMIN) as bk:
                while not stop.is_set():
                    lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, password=PASSWORD)
                    for i in range(50):
                        await lh.add_entry(b"entry %d" % i)
                        counts["entries"] += 1
                    await lh.close()
                    counts["ledgers"] += 1
        result: list[BaseException | None] = []
        thread = threading.Thread(target=lambda: result.append(_capture(lambda: run(write()))))
        thread.start()
        wait_until("100 entries written", lambda: counts["entries"] >= 100 or not thread.is_alive(),
                   timeout_s=60, every_s=0.01)
        os.environ["BK_ZK_AUTH"] = ADMIN
        try:
            out = _zk_secure(["zk", "secure", "--uri", uri, "--seal-key", str(seal_key)])
        finally:
            os.environ.pop("BK_ZK_AUTH", None)
        mark = counts["entries"]
        wait_until("100 more entries on the secured tree",
                   lambda: counts["entries"] >= mark + 100 or not thread.is_alive(), timeout_s=60, every_s=0.01)
        stop.set()
        thread.join()
        print(out, f"writer: {counts['entries']} entries in {counts['ledgers']} ledgers, error: {result}")
        assert result == [None], result
        kz = _superuser(cluster.zk)
        try:
            for path, acls in _walk(kz, "/ledgers"):
                assert all(a.id.scheme == "digest" for a in acls), (path, acls)
            store = ZkMetadataStore(uri, create=False, security=ZkSecurity(auth=ADMIN))
            try:
                for lid in store.list_ledgers():
                    assert "password" not in json.loads(kz.get(_ledger_path(uri, lid))[0]), lid
            finally:
                store.close()
        finally:
            kz.stop()
            kz.close()
    finally:
        cluster.stop()


def _capture(fn: Callable[[], object]) -> BaseException | None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - handed to the test thread, which asserts on it
        return e
    return None


def test_zk_auth_from_a_file(tmp_path: Path) -> None:
    """zk_auth = file:/path keeps the password out of config files and the environment: the
    credential is the file's one line; a missing or empty file is a ConfigError naming it."""
    from bookkeeper.client.config import ClientConfig
    from bookkeeper.errors import ConfigError
    from bookkeeper.meta.zk_security import zk_security_from

    cred = tmp_path / "zk_auth"
    cred.write_text("digest:alice:s3cret\n")
    security = zk_security_from(ClientConfig(zk_auth=f"file:{cred}").validate())
    assert security.auth == "digest:alice:s3cret" and security.principal == "alice"
    assert "s3cret" not in repr(security)
    with pytest.raises(ConfigError, match="no such file"):
        ClientConfig(zk_auth=f"file:{tmp_path / 'missing'}").validate()
    cred.write_text("\n")
    with pytest.raises(ConfigError, match=f"zk_auth file {cred} must hold"):
        zk_security_from(ClientConfig(zk_auth=f"file:{cred}"))


def test_bk_zk_secure_replaces_a_format_1_sha256_digest_with_scrypt(zk: tuple[ZooKeeperServer, Pki],
                                                                    tmp_path: Path) -> None:
    """Found by review: the read-only principal could read format 1's fast unsalted sha256 of
    each old ledger's password (brute-forceable offline). The conversion salts it (scrypt) in the
    same write that seals the password; the password still opens the ledger."""
    uri = _uri(zk, "/old-digest")
    anon = ZkMetadataStore(uri)
    old = anon.create_ledger(_md(anon).replace(password_digest=hashlib.sha256(b"bookkeeper-py:" + PASSWORD).hexdigest()))
    anon.close()
    os.environ["BK_ZK_AUTH"] = ADMIN
    try:
        _zk_secure(["zk", "secure", "--uri", uri, "--seal-key", str(tmp_path / "seal.pem")])
    finally:
        os.environ.pop("BK_ZK_AUTH", None)
    kz = _superuser(zk[0])
    try:
        stored = json.loads(kz.get(_ledger_path(uri, old.ledger_id))[0])
    finally:
        kz.stop()
        kz.close()
    assert stored["password_digest"].startswith("scrypt$") and "password" not in stored
    assert check_password(PASSWORD, stored["password_digest"]) and not check_password(b"x", stored["password_digest"])
