"""Ledger metadata serialization (bookkeeper/meta/ledger_metadata.py) and entry digests
(bookkeeper/client/digest.py).

docs/api.md section 3 fixes the JSON shape of `bk ledger metadata`; digest.py fixes the
stored entry layout u64 ledger | i64 entry | i64 lac | u64 length | digest | data.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import struct

import crc32c
import pytest

from bookkeeper.client.digest import HEADER_BYTES, DigestManager, master_key
from bookkeeper.errors import BKError, DigestMismatchError
from bookkeeper.meta.ledger_metadata import (
    FORMAT_VERSION,
    DigestType,
    LedgerMetadata,
    LedgerState,
    check_password,
    password_digest,
)


def sample_metadata(**changes) -> LedgerMetadata:
    md = LedgerMetadata(
        ledger_id=123456789012,
        ensemble_size=3,
        write_quorum=2,
        ack_quorum=2,
        digest=DigestType.CRC32C,
        password_digest=password_digest(b"secret"),
        ensembles={0: ["10.0.0.1:3181", "10.0.0.2:3181", "10.0.0.3:3181"],
                   57: ["10.0.0.1:3181", "10.0.0.4:3181", "10.0.0.3:3181"]},
        state=LedgerState.CLOSED,
        last_entry_id=99,
        length=4096,
        custom_metadata={"app": b"demo", "bin": bytes(range(256)), "empty": b""},
        ctime=1_700_000_000_123,
    )
    return md.replace(**changes) if changes else md


# -- metadata ------------------------------------------------------------------------------


@pytest.mark.parametrize("changes", [
    {},
    {"state": LedgerState.OPEN, "last_entry_id": -1, "length": 0, "custom_metadata": {}},
    {"state": LedgerState.IN_RECOVERY, "digest": DigestType.MAC},
    {"digest": DigestType.DUMMY, "ensembles": {0: ["a:1"]}, "ensemble_size": 1, "write_quorum": 1,
     "ack_quorum": 1},
], ids=["closed", "open-empty", "in-recovery-mac", "dummy-single"])
def test_serialize_deserialize_round_trip(changes: dict) -> None:
    """deserialize(serialize(md)) gives back an equal LedgerMetadata (all fields, bytes custom metadata)."""
    md = sample_metadata(**changes)
    back = LedgerMetadata.deserialize(md.serialize(), version=7)
    assert back == md.replace(version=7)
    assert back.ensembles == md.ensembles and all(isinstance(k, int) for k in back.ensembles)
    assert back.custom_metadata == md.custom_metadata


def test_znode_version_is_not_serialized() -> None:
    """The znode version a snapshot was read at is not part of the stored bytes."""
    md = sample_metadata()
    assert md.replace(version=3).serialize() == md.replace(version=99).serialize()
    assert LedgerMetadata.deserialize(md.serialize()).version == -1


def test_serialized_json_has_documented_shape() -> None:
    """The JSON carries format_version and the docs/api.md keys: ensembles as list, custom_metadata base64, state name."""
    md = sample_metadata()
    d = json.loads(md.serialize())
    assert d["format_version"] == FORMAT_VERSION == 1
    for key in ("ledger_id", "state", "ensemble_size", "write_quorum", "ack_quorum", "last_entry_id",
                "length", "digest", "ensembles", "custom_metadata", "ctime"):
        assert key in d
    assert d["state"] == "CLOSED" and d["digest"] == "CRC32C"
    assert d["ensembles"] == [
        {"first_entry_id": 0, "bookies": ["10.0.0.1:3181", "10.0.0.2:3181", "10.0.0.3:3181"]},
        {"first_entry_id": 57, "bookies": ["10.0.0.1:3181", "10.0.0.4:3181", "10.0.0.3:3181"]},
    ]
    assert base64.b64decode(d["custom_metadata"]["bin"]) == bytes(range(256))
    assert md.to_json_dict() == d


def test_password_is_never_stored() -> None:
    """Metadata keeps a digest of the password, never the password itself."""
    md = sample_metadata()
    assert b"secret" not in md.serialize()
    assert check_password(b"secret", md.password_digest) and not check_password(b"other", md.password_digest)


def test_newer_format_version_is_refused() -> None:
    """A znode written in a format newer than this code knows is refused with a BKError, not misread."""
    d = sample_metadata().to_json_dict()
    d["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(BKError, match="newer"):
        LedgerMetadata.deserialize(json.dumps(d).encode())


def test_older_or_current_format_version_is_accepted() -> None:
    """The current format_version deserializes."""
    d = sample_metadata().to_json_dict()
    assert LedgerMetadata.deserialize(json.dumps(d).encode()).ledger_id == 123456789012


@pytest.mark.parametrize("data", [
    b"not json",
    b"{}",
    json.dumps({"format_version": 1}).encode(),
    json.dumps({**sample_metadata().to_json_dict(), "state": "HALF_OPEN"}).encode(),
    json.dumps({**sample_metadata().to_json_dict(), "digest": "MD5"}).encode(),
], ids=["garbage", "empty-object", "missing-fields", "bad-state", "bad-digest"])
def test_corrupt_metadata_raises_bk_error(data: bytes) -> None:
    """Corrupt or incomplete metadata raises a BKError, never a bare KeyError/ValueError."""
    with pytest.raises(BKError):
        LedgerMetadata.deserialize(data)


def test_ensemble_for_picks_segment_holding_entry() -> None:
    """ensemble_for(e) is the segment with the greatest first_entry_id <= e; last_ensemble is the newest."""
    md = sample_metadata()
    assert md.ensemble_for(0) == md.ensembles[0]
    assert md.ensemble_for(56) == md.ensembles[0]
    assert md.ensemble_for(57) == md.ensembles[57]
    assert md.ensemble_for(10_000) == md.ensembles[57]
    assert md.last_ensemble == md.ensembles[57]
    assert md.is_closed and not sample_metadata(state=LedgerState.OPEN).is_closed


# -- digests --------------------------------------------------------------------------------


DIGESTS = [DigestType.CRC32C, DigestType.MAC]


def test_master_key_is_20_bytes_and_depends_on_password() -> None:
    """master_key is the 20-byte key of the wire protocol, distinct per password."""
    assert len(master_key(b"pw")) == 20
    assert master_key(b"pw") == master_key(b"pw") != master_key(b"pw2")
    assert master_key(b"") != bytes(20)


@pytest.mark.parametrize("digest", DigestType, ids=lambda d: d.value)
def test_encode_verify_round_trip(digest: DigestType) -> None:
    """verify(encode(...)) returns (data, lac, length) unchanged."""
    dm = DigestManager(42, digest, b"secret")
    for eid, lac, length, data in [(0, -1, 0, b""), (7, 6, 1000, b"hello"), (2**40, 2**40 - 1, 2**62, bytes(5000))]:
        payload = dm.encode(eid, lac, length, data)
        assert len(payload) == HEADER_BYTES + dm.size + len(data)
        assert dm.verify(payload, eid) == (data, lac, length)


def test_crc32c_layout_and_value() -> None:
    """CRC32C: header | 4-byte big-endian CRC32C of header+data | data."""
    dm = DigestManager(5, DigestType.CRC32C, b"ignored")
    payload = dm.encode(3, 2, 11, b"hello world")
    header = struct.pack(">QqqQ", 5, 3, 2, 11)
    assert HEADER_BYTES == 32 and dm.size == 4
    assert payload[:32] == header
    assert payload[32:36] == struct.pack(">I", crc32c.crc32c(header + b"hello world"))
    assert payload[36:] == b"hello world"


def test_mac_layout_and_value() -> None:
    """MAC: header | 20-byte HMAC-SHA1 keyed from the password over header+data | data."""
    dm = DigestManager(5, DigestType.MAC, b"pw")
    payload = dm.encode(3, 2, 11, b"data")
    header = struct.pack(">QqqQ", 5, 3, 2, 11)
    assert dm.size == 20
    expected = hmac.new(hashlib.sha1(b"mac" + b"pw").digest(), header + b"data", hashlib.sha1).digest()
    assert payload[32:52] == expected and payload[52:] == b"data"


def test_crc32c_and_mac_differ_for_same_entry() -> None:
    """The digest type changes the encoding (a CRC32C entry is not a MAC entry)."""
    a = DigestManager(1, DigestType.CRC32C, b"pw").encode(0, -1, 3, b"abc")
    b = DigestManager(1, DigestType.MAC, b"pw").encode(0, -1, 3, b"abc")
    assert a != b
    with pytest.raises(DigestMismatchError):
        DigestManager(1, DigestType.MAC, b"pw").verify(a, 0)


@pytest.mark.parametrize("digest", DIGESTS, ids=lambda d: d.value)
def test_tampered_byte_anywhere_raises_digest_mismatch(digest: DigestType) -> None:
    """Flipping any single byte of a stored entry (header, digest or data) raises DigestMismatchError."""
    dm = DigestManager(77, digest, b"secret")
    payload = dm.encode(12, 11, 500, b"the quick brown fox")
    for i in range(len(payload)):
        for mask in (0x01, 0x80):
            bad = bytearray(payload)
            bad[i] ^= mask
            with pytest.raises(DigestMismatchError):
                dm.verify(bytes(bad), 12)


@pytest.mark.parametrize("digest", DIGESTS, ids=lambda d: d.value)
def test_wrong_entry_id_raises_digest_mismatch(digest: DigestType) -> None:
    """An entry returned for a different entry id (misfiled by a bookie) raises DigestMismatchError."""
    dm = DigestManager(77, digest, b"secret")
    payload = dm.encode(12, 11, 500, b"x")
    for asked in (11, 13, 0, -1):
        with pytest.raises(DigestMismatchError):
            dm.verify(payload, asked)


@pytest.mark.parametrize("digest", DIGESTS, ids=lambda d: d.value)
def test_wrong_ledger_raises_digest_mismatch(digest: DigestType) -> None:
    """An entry of another ledger raises DigestMismatchError."""
    payload = DigestManager(1, digest, b"secret").encode(0, -1, 1, b"x")
    with pytest.raises(DigestMismatchError):
        DigestManager(2, digest, b"secret").verify(payload, 0)


def test_mac_with_wrong_password_raises_digest_mismatch() -> None:
    """A MAC entry verified with a different password fails: the MAC is keyed from the password."""
    payload = DigestManager(1, DigestType.MAC, b"right").encode(0, -1, 1, b"x")
    with pytest.raises(DigestMismatchError):
        DigestManager(1, DigestType.MAC, b"wrong").verify(payload, 0)


@pytest.mark.parametrize("digest", DIGESTS, ids=lambda d: d.value)
def test_truncated_entry_raises_digest_mismatch(digest: DigestType) -> None:
    """A payload cut short (at or below header + digest, or inside the data) raises DigestMismatchError."""
    dm = DigestManager(9, digest, b"pw")
    payload = dm.encode(0, -1, 10, b"0123456789")
    for cut in range(len(payload)):
        with pytest.raises(DigestMismatchError):
            dm.verify(payload[:cut], 0)


@pytest.mark.parametrize("digest", DIGESTS, ids=lambda d: d.value)
def test_appended_byte_raises_digest_mismatch(digest: DigestType) -> None:
    """Extra bytes after the data change the digest input: DigestMismatchError."""
    dm = DigestManager(9, digest, b"pw")
    with pytest.raises(DigestMismatchError):
        dm.verify(dm.encode(0, -1, 1, b"a") + b"!", 0)


def test_digest_mismatch_is_a_bk_error() -> None:
    """DigestMismatchError belongs to the BKError hierarchy (docs/api.md)."""
    assert issubclass(DigestMismatchError, BKError)
