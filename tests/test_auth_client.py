"""The client's side of authentication and authorization (issue 23 items 2 and 5): the AUTH
exchange's decisions as tables, then real bookies (LocalCluster) that authenticate with
tokens and authorize by role. Every refusal is an AuthenticationError or AuthorizationError
naming its reason, raised when the bookie answers, not when a request times out (the elapsed
time is printed, not asserted).
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bookkeeper import BookKeeper, errors
from bookkeeper.client.bookie_client import auth_answer, auth_frame_payload, bookie_reason, start_tls_answer
from bookkeeper.client.digest import master_key
from bookkeeper.proto import NO_KEY, Flag, Op, Status
from bookkeeper.security.tokens import mint_token, read_keys_file
from bookkeeper.testing.cluster import LocalCluster
from tests.conftest import run

pytestmark = pytest.mark.runtime(40)

PEER = "127.0.0.1:3181"


# -- decisions (sans-I/O) ---------------------------------------------------------------
@pytest.mark.parametrize("status,done,payload,expected", [
    (Status.OK, 1, b"alice", True),                     # authenticated
    (Status.OK, 0, b"challenge", False),                # another round expected
    (Status.AUTHENTICATION, 0, b"bad signature", "bookie 127.0.0.1:3181: auth token: AUTHENTICATION: bad signature"),
    (Status.AUTHENTICATION, 0, b"", "bookie 127.0.0.1:3181: auth token: AUTHENTICATION"),
    (Status.UNKNOWN_OP, 0, b"", "bookie 127.0.0.1:3181 does not authenticate clients (auth_provider = token"),
    (Status.BAD_REQUEST, 0, b"", "bookie 127.0.0.1:3181: auth token: BAD_REQUEST"),
])
def test_auth_answer(status: int, done: int, payload: bytes, expected: bool | str) -> None:
    """OK says done or another round; anything else, UNKNOWN_OP included, is an
    AuthenticationError naming the bookie, the plug-in and the bookie's reason."""
    if isinstance(expected, bool):
        assert auth_answer(status, done, payload, plugin="token", peer=PEER) is expected
        return
    with pytest.raises(errors.AuthenticationError) as e:
        auth_answer(status, done, payload, plugin="token", peer=PEER)
    assert str(e.value).startswith(expected)


