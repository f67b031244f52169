"""LedgerMetadata.deserialize (bookkeeper/meta/ledger_metadata.py): the bytes of a ledger's znode,
which anyone with write access to the metadata store could have written.

Properties: deserialize either returns metadata or raises BKError ("corrupt ledger
metadata: ..."), never another exception; metadata it returns can be used (its ensembles
looked up, shown, serialized) and serializes back to the same metadata. Anything else is a
crash.
"""
from __future__ import annotations

import json

from bookkeeper.errors import BKError
from bookkeeper.meta.ledger_metadata import DigestType, LedgerMetadata, LedgerState


def one_input(data: bytes) -> None:
    try:
        md = LedgerMetadata.deserialize(data, version=3)
    except BKError:
        return
    md.ensemble_for(0)
    md.ensemble_for(md.last_entry_id)
    md.to_json_dict()
    assert LedgerMetadata.deserialize(md.serialize(), version=3) == md, "serialize/deserialize differs"
    if md.is_closed:  # feedback for atheris
        pass


def _metadata(**changes: object) -> LedgerMetadata:
    base = LedgerMetadata(ledger_id=7, ensemble_size=3, write_quorum=2, ack_quorum=2, digest=DigestType.CRC32C,
                          password_digest="ab" * 32,  # a digest's shape: seeds stay the same bytes
                          ensembles={0: ["127.0.0.1:3181", "127.0.0.1:3182", "127.0.0.1:3183"]},
                          ctime=1_700_000_000_000, password=b"fuzz")
    return base.replace(**changes)


def seeds() -> list[bytes]:
    three = ["127.0.0.1:3181", "127.0.0.1:3182", "127.0.0.1:3183"]
    return [
        _metadata().serialize(),
        _metadata(state=LedgerState.CLOSED, last_entry_id=99, length=12_345, digest=DigestType.MAC).serialize(),
        _metadata(ensembles={0: three, 50: three[::-1]}, writer_ensembles={0: three},
                  state=LedgerState.IN_RECOVERY, custom_metadata={"app": b"\x00\xffbytes"}).serialize(),
        json.dumps({**_metadata().to_json_dict(), "format_version": 2}).encode(),
    ]
