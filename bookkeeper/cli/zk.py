"""`bk zk ...`: the cluster's ZooKeeper tree (docs/metadata.md, ACLs; docs/api.md section 2).

`bk zk secure` converts an open tree in place while it is used (bookkeeper/meta/secure.py):
the seal key published, ACLs on every znode, every ledger password sealed. The credentials
come from --zk-auth or BK_ZK_AUTH, the read-only principal from --readonly-user or
BK_ZK_READONLY_USER: prefer the environment, since a command line is visible to every local
user (ps). Nothing printed names a password.
"""
from __future__ import annotations

import argparse
import os
from typing import Any

from bookkeeper.cli.common import UsageError, client_settings, error_line, metadata_uri
from bookkeeper.meta.sealing import load_private_key, public_bytes, write_private_key
from bookkeeper.meta.secure import secure_tree
from bookkeeper.meta.zk import ZkMetadataStore
from bookkeeper.meta.zk_security import ZkSecurity, read_zk_auth


def _seal_public_key(store: ZkMetadataStore, seal_key: str | None) -> bytes:
    """The public key to seal to: --seal-key's (made, 0600, when the file does not exist), else
    the one the cluster already has."""
    if seal_key:
        if os.path.exists(seal_key):
            return public_bytes(load_private_key(seal_key))
        key = write_private_key(seal_key)
        error_line(f"bk: wrote a new seal key to {seal_key} (mode 0600): give it to every bookie as "
                   f"password_seal_key_file")
        return public_bytes(key)
    if store.doc.seal_public_key is None:
        raise UsageError("the cluster has no seal key yet: pass --seal-key PATH (made if it does not exist; "
                         "then every bookie's password_seal_key_file)")
    return store.doc.seal_public_key


def cmd_zk_secure(args: argparse.Namespace) -> int:
    auth = read_zk_auth(args.zk_auth or os.environ.get("BK_ZK_AUTH", ""))
    if not auth.startswith("digest:"):
        raise UsageError("bk zk secure needs --zk-auth digest:USER:PASSWORD or file:/path (or BK_ZK_AUTH): the "
                         "tree is secured for that principal")
    settings = client_settings()
    security = ZkSecurity(auth=auth, tls_ca_file=settings.get("tls_ca_file", ""),
                          tls_cert_file=settings.get("tls_cert_file", ""), tls_key_file=settings.get("tls_key_file", ""))
    readonly = args.readonly_user or os.environ.get("BK_ZK_READONLY_USER") or None
    store = ZkMetadataStore(metadata_uri(args), create=False, security=security)
    try:
        report = secure_tree(store, public_key=_seal_public_key(store, args.seal_key), readonly=readonly,
                             progress=lambda line: print(line, flush=True))
    finally:
        store.close()
    print(f"secured: {report.nodes} znodes ({report.acls_set} ACLs changed), {report.ledgers} ledgers "
          f"({report.passwords_sealed} passwords sealed)")
    return 0


def add_zk_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    """`bk zk secure`."""
    s = sub.add_parser("zk", parents=[common], help="the cluster's ZooKeeper tree: ACLs, sealed passwords")
    zsub = s.add_subparsers(dest="zk_cmd", required=True)
    s = zsub.add_parser("secure", parents=[common],
                        help="put ACLs on every znode and seal every ledger password, in place, live")
    s.add_argument("--uri", dest="metadata_uri", default=argparse.SUPPRESS, metavar="URI",
                   help="the metadata URI (as --metadata-uri)")
    s.add_argument("--zk-auth", default="", metavar="CREDENTIAL",
                   help="the cluster's writing principal, digest:USER:PASSWORD (default: BK_ZK_AUTH)")
    s.add_argument("--readonly-user", default="", metavar="USER:PASSWORD",
                   help="a principal given READ on every znode (default: BK_ZK_READONLY_USER)")
    s.add_argument("--seal-key", default="", metavar="PATH",
                   help="the X25519 private key bookies hold (password_seal_key_file); made if PATH does not exist")
    s.set_defaults(func=cmd_zk_secure)