@pytest.mark.parametrize("status,mode,expected", [
    (Status.OK, "optional", True),
    (Status.OK, "require", True),
    (Status.UNKNOWN_OP, "optional", False),             # a bookie without TLS: plain text
    (Status.UNKNOWN_OP, "require", "does not offer TLS (tls = require on this client)"),
    (Status.AUTHENTICATION, "optional", "TLS: AUTHENTICATION: nope"),
])
def test_start_tls_answer(status: int, mode: str, expected: bool | str) -> None:
    if isinstance(expected, bool):
        assert start_tls_answer(status, b"nope", mode=mode, peer=PEER) is expected
        return
    with pytest.raises(errors.AuthenticationError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        start_tls_answer(status, b"nope", mode=mode, peer=PEER)


def test_auth_frame_payload_and_reason_text() -> None:
    """u8 n + name + payload; a name that cannot be framed is a ConfigError; a bookie's reason
    is quoted bounded and undecodable bytes replaced, never an exception of their own."""
    assert auth_frame_payload("token", b"bk1.x.y") == b"\x05tokenbk1.x.y"
    for bad in ("", "x" * 256, "tökén"):
        with pytest.raises(errors.ConfigError):
            auth_frame_payload(bad, b"")
    assert bookie_reason(Status.FORBIDDEN, memoryview(b"principal 'r' lacks role 'write'")) == \
        "FORBIDDEN: principal 'r' lacks role 'write'"
    assert bookie_reason(99, b"") == "99"
    assert len(bookie_reason(Status.FORBIDDEN, b"\xff" * 10_000)) < 600


def test_auto_recovery_in_a_bookie_connects_with_the_bookies_own_credentials(tmp_path: Path) -> None:
    """The bookie's TLS mode and CA, its certificate as the client certificate, its plug-in and
    token, its seal key; none of the TLS files when tls is off; a token bookie without its own token is a
    ConfigError naming auto-recovery (not retries forever)."""
    from bookkeeper.autorecovery.service import bookie_client_trust
    from bookkeeper.config import BookieConfig

    files = {}
    for name in ("cert", "key", "ca", "keys"):
        files[name] = str(tmp_path / name)
        Path(files[name]).write_text("x")
    base = {"metadata_uri": "zk://127.0.0.1:2181/ledgers", "journal_dir": str(tmp_path), "ledger_dirs": [str(tmp_path)]}
    cfg = BookieConfig(**base, tls="require", tls_cert_file=files["cert"], tls_key_file=files["key"],
                       tls_ca_file=files["ca"], tls_client_auth=True, auth_provider="token",
                       auth_token_keys_file=files["keys"], auth_token="bk1.a.b", zk_auth="digest:u:p",
                       password_seal_key_file=files["keys"])
    assert bookie_client_trust(cfg) == {
        "tls": "require", "tls_reload_interval_s": 60.0, "tls_ca_file": files["ca"], "tls_cert_file": files["cert"],
        "tls_key_file": files["key"], "auth_provider": "token", "auth_token": "bk1.a.b", "zk_auth": "digest:u:p",
        "password_seal_key_file": files["keys"]}
    plain = BookieConfig(**base)
    assert bookie_client_trust(plain) == {"tls": "off", "tls_reload_interval_s": 60.0, "auth_provider": "",
                                          "auth_token": "", "zk_auth": "", "password_seal_key_file": ""}
    tokenless = BookieConfig(**base, auth_provider="token", auth_token_keys_file=files["keys"])
    with pytest.raises(errors.ConfigError, match="auto-recovery .* needs auth_token"):
        bookie_client_trust(tokenless)


# -- real bookies -----------------------------------------------------------------------
class KerberosLike:
    """A client plug-in the token bookies do not know (loaded by its dotted path)."""

    name = "kerberos"

    def new_session(self) -> KerberosLike:
        return self

    def first(self) -> bytes:
        return b"ticket"

    def step(self, reply: bytes) -> bytes | None:
        return None

    def renew_after_s(self) -> float | None:
        return None


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """3 bookies authenticating tokens (plain TCP), authorizing by role."""
    d = tmp_path_factory.mktemp("auth")
    authz = d / "authz.toml"
    authz.write_text('[principals]\n"writer" = ["write", "read", "recover"]\n"reader" = ["read"]\n'
                     '"nowrite" = ["read", "recover"]\n"other" = ["write", "read"]\n"ops" = ["admin"]\n')
    c = LocalCluster(d / "cluster", bookies=3, shards=1,
                     bookie_trust={"auth_provider": "token", "authz_file": str(authz)})
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _secret(cluster: LocalCluster) -> bytes:
    return read_keys_file(cluster.token_keys_file)[LocalCluster.TOKEN_KEY_ID]


async def _refused(cluster: LocalCluster, **kwargs: Any) -> BaseException:
    """The error a client with these connect keywords gets at its first ledger (timed): at
    create_ledger, which asks a bookie who the client is (WHOAMI) to record the creator."""
    async with await BookKeeper.connect(cluster.metadata_uri, add_timeout_s=30.0, read_timeout_s=30.0, **kwargs) as bk:
        t0 = time.perf_counter()
        with pytest.raises(errors.BKError) as e:
            lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
            await lh.add_entry(b"x")
        print(f"refused after {(time.perf_counter() - t0) * 1000:.1f} ms: {type(e.value).__name__}: {e.value}")
        return e.value


@pytest.mark.cluster
@pytest.mark.parametrize("case,expected", [
    ("bad signature", "bad signature"),
    ("expired token", "expired at"),
    ("unknown plug-in", "unknown plug-in 'kerberos'"),
    ("no token", "authentication required"),
])
def test_each_bad_credential_fails_with_its_reason_not_a_timeout(token_cluster: LocalCluster, case: str,
                                                                  expected: str) -> None:
    """The first ledger fails with AuthenticationError (not TimeoutError, with 30 s add and read
    timeouts) whose message names the bookie and the reason."""
    kid = LocalCluster.TOKEN_KEY_ID
    kwargs = {
        "bad signature": {"auth_provider": "token",
                          "auth_token": mint_token(subject="writer", ttl_s=60, key_id=kid, secret=os.urandom(32))},
        "expired token": {"auth_provider": "token", "auth_token": mint_token(
            subject="writer", ttl_s=60, key_id=kid, secret=_secret(token_cluster), now=time.time() - 120)},
        "unknown plug-in": {"auth_provider": "tests.test_auth_client:KerberosLike"},
        "no token": {},
    }[case]
    err = run(_refused(token_cluster, **kwargs))
    assert isinstance(err, errors.AuthenticationError), f"{type(err).__name__}: {err}"
    assert not isinstance(err, errors.TimeoutError)
    assert expected in str(err) and "bookie 127.0.0.1:" in str(err)


@pytest.mark.cluster
def test_renewal_in_band_keeps_a_client_working_past_its_first_tokens_expiry(token_cluster: LocalCluster,
                                                                             tmp_path: Path) -> None:
    """auth_token = file:/path holding a token valid 4 s, replaced on disk by a longer one after
    1 s: the client renews on its open connections before the first expires (the bookie would
    close them at expiry), so adds run for 7 s without an error and over the same transports."""
    token_file = tmp_path / "token"
    secret = _secret(token_cluster)
    token_file.write_text(mint_token(subject="writer", ttl_s=4, key_id=LocalCluster.TOKEN_KEY_ID, secret=secret))

    async def main() -> None:
        async with await BookKeeper.connect(token_cluster.metadata_uri, auth_provider="token",
                                            auth_token=f"file:{token_file}") as bk:
            lh = await bk.create_ledger(ensemble=3, write_quorum=3, ack_quorum=3)
            await lh.add_entry(b"first")
            transports = {id(c): c._transport for c in bk.pool._conns.values()}
            await asyncio.sleep(1)
            token_file.write_text(mint_token(subject="writer", ttl_s=600, key_id=LocalCluster.TOKEN_KEY_ID,
                                             secret=secret))
            t_end = time.monotonic() + 6
            n = 1
            while time.monotonic() < t_end:
                await lh.add_entry(b"x" * 100)
                n += 1
                await asyncio.sleep(0.05)
            assert {id(c): c._transport for c in bk.pool._conns.values()} == transports, "reconnected"
            assert lh.last_add_confirmed == n - 1
            print(f"{n} adds over 7 s, past the first token's expiry, on the first connections")
            await lh.close()
    run(main())


@pytest.mark.cluster
def test_a_read_principal_reads_but_its_add_and_fence_are_refused_naming_the_role(
        token_cluster: LocalCluster) -> None:
    async def main() -> None:
        async with await BookKeeper.connect(token_cluster.metadata_uri, **token_cluster.client_trust("writer")) as w, \
                await BookKeeper.connect(token_cluster.metadata_uri, **token_cluster.client_trust("reader")) as r:
            lh = await w.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, password=b"pw")
            for i in range(5):
                await lh.add_entry(b"entry-%d" % i)
            rh = await r.open_ledger(lh.ledger_id, password=b"pw", recovery=False)
            assert [e.data for e in await rh.read(0, 3)] == [b"entry-%d" % i for i in range(4)]
            bookie = lh.metadata.last_ensemble[0]
            key = master_key(b"pw")
            t0 = time.perf_counter()
            with pytest.raises(errors.AuthorizationError, match="principal 'reader' lacks role 'write'"):
                await r.pool.call(bookie, Op.ADD_ENTRY, 0, lh.ledger_id, 100, key, payload=b"x" * 40)
            print(f"add refused in {(time.perf_counter() - t0) * 1000:.1f} ms")
            with pytest.raises(errors.AuthorizationError, match="principal 'reader' lacks role 'recover'") as e:
                await r.pool.call(bookie, Op.READ_LAC, Flag.FENCE, lh.ledger_id, -1, key)
            assert f"bookie {bookie}" in str(e.value)
            await lh.add_entry(b"still writable")  # nothing was fenced
            await lh.close()
    run(main())


