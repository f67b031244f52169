"""TLS contexts that follow their files, and the checks of who is at the other end.

Why a bookie id in the certificate: a client routes to a bookie by its id (`HOST:PORT`, read
from ZooKeeper). A certificate valid for the host name proves only that the peer holds some
certificate of the CA, which every client of an mTLS cluster does; a forged registration could
then point a bookie id at any of them. So a bookie's certificate carries its id as a SAN URI
`bookie://HOST:PORT` and the client checks that URI against the id it routed to
(`check_bookie_identity`), after the handshake verified the chain; DNS hostname checking is off
because the id, not the DNS name, is what is routed to. Client certificates carry no such
URI, so they can never pose as a bookie.

Why reloading: certificates are short-lived and rolled under load. `ReloadingTLS.maybe_reload`
stats the files (cheap, from an event loop) and builds a new context when one changed;
connections already open keep the context they were made with, new ones get the new. A bad
new file (a mismatched pair during a roll, a half-written PEM) keeps the old context, counted.
"""
from __future__ import annotations

import ssl
import time
from typing import Any

from cryptography import x509

from bookkeeper.errors import AuthenticationError, ConfigError
from bookkeeper.security.reload import LoadError, ReloadCounters, Reloading

TLS_MODES = ("off", "optional", "require")
BOOKIE_URI_SCHEME = "bookie://"
PeerCert = dict[str, Any]  # what ssl_object.getpeercert() returns

# verify_message of an untrusted chain, as OpenSSL words it.
_UNTRUSTED = ("unable to get local issuer certificate", "self-signed certificate", "self signed certificate",
              "self-signed certificate in certificate chain", "self signed certificate in certificate chain",
              "unable to get issuer certificate", "certificate signature failure")


def _read_pem_certs(path: str, what: str) -> list[x509.Certificate]:
    """The certificates of a PEM file, or LoadError naming it and why."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise LoadError(f"{what} {path}: cannot be read: {e.strerror or e}") from None
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError:
        raise LoadError(f"{what} {path}: no PEM certificate in it") from None


def _load_cert_chain(ctx: ssl.SSLContext, cert_file: str, key_file: str) -> None:
    """Load a certificate and its key, naming which file is wrong when it fails."""
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise LoadError(f"certificate {cert_file} and key {key_file}: the key does not match the certificate"
                            ) from None
        raise LoadError(f"key {key_file}: not a usable unencrypted PEM private key for certificate {cert_file} "
                        f"({e.reason or e})") from None
    except OSError as e:  # the certificate was just read: the key it is
        raise LoadError(f"key {key_file}: cannot be read: {e.strerror or e}") from None


def _load_ca(ctx: ssl.SSLContext, ca_file: str) -> None:
    _read_pem_certs(ca_file, "CA file")
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except (ssl.SSLError, OSError) as e:
        raise LoadError(f"CA file {ca_file}: {getattr(e, 'reason', None) or e}") from None


def build_context(*, server_side: bool, cert_file: str | None, key_file: str | None, ca_file: str | None,
                  client_auth: bool) -> tuple[ssl.SSLContext, float | None]:
    """A TLS 1.3 context from the files and the certificate's notAfter (epoch s, None without one).

    Server: its chain, and with client_auth the CA that client certificates must chain to.
    Client: the CA (required), hostname checks off (see the module note), its own pair if given."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    if not server_side:
        ctx.check_hostname = False
    not_after = None
    if cert_file:
        not_after = _read_pem_certs(cert_file, "certificate")[0].not_valid_after_utc.timestamp()
        _load_cert_chain(ctx, cert_file, key_file or "")
    if ca_file and (client_auth or not server_side):
        _load_ca(ctx, ca_file)
    ctx.verify_mode = ssl.CERT_REQUIRED if (client_auth or not server_side) else ssl.CERT_NONE
    return ctx, not_after


def _validate(*, server_side: bool, cert_file: str | None, key_file: str | None, ca_file: str | None,
              client_auth: bool) -> None:
    if bool(cert_file) != bool(key_file):
        raise ConfigError("tls_cert_file and tls_key_file go together: give both or neither")
    if server_side and not cert_file:
        raise ConfigError("TLS on a server needs tls_cert_file and tls_key_file")
    if (client_auth or not server_side) and not ca_file:
        raise ConfigError("TLS needs tls_ca_file to verify the peer's certificate"
                          + (" (tls_client_auth)" if server_side else ""))


