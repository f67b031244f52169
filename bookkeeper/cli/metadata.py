"""`bk metadata status|upgrade`: the cluster's metadata layout version (docs/metadata.md).

The layout is what a client or bookie must know to read and write the tree: today, how
ledger ids are allocated (layout 1: a sequential znode per id under `idgen`, which wraps at
2^31; layout 2: ids reserved in blocks from one counter, up to 2^63 - 1). `upgrade` is the
one migration: idempotent, safe while clients run (an old client's next create fails naming
the upgrade; none can collide with an id handed out after it).
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from bookkeeper.cli.common import client_settings, metadata_uri
from bookkeeper.client.config import ClientConfig
from bookkeeper.meta.zk import ZkMetadataStore
from bookkeeper.meta.zk_security import zk_security_from


def _store(args: argparse.Namespace) -> ZkMetadataStore:
    """The store with the CLI's client settings (BK_* environment: credentials, TLS)."""
    security = zk_security_from(ClientConfig(**client_settings()).validate())
    return ZkMetadataStore(metadata_uri(args), create=False, security=security)


def cmd_metadata_status(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        status = store.layout_status()
    finally:
        store.close()
    if args.json:
        print(json.dumps(status))
    else:
        print(f"layout {status['layout']} ({status['allocator']}); this client supports up to "
              f"{status['supported']}; next ledger id {status['next_id']}")
        if status["layout"] < status["supported"]:
            print("run `bk metadata upgrade` once every client and bookie runs this version")
    return 0


def cmd_metadata_upgrade(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        before = store.layout_version()
        status = store.upgrade_layout()
    finally:
        store.close()
    changed = before != status["layout"]
    if args.json:
        print(json.dumps({**status, "changed": changed}))
    elif changed:
        print(f"upgraded layout {before} -> {status['layout']}; next ledger id {status['next_id']}")
    else:
        print(f"already at layout {status['layout']}: nothing to do")
    return 0


def add_metadata_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("metadata", parents=[common], help="the metadata layout version: status, upgrade")
    msub = s.add_subparsers(dest="metadata_cmd", required=True)
    s = msub.add_parser("status", parents=[common], help="the layout version and the id allocator in use")
    s.add_argument("--json", action="store_true", help='{"layout", "supported", "allocator", "next_id"}')
    s.set_defaults(func=cmd_metadata_status)
    s = msub.add_parser("upgrade", parents=[common],
                        help="move the cluster to the newest layout (idempotent; old clients' creates then fail)")
    s.add_argument("--json", action="store_true", help="status after the upgrade, with changed: true|false")
    s.set_defaults(func=cmd_metadata_upgrade)