@pytest.mark.cluster
def test_a_principal_without_write_cannot_claim_an_unknown_ledger_id(token_cluster: LocalCluster) -> None:
    async def main() -> None:
        async with await BookKeeper.connect(token_cluster.metadata_uri, **token_cluster.client_trust("nowrite")) as bk:
            lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
            with pytest.raises(errors.AuthorizationError, match="principal 'nowrite' lacks role 'write'"):
                await lh.add_entry(b"claim")
            with pytest.raises(errors.NoSuchLedgerError):  # nothing was created on the bookie
                await bk.pool.call(lh.metadata.last_ensemble[0], Op.READ_LAC, 0, lh.ledger_id, -1, NO_KEY)
    run(main())


@pytest.mark.cluster
def test_only_the_creator_or_an_admin_deletes_a_ledger(token_cluster: LocalCluster) -> None:
    """Metadata records the creator as the bookies authenticated it (WHOAMI); another principal
    without `admin` is refused naming itself and the role, and the ledger stays; an admin may."""
    uri = token_cluster.metadata_uri

    async def main() -> None:
        async with await BookKeeper.connect(uri, **token_cluster.client_trust("writer")) as w, \
                await BookKeeper.connect(uri, **token_cluster.client_trust("other")) as o, \
                await BookKeeper.connect(uri, **token_cluster.client_trust("ops")) as ops:
            assert await o.whoami() == ("other", frozenset({"write", "read"}))
            mine, theirs = [await w.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2) for _ in range(2)]
            assert (await o.ledger_metadata(mine.ledger_id)).creator == "writer"
            with pytest.raises(errors.AuthorizationError,
                               match=f"principal 'other' lacks role 'admin': ledger {mine.ledger_id} was created by "
                                     f"'writer'"):
                await o.delete_ledger(mine.ledger_id)
            assert (await w.ledger_metadata(mine.ledger_id)).creator == "writer"  # still there
            await w.delete_ledger(mine.ledger_id)  # its creator
            await ops.delete_ledger(theirs.ledger_id)  # an admin
            for lid in (mine.ledger_id, theirs.ledger_id):
                with pytest.raises(errors.NoSuchLedgerError):
                    await w.ledger_metadata(lid)
    run(main())


