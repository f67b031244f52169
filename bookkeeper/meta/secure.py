"""`bk zk secure`: an open metadata tree converted in place, live (docs/metadata.md, ACLs).

Order, chosen so that writers keep working throughout:
1. the security znode first: the public key (so every store's watch learns it and seals from
   then on) and the read-only principal's digest id (so their new znodes carry its READ);
2. ACLs top-down from the root: a parent is closed to `world` before its children are listed,
   so a node made meanwhile by a writer without credentials is refused, and one made by a
   writer with them carries the same ACL already (its `auth` ACL is the same digest id);
3. ledger passwords sealed, each by a compare-and-set of its znode (a lost race reads again),
   pass after pass until one finds no clear password, since a writer that wrote before its
   watch fired may have written one. A format-1 digest (a fast, unsalted sha256: readable
   by the read-only principal, so brute-forceable offline) becomes a salted scrypt in the
   same write (~27 ms of CPU per such ledger).
Idempotent: a secured tree is walked and nothing is written.

Writers must already hold the credentials the tree is secured with (their zk_auth, the one
writing principal of the cluster): the conversion closes the tree to everyone else.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kazoo.exceptions import BadVersionError, NoNodeError
from kazoo.security import ACL

from bookkeeper.errors import ConfigError, MetadataVersionError, NoSuchLedgerError
from bookkeeper.meta.ledger_metadata import SCRYPT_PREFIX, LedgerMetadata, password_digest
from bookkeeper.meta.zk import ZkMetadataStore, ledger_path, retired_acls
from bookkeeper.meta.zk_security import SecurityDoc, digest_credentials, digest_id, secured_acls

MAX_SEAL_PASSES = 10  # a pass that seals nothing ends it; writers learn the key within a watch


@dataclass(slots=True)
class SecureReport:
    """What a conversion did: every figure 0 but `nodes` on an already secured tree."""

    nodes: int = 0            # znodes walked
    acls_set: int = 0         # of which the ACL was changed
    ledgers: int = 0          # ledger znodes read
    passwords_sealed: int = 0
    seal_passes: int = 0


def _same(a: list[ACL], b: list[ACL]) -> bool:
    return {(x.perms, x.id.scheme, x.id.id) for x in a} == {(x.perms, x.id.scheme, x.id.id) for x in b}


def secure_acls(store: ZkMetadataStore, acls: list[ACL], report: SecureReport) -> None:
    """Set `acls` on the root and every znode under it, parents before children; a retired
    idgen (layout 2) keeps read and admin only, so no client can allocate from it again."""
    stack = [store.root]
    retired = store.layout_version() >= 2
    while stack:
        path = stack.pop()
        want = retired_acls(acls) if retired and path == store.idgen_path else acls
        try:
            current, stat = store.zk.get_acls(path)
            if not _same(current, want):
                store.zk.set_acls(path, want, version=stat.aversion)
                report.acls_set += 1
            children = store.zk.get_children(path)
        except NoNodeError:
            continue  # deleted meanwhile (an ephemeral, a removed ledger)
        except BadVersionError:
            stack.append(path)  # its ACL changed under us: look again
            continue
        report.nodes += 1
        stack.extend(f"{path}/{child}" for child in sorted(children, reverse=True))


def seal_passwords(store: ZkMetadataStore, report: SecureReport) -> int:
    """One pass over every ledger: a clear password is sealed (the store seals what it writes
    once the cluster has a key). Returns how many it sealed."""
    sealed = 0
    for ledger_id in store.list_ledgers():
        report.ledgers += 1
        path = ledger_path(store.root, ledger_id)
        while True:
            try:
                data, stat = store.zk.get(path)
            except NoNodeError:
                break
            md = LedgerMetadata.deserialize(data, version=stat.version)
            if md.password is None:
                break
            if not md.password_digest.startswith(SCRYPT_PREFIX):  # format 1's fast sha256: brute-forceable
                md = md.replace(password_digest=password_digest(md.password))
            try:
                store.write_ledger(md)
            except MetadataVersionError:
                continue  # a writer changed it meanwhile: read it again
            except NoSuchLedgerError:
                break
            sealed += 1
            break
    report.passwords_sealed += sealed
    return sealed


def secure_tree(store: ZkMetadataStore, *, public_key: bytes, readonly: str | None = None,
                progress: Callable[[str], None] = lambda _line: None) -> SecureReport:
    """Convert the store's tree (the store connected with the writing principal's digest
    credentials): publish the key and the read-only principal, set ACLs, seal passwords."""
    if store.security.scheme != "digest":
        raise ConfigError("bk zk secure needs digest credentials (--zk-auth digest:USER:PASSWORD): the ACLs name "
                      "that principal")
    writer = digest_id(*digest_credentials(store.security.auth))
    ro = None
    if readonly is not None:
        user, sep, password = readonly.partition(":")
        if not sep:
            raise ConfigError("--readonly-user must be USER:PASSWORD")
        ro = digest_id(user, password)

    def change(doc: SecurityDoc) -> SecurityDoc:
        if doc.seal_public_key is not None and doc.seal_public_key != public_key:
            raise ConfigError("the cluster already seals ledger passwords to another public key: use the seal key "
                          "its bookies hold (password_seal_key_file)")
        return SecurityDoc(seal_public_key=public_key, readonly=ro or doc.readonly)
    doc = store.update_security(change)
    progress(f"security znode: seal key published, read-only principal "
             f"{doc.readonly.split(':', 1)[0] if doc.readonly else 'none'}")
    report = SecureReport()
    secure_acls(store, secured_acls(writer, doc.readonly), report)
    progress(f"ACLs: {report.acls_set} of {report.nodes} znodes changed")
    for _ in range(MAX_SEAL_PASSES):
        report.seal_passes += 1
        if seal_passwords(store, report) == 0:
            break
    else:
        raise ConfigError(f"ledger passwords were still written in the clear after {MAX_SEAL_PASSES} passes: a writer "
                      f"does not see the seal key (is it running an older version?)")
    progress(f"passwords: {report.passwords_sealed} sealed in {report.seal_passes} pass(es)")
    return report
