"""TokenKeys.verify (bookkeeper/security/tokens.py): the `token` plug-in's check of what an
unauthenticated peer sends in its AUTH exchange.

Input: the token's text; or, when it starts with `{`, a claims object that the harness signs
with a known key (playing the issuer: the fuzzer then reaches what follows the signature
check, and the claims' parsing without having to find base64 first). Properties: verify
either returns the claims of a token signed with a known key and not yet expired, or raises
AuthenticationError with the reason; never another exception. Claims it returns are exactly
those of a token minted with that key (no other text passes). Anything else is a crash.
"""
from __future__ import annotations

import atexit
import base64
import hashlib
import hmac
import os
import shutil
import tempfile
from pathlib import Path

from bookkeeper.errors import AuthenticationError
from bookkeeper.security.tokens import TokenKeys, mint_token

NOW = 1_800_000_000.0  # the verifier's clock: fixed, so an input's outcome never depends on the day
KID, SECRET = "k1", b"fuzz-secret-fuzz-secret-fuzz-secret!"
OLD_KID, OLD_SECRET = "k0", b"an-older-rotated-key-still-accepted"

_DIR = Path(tempfile.mkdtemp(prefix="fuzz-tokens-"))
atexit.register(shutil.rmtree, _DIR, True)


def keys_file() -> str:
    """A keys file holding two keys (a rotation under way), 0600 as the project writes them."""
    path = _DIR / "keys.toml"
    if not path.exists():
        path.write_text("[keys]\n" + "".join(f'{kid} = "{base64.b64encode(secret).decode()}"\n'
                                             for kid, secret in ((KID, SECRET), (OLD_KID, OLD_SECRET))))
        os.chmod(path, 0o600)
    return str(path)


_KEYS = TokenKeys(keys_file())


def _signed(claims: bytes) -> str:
    body = base64.urlsafe_b64encode(claims).rstrip(b"=").decode("ascii")
    mac = base64.urlsafe_b64encode(hmac.new(SECRET, f"bk1.{body}".encode(), hashlib.sha256).digest())
    return f"bk1.{body}.{mac.rstrip(b'=').decode('ascii')}"


def one_input(data: bytes) -> None:
    signed = data.startswith(b"{")
    token = _signed(data) if signed else data.decode("latin-1")
    try:
        claims = _KEYS.verify(token, now=NOW)
    except AuthenticationError as e:
        if str(e).startswith("expired"):  # feedback for atheris: which refusal
            pass
        elif str(e).startswith("bad signature"):
            pass
        return
    assert claims.expires_at > NOW, f"expired {claims.expires_at} accepted at {NOW}"
    secret = {KID: SECRET, OLD_KID: OLD_SECRET}[claims.key_id]
    again = mint_token(subject=claims.subject, ttl_s=claims.expires_at - NOW, key_id=claims.key_id, secret=secret,
                       now=NOW)
    if not signed:  # the issuer may sign claims in any JSON spelling; a forger has only minted ones
        assert again == token, f"{token!r} passed but is not the token of its claims"


def seeds() -> list[bytes]:
    def token(subject: str, ttl_s: float, kid: str = KID, secret: bytes = SECRET) -> bytes:
        return mint_token(subject=subject, ttl_s=ttl_s, key_id=kid, secret=secret, now=NOW).encode()

    return [
        token("alice", 3600),
        token("bob@example.com", 86400, OLD_KID, OLD_SECRET),
        token("a" * 200, 10),
        token("alice", 3600, "k9", b"x" * 32),  # unknown key id
        mint_token(subject="late", ttl_s=5, key_id=KID, secret=SECRET, now=NOW - 60).encode(),  # expired
        token("alice", 3600)[:-4] + b"AAAA",  # bad signature
        b'{"exp":1800003600,"kid":"k1","sub":"alice"}',  # claims the harness signs
        b'{"exp":1799999000,"kid":"k1","sub":"alice"}',
    ]