@pytest.mark.cluster
def test_an_admins_delete_reads_no_metadata(token_cluster: LocalCluster) -> None:
    """An admin (its roles as the bookies last said, within ROLES_FRESH_S) deletes anyone's
    ledger with the delete alone; a principal without `admin` reads the metadata first to
    find the creator, as before. Counted at the store's metadata read: the admin's first
    delete reads (it has not asked WHOAMI yet: the read finds another's ledger, and the
    WHOAMI that settles it says admin), its next two do not."""
    uri = token_cluster.metadata_uri

    async def main() -> None:
        async with await BookKeeper.connect(uri, **token_cluster.client_trust("writer")) as w, \
                await BookKeeper.connect(uri, **token_cluster.client_trust("ops")) as ops:
            theirs = [await w.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2) for _ in range(3)]
            mine = await w.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
            reads: dict[str, int] = {"ops": 0, "writer": 0}
            for name, bk in (("ops", ops), ("writer", w)):
                real = bk.store.read_ledger_async

                def counted(lid: int, name: str = name, real=real):  # noqa: ANN001, ANN202
                    reads[name] += 1
                    return real(lid)
                bk.store.read_ledger_async = counted
            for lh in theirs:
                await ops.delete_ledger(lh.ledger_id)
            await w.delete_ledger(mine.ledger_id)
            assert reads == {"ops": 1, "writer": 1}
            for lid in [lh.ledger_id for lh in theirs] + [mine.ledger_id]:
                assert not await asyncio.get_running_loop().run_in_executor(None, w.store.ledger_exists, lid)
    run(main())


@pytest.mark.cluster
def test_recover_and_decommission_need_the_admin_role(token_cluster: LocalCluster) -> None:
    """Refused before anything is written (no decommissioning marker), naming principal and role."""
    from bookkeeper.autorecovery.operations import decommission_bookie, recover_bookie

    async def main() -> None:
        async with await BookKeeper.connect(token_cluster.metadata_uri, **token_cluster.client_trust("writer")) as w:
            victim = token_cluster.bookies[0].bookie_id
            with pytest.raises(errors.AuthorizationError, match="principal 'writer' lacks role 'admin'"):
                await recover_bookie(w, victim, grace_s=1, timeout_s=5, on_ledger=print, on_note=print)
            with pytest.raises(errors.AuthorizationError, match="principal 'writer' lacks role 'admin'"):
                await decommission_bookie(w, victim, grace_s=1, readonly_timeout_s=5, timeout_s=5,
                                          on_ledger=print, on_note=print)
            assert not await w.metadata_call(w.store.zk.exists, w.store.decommissioning_path(victim))
    run(main())


@pytest.mark.cluster
def test_an_optional_client_never_sends_its_token_in_plain_text(token_cluster: LocalCluster, tmp_path: Path) -> None:
    """A bookie (or a man in the middle) answering START_TLS with UNKNOWN_OP gets no token from a
    `tls = optional` client: its identity was never checked, and the token could be replayed."""
    import trustme

    ca_file = tmp_path / "ca.pem"
    trustme.CA().cert_pem.write_to_path(str(ca_file))
    kwargs = {**token_cluster.client_trust("writer"), "tls": "optional", "tls_ca_file": str(ca_file)}
    err = run(_refused(token_cluster, **kwargs))
    assert isinstance(err, errors.AuthenticationError), f"{type(err).__name__}: {err}"
    assert "does not offer TLS" in str(err) and "not sent in plain text" in str(err)
    assert token_cluster.bookies[0].bookie_id.split(":")[0] in str(err)