class ReloadingTLS(ReloadCounters):
    """An `ssl.SSLContext` rebuilt when its certificate, key or CA file changes.

    Lives wherever connections are made (a shard's server, a client, auto-recovery's copies):
    the owner calls `maybe_reload()` from its loop (a stat per file, at most once per
    `reload_interval_s`) and takes `.context` for each new connection (`loop.start_tls`,
    `loop.create_connection(ssl=...)`). `reloads`, `reload_failures`, `last_error` and
    `days_to_expiry()` are what `/metrics` shows."""

    _reloading: Reloading[tuple[ssl.SSLContext, float | None]]

    def __init__(self, *, server_side: bool, cert_file: str | None, key_file: str | None, ca_file: str | None,
                 client_auth: bool = False, reload_interval_s: float = 60.0) -> None:
        _validate(server_side=server_side, cert_file=cert_file, key_file=key_file, ca_file=ca_file,
                  client_auth=client_auth)
        if reload_interval_s <= 0:
            raise ConfigError(f"tls_reload_interval_s must be > 0, got {reload_interval_s}")
        self.server_side = server_side

        def load() -> tuple[ssl.SSLContext, float | None]:
            return build_context(server_side=server_side, cert_file=cert_file, key_file=key_file,
                                 ca_file=ca_file, client_auth=client_auth)
        paths = [p for p in (cert_file, key_file, ca_file) if p]
        try:
            self._reloading = Reloading(paths, load, what="TLS files", reload_interval_s=reload_interval_s)
        except LoadError as e:
            raise ConfigError(f"TLS: {e}") from None

    @property
    def context(self) -> ssl.SSLContext:
        """The context for the next connection (open ones keep the one they were made with)."""
        return self._reloading.value[0]




    def maybe_reload(self, now: float | None = None) -> bool:
        """Stat the files (at most once per interval) and swap in a new context if they changed
        and load; a bad change keeps the old context, counted (`now`: monotonic seconds)."""
        return self._reloading.maybe_reload(now)

    def days_to_expiry(self, now: float | None = None) -> float | None:
        """Days until the loaded certificate's notAfter (`now`: epoch seconds); negative once
        expired; None without a certificate (a client without mTLS)."""
        not_after = self._reloading.value[1]
        if not_after is None:
            return None
        return (not_after - (time.time() if now is None else now)) / 86400.0


def bookie_ids_of(peercert: PeerCert) -> list[str]:
    """The bookie ids a certificate names (its `bookie://` SAN URIs), in order."""
    return [value[len(BOOKIE_URI_SCHEME):] for kind, value in peercert.get("subjectAltName", ())
            if kind == "URI" and value.startswith(BOOKIE_URI_SCHEME)]


def check_bookie_identity(peercert: PeerCert, bookie_id: str, *, host_port: str) -> None:
    """Pass when the verified certificate names `bookie_id`; else AuthenticationError saying what
    it names. `peercert` is `ssl_object.getpeercert()` of a verified connection."""
    ids = bookie_ids_of(peercert)
    if bookie_id in ids:
        return
    found = ", ".join(BOOKIE_URI_SCHEME + i for i in ids) or "no bookie id"
    raise AuthenticationError(f"bookie {bookie_id} at {host_port}: its TLS certificate names {found}, "
                              f"not {BOOKIE_URI_SCHEME}{bookie_id}")


def principal_of(peercert: PeerCert) -> str | None:
    """The principal of a client certificate for `mtls` authentication: its subject commonName
    (the last one if several; None without one)."""
    names = [value for rdn in peercert.get("subject", ()) for key, value in rdn if key == "commonName"]
    return names[-1] if names else None


def cert_expires_at(peercert: PeerCert) -> float | None:
    """A verified peer certificate's notAfter in epoch seconds (None if it does not say)."""
    not_after = peercert.get("notAfter")
    return float(ssl.cert_time_to_seconds(not_after)) if not_after else None


_REASONS = {
    "WRONG_VERSION_NUMBER": "the peer does not speak TLS (a plain-text peer, or tls = off there)",
    "HTTP_REQUEST": "the peer sent plain HTTP, not TLS",
    "UNSUPPORTED_PROTOCOL": "no TLS version in common (TLS 1.3 is required)",
    "TLSV1_ALERT_PROTOCOL_VERSION": "no TLS version in common (TLS 1.3 is required)",
    "NO_PROTOCOLS_AVAILABLE": "no TLS version in common (TLS 1.3 is required)",
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "the peer requires a client certificate (tls_cert_file, tls_key_file)",
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "the peer sent no client certificate (tls_client_auth is on here)",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "the peer refused our certificate: it has expired",
    "TLSV1_ALERT_UNKNOWN_CA": "the peer refused our certificate: not signed by a CA it trusts",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the peer refused our certificate",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "the peer refused our certificate",
    "UNEXPECTED_EOF_WHILE_READING": "the peer closed the connection during the handshake",
}


def describe_tls_failure(exc: BaseException, *, peer: str) -> str:
    """A person's reason for a failed handshake with `peer`, for
    `AuthenticationError(f"bookie {peer}: TLS handshake failed: {reason}")`."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        message = exc.verify_message or str(exc)
        if message in _UNTRUSTED:
            return f"{peer}'s certificate is not signed by a trusted CA (tls_ca_file): {message}"
        if message == "unsuitable certificate purpose":
            return (f"{peer}'s certificate is not for this use ({message}): a client certificate where a "
                    f"server's is needed?")
        return f"{peer}'s certificate was refused: {message}"
    reason = getattr(exc, "reason", None)
    if isinstance(exc, ssl.SSLError) and reason in _REASONS:
        return _REASONS[reason]
    if isinstance(exc, (ssl.SSLEOFError, ConnectionResetError, BrokenPipeError, EOFError)):
        return "the peer closed the connection during the handshake"
    if isinstance(exc, (TimeoutError, ssl.SSLWantReadError)):
        return "the handshake timed out"
    if isinstance(exc, ssl.SSLError):
        return f"TLS error {reason or exc}"
    return f"{type(exc).__name__}: {exc}"

