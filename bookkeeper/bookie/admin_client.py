"""The client of a bookie's admin HTTP (`bk bookie gc|info ...`): one request, its JSON answer.

Lives in: `bk`, on any host (stdlib only, plus the token setting's reader).

Over HTTPS when a CA is given: the bookie's certificate must chain to that CA and name the
host asked for (a DNS or IP SAN: the admin HTTP is reached by address, not by bookie id, so
the host is what there is to check). TLS 1.3, as every part of the project speaks it. A bearer
token (the `token` provider's) goes in `Authorization`; a client certificate and key, for a
bookie whose `auth_provider` is `mtls`. Proxies from the environment are not used: a token is
meant for the bookie, not for whatever `https_proxy` names.

A token is never sent in clear text to another host: without a CA, a token is sent only to a
loopback address (a `make run` bookie), and anything else is refused before connecting.
"""
from __future__ import annotations

import ipaddress
import json
import ssl
import urllib.error
import urllib.request
from typing import Any

from bookkeeper.errors import AuthenticationError, BKError, BookieUnavailableError, ConfigError

DEFAULT_TIMEOUT_S = 30.0
MAX_ERROR_BYTES = 2000  # of an error answer's body, kept for its message


class AdminHTTPError(BKError):
    """A bookie's admin HTTP answered with an error status: the status and the answer's
    JSON error text (or its raw text), so a caller can tell a 409 from a failure."""

    def __init__(self, url: str, status: int, reason: str) -> None:
        super().__init__(f"{url}: HTTP {status} {reason}")
        self.status = status
        self.reason = reason


def split_host_port(text: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); ValueError naming the form otherwise."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"wants HOST:PORT (the bookie's http_port), got {text!r}")
    return host, int(port)


def admin_request(host_port: str, method: str, path: str, *, body: Any = None, tls_ca_file: str = "",
                  token: str = "", tls_cert_file: str = "", tls_key_file: str = "",
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """One request to the admin HTTP at `host_port`: https when `tls_ca_file` is given, the
    bearer `token` (the token itself, or `file:/path` read now) when given, `body` sent as
    JSON. Returns the parsed JSON answer (text for a non-JSON one, e.g. /metrics).

    Raises AdminHTTPError for an error answer (401/403/409... with the answer's reason),
    AuthenticationError when the TLS handshake fails (the reason named),
    BookieUnavailableError when nothing answers, ConfigError for a token that would travel in
    clear text to another host or an unreadable token file, ValueError for a bad host_port."""
    host, port = split_host_port(host_port)
    url = f"{'https' if tls_ca_file else 'http'}://{host if ':' not in host else f'[{host}]'}:{port}{path}"
    headers = {"Accept": "application/json"}
    if token:
        if not tls_ca_file and not _is_loopback(host):
            raise ConfigError(f"refusing to send the bearer token in clear text to {host}:{port}: give the CA of "
                              f"the bookie's certificate (BK_TLS_CA_FILE or --tls-ca-file) to reach it over HTTPS")
        headers["Authorization"] = "Bearer " + _token_text(token)
    data = None if method in ("GET", "HEAD") else json.dumps(body).encode() if body is not None else b""
    if body is not None:
        headers["Content-Type"] = "application/json"
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({}), _NoRedirect()]
    if tls_ca_file:
        handlers.append(urllib.request.HTTPSHandler(
            context=client_context(tls_ca_file, cert_file=tls_cert_file, key_file=tls_key_file)))
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(urllib.request.Request(url, data=data, method=method, headers=headers),
                         timeout=timeout_s) as r:
            raw = r.read()
            return json.loads(raw) if r.headers.get_content_type() == "application/json" else raw.decode()
    except urllib.error.HTTPError as e:
        raise AdminHTTPError(url, e.code, admin_error_text(e.read()[:MAX_ERROR_BYTES])) from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        # URLError wraps what failed while sending; what fails reading the answer (a client
        # certificate refused after a TLS 1.3 handshake) comes as it is.
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        if isinstance(reason, ssl.SSLError):
            from bookkeeper.security.tls import describe_tls_failure

            raise AuthenticationError(f"admin HTTP at {host}:{port}: TLS handshake failed: "
                                      f"{describe_tls_failure(reason, peer=f'{host}:{port}')}") from None
        raise BookieUnavailableError(f"cannot reach the admin HTTP at {host}:{port}: {reason}") from None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an error answer, never followed: urllib would carry the Authorization
    header to wherever it points, plain http and other hosts included."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def admin_trust(settings: dict[str, str]) -> dict[str, str]:
    """admin_request's keywords from a client's trust settings (`bk`: the BK_TLS, BK_TLS_CA_FILE,
    BK_TLS_CERT_FILE, BK_TLS_KEY_FILE and BK_AUTH_TOKEN of bookkeeper.cli.common.client_settings):
    HTTPS with the CA unless tls is off, the token, the client pair (mtls)."""
    out = {"token": settings.get("auth_token", "")}
    if settings.get("tls", "require") != "off" and settings.get("tls_ca_file"):
        out.update(tls_ca_file=settings["tls_ca_file"], tls_cert_file=settings.get("tls_cert_file", ""),
                   tls_key_file=settings.get("tls_key_file", ""))
    return out


def client_context(ca_file: str, *, cert_file: str = "", key_file: str = "") -> ssl.SSLContext:
    """TLS 1.3, the bookie's certificate checked against `ca_file` and the host name; the
    client's own pair loaded when given (mtls). A file that cannot be used: ConfigError naming it."""
    try:
        ctx = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"tls_ca_file {ca_file}: {getattr(e, 'strerror', None) or e}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    if cert_file or key_file:
        try:
            ctx.load_cert_chain(cert_file, key_file or None)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"client certificate {cert_file} / key {key_file}: "
                              f"{getattr(e, 'strerror', None) or e}") from None
    return ctx


def admin_error_text(body: bytes) -> str:
    """An error answer's "error" field when it is JSON with one, else its text."""
    text = body.decode("utf-8", "replace").strip()
    try:
        return str(json.loads(text)["error"])
    except (ValueError, KeyError, TypeError):
        return text[:200]


def _token_text(setting: str) -> str:
    """The token a setting gives: itself, or a file's content (`file:/path`, read at each call)."""
    from bookkeeper.security.tokens import token_from_setting

    return token_from_setting(setting)()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
