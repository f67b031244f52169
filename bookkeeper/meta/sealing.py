"""Sealed ledger passwords: a sealed box to the cluster's public key (docs/metadata.md).

Auto-recovery must know a ledger's password (the master key of its copies, the MAC key of
MAC ledgers), so ledger metadata keeps it; but anyone who can read the metadata must not.
So a creating client seals the password to a public key it reads from ZooKeeper, and only
the holders of the private key (`password_seal_key_file`: bookies and auto-recovery) can
open it. A client seals without holding any secret.

The box: a fresh X25519 key pair per seal; the shared secret with the cluster key, through
HKDF-SHA256 (salt: the two public keys; info: the ledger id), keys ChaCha20-Poly1305 (the key
is never reused, so a zero nonce is safe). The ledger id is also the associated data: a box
copied into another ledger's metadata does not open. Stored form, one string:
`v1.<key id>.<base64(ephemeral public key 32 bytes || ciphertext || 16-byte tag)>`; the key id
(the first 8 bytes of sha256 of the public key, hex) says which key sealed it, so a wrong
private key is named as such instead of failing as a forgery.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import os
import stat

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from bookkeeper.errors import BKError

VERSION = "v1"
_NONCE = bytes(12)


class SealError(BKError):
    """A sealed password cannot be opened (no key, another key, or a damaged box), or a seal
    key file is unusable; the message says which."""


def key_id(public_key: bytes) -> str:
    """A short, stable name of a public key (hex of the first 8 bytes of its sha256)."""
    return hashlib.sha256(public_key).hexdigest()[:16]


def _context(ledger_id: int) -> bytes:
    return f"bookkeeper-py sealed ledger password, ledger {ledger_id}".encode()


def _box_key(shared: bytes, ephemeral: bytes, recipient: bytes, ledger_id: int) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=ephemeral + recipient,
                info=_context(ledger_id)).derive(shared)


def seal(public_key: bytes, password: bytes, ledger_id: int) -> str:
    """The sealed form of a ledger's password, for the holder of public_key's private key only."""
    recipient = X25519PublicKey.from_public_bytes(public_key)
    ephemeral = X25519PrivateKey.generate()
    epk = ephemeral.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    key = _box_key(ephemeral.exchange(recipient), epk, public_key, ledger_id)
    box = ChaCha20Poly1305(key).encrypt(_NONCE, password, _context(ledger_id))
    return f"{VERSION}.{key_id(public_key)}.{base64.b64encode(epk + box).decode()}"


def unseal(private_key: X25519PrivateKey, sealed: str, ledger_id: int) -> bytes:
    """Open a sealed password; SealError naming why it cannot be opened."""
    version, _, rest = sealed.partition(".")
    kid, _, body = rest.partition(".")
    if version != VERSION or not kid or not body:
        raise SealError(f"ledger {ledger_id}: sealed password in an unknown form ({version!r}; this code reads "
                        f"{VERSION})")
    public = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    if kid != key_id(public):
        raise SealError(f"ledger {ledger_id}: its password is sealed to key {kid}, and the private key held here "
                        f"is key {key_id(public)}")
    try:
        raw = base64.b64decode(body, validate=True)
    except binascii.Error:
        raise SealError(f"ledger {ledger_id}: sealed password is not base64") from None
    if len(raw) < 32 + 16:
        raise SealError(f"ledger {ledger_id}: sealed password is too short ({len(raw)} bytes)")
    epk, box = raw[:32], raw[32:]
    shared = private_key.exchange(X25519PublicKey.from_public_bytes(epk))
    try:
        return ChaCha20Poly1305(_box_key(shared, epk, public, ledger_id)).decrypt(_NONCE, box, _context(ledger_id))
    except InvalidTag:
        raise SealError(f"ledger {ledger_id}: sealed password does not open (damaged, or sealed for another "
                        f"ledger)") from None


def public_bytes(private_key: X25519PrivateKey) -> bytes:
    return private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def load_private_key(path: str | os.PathLike[str]) -> X25519PrivateKey:
    """The X25519 private key of a seal key file (PKCS#8 PEM, as write_private_key makes it).
    Refused when every user may read or write the file: the key opens every ledger's password."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            data = f.read()
    except OSError as e:
        raise SealError(f"password_seal_key_file {os.fspath(path)!r}: {e.strerror or e}") from None
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        raise SealError(f"password_seal_key_file {os.fspath(path)!r}: readable or writable by every user "
                        f"(mode {stat.S_IMODE(mode):04o}): chmod 600 it")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise SealError(f"password_seal_key_file {os.fspath(path)!r} holds no unencrypted PEM private key: {e}") \
            from None
    if not isinstance(key, X25519PrivateKey):
        raise SealError(f"password_seal_key_file {os.fspath(path)!r} holds a {type(key).__name__}, not an X25519 key")
    return key


def write_private_key(path: str | os.PathLike[str]) -> X25519PrivateKey:
    """Make a new seal key and write it to a new file, mode 0600 from its creation (never
    readable by others, not even for a moment); refuses to overwrite one."""
    key = X25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise SealError(f"{os.fspath(path)!r} exists: not overwriting a seal key") from None
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return key
