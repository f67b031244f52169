"""ZooKeeper credentials, ACLs and TLS of a metadata store (docs/metadata.md, ACLs).

Who may do what, in ZooKeeper's terms:
- every znode the project writes carries `auth` ALL (ZooKeeper replaces it with the ids the
  creating session authenticated as: its digest user, or its SASL principal) and, when the
  cluster names one, READ for the read-only digest principal; nothing for `world:anyone`.
  Bookies, clients, auto-recovery and tools of one cluster share one writing principal, as
  Apache BookKeeper's `zkEnableSecurity` (CREATOR_ALL_ACL) has them: any of them rewrites what
  another created (ensemble changes, recovery, re-replication, deletion);
- the read-only principal (`bk zk secure --readonly-user USER:PASSWORD`) is named in the
  cluster's `security` znode by its digest id (`USER:base64(sha1(USER:PASSWORD))`, never the
  password), so every writer adds it without being configured with it;
- without zk_auth a store writes ZooKeeper's open ACL, as before.
"""
from __future__ import annotations

import base64
import binascii
import importlib.util
import json
from dataclasses import dataclass
from typing import Any

from kazoo.security import ACL, Id, Permissions, make_digest_acl_credential

from bookkeeper.errors import ConfigError, MetadataFormatError
from bookkeeper.meta.sealing import key_id
from bookkeeper.security.authz import ANONYMOUS

SECURITY_FORMAT = 1


@dataclass(frozen=True)
class ZkSecurity:
    """What a metadata store authenticates with and how it reaches ZooKeeper's TLS port.

    auth: "digest:USER:PASSWORD" | "sasl" | "" (none); tls_*: PEM files for `zk+tls://` URIs
    (tls_ca_file verifies the server; cert and key: this side's certificate, when the server
    asks for one); seal_key_file: the X25519 private key that opens sealed ledger passwords
    (bookies and auto-recovery only)."""

    auth: str = ""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    seal_key_file: str = ""

    def __repr__(self) -> str:  # the digest password must never reach a log line
        scheme = self.auth.split(":", 1)[0] if self.auth else ""
        return (f"ZkSecurity(auth={scheme or 'none'}, principal={self.principal!r}, tls_ca_file={self.tls_ca_file!r}, "
                f"tls_cert_file={self.tls_cert_file!r}, seal_key_file={self.seal_key_file!r})")

    @property
    def scheme(self) -> str:
        """"digest", "sasl" or "" (none)."""
        return self.auth.split(":", 1)[0] if self.auth else ""

    @property
    def principal(self) -> str:
        """Who this store is, as ledger metadata records its creator: the digest user name,
        "sasl" (the Kerberos principal is the ticket's, not known here), or "anonymous"."""
        if self.scheme == "digest":
            return digest_credentials(self.auth)[0]
        return self.scheme or ANONYMOUS


def zk_security_from(cfg: Any) -> ZkSecurity:
    """The ZooKeeper side of a BookieConfig or a ClientConfig (a client has no seal key).
    zk_auth may be `file:/path`: the credential is read from that file (so that neither a
    config file nor the environment holds the password)."""
    return ZkSecurity(auth=read_zk_auth(getattr(cfg, "zk_auth", "")), tls_ca_file=getattr(cfg, "tls_ca_file", ""),
                      tls_cert_file=getattr(cfg, "tls_cert_file", ""), tls_key_file=getattr(cfg, "tls_key_file", ""),
                      seal_key_file=getattr(cfg, "password_seal_key_file", ""))


def read_zk_auth(setting: str) -> str:
    """A zk_auth setting as given, or the content of its file for `file:/path` (one line);
    ConfigError naming the file when it cannot be read or holds no credential."""
    if not setting.startswith("file:"):
        return setting
    path = setting[len("file:"):]
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read().strip()
    except OSError as e:
        raise ConfigError(f"zk_auth file {path}: {e.strerror}") from None
    if not value or value.startswith("file:"):
        raise ConfigError(f"zk_auth file {path} must hold digest:USER:PASSWORD or sasl")
    return value


def digest_credentials(auth: str) -> tuple[str, str]:
    """"digest:USER:PASSWORD" -> (USER, PASSWORD); the password may hold colons, the user not."""
    scheme, _, rest = auth.partition(":")
    user, sep, password = rest.partition(":")
    if scheme != "digest" or not sep or not user or not password:
        raise ConfigError("zk_auth must be 'digest:USER:PASSWORD' (or 'sasl')")
    return user, password


def kazoo_options(security: ZkSecurity, *, tls: bool) -> dict[str, Any]:
    """KazooClient keyword arguments: credentials, and TLS for a `zk+tls://` URI (the server's
    certificate verified against tls_ca_file, its host name too)."""
    options: dict[str, Any] = {}
    if security.scheme == "digest":
        options["auth_data"] = [("digest", ":".join(digest_credentials(security.auth)))]
    elif security.scheme == "sasl":
        # kazoo 2.11 takes SASL through sasl_options, with pure-sasl; GSSAPI needs the gssapi
        # package too and a Kerberos ticket in the environment (kinit, or KRB5CCNAME).
        if importlib.util.find_spec("puresasl") is None:
            raise ConfigError("zk_auth = 'sasl' needs the pure-sasl and gssapi packages (pip install pure-sasl "
                              "gssapi) and a Kerberos ticket (kinit): see docs/metadata.md, ACLs")
        options["sasl_options"] = {"mechanism": "GSSAPI", "service": "zookeeper"}
    elif security.auth:
        raise ConfigError("zk_auth must be 'digest:USER:PASSWORD' or 'sasl'")
    if tls:
        if not security.tls_ca_file:
            raise ConfigError("a zk+tls:// metadata URI needs tls_ca_file (the CA ZooKeeper's certificate is "
                              "checked against)")
        options.update(use_ssl=True, verify_certs=True, check_hostname=True, ca=security.tls_ca_file,
                       certfile=security.tls_cert_file or None, keyfile=security.tls_key_file or None)
    return options


def digest_id(user: str, password: str) -> str:
    """The digest id an ACL names a principal by (`USER:base64(sha1(USER:PASSWORD))`: no password in it)."""
    if not user or ":" in user or not password:
        raise ConfigError("a digest principal must be USER:PASSWORD with a non-empty user without ':'")
    return str(make_digest_acl_credential(user, password))


def node_acls(readonly: str | None) -> list[ACL]:
    """The ACL of every znode a store with credentials writes: the creator ALL, the read-only
    principal (a digest id, when the cluster names one) READ, and nothing for anyone else."""
    acls = [ACL(Permissions.ALL, Id("auth", ""))]
    if readonly:
        acls.append(ACL(Permissions.READ, Id("digest", readonly)))
    return acls


def secured_acls(writer: str, readonly: str | None) -> list[ACL]:
    """The ACL `bk zk secure` sets on an existing znode: the writing principal's digest id ALL
    (the `auth` form works only at creation), the read-only one READ."""
    acls = [ACL(Permissions.ALL, Id("digest", writer))]
    if readonly:
        acls.append(ACL(Permissions.READ, Id("digest", readonly)))
    return acls


@dataclass(frozen=True)
class SecurityDoc:
    """The cluster's `security` znode: the public key ledger passwords are sealed to, and
    the read-only principal's digest id. JSON {"format": 1, "seal_public_key": base64,
    "seal_key_id": hex, "readonly": "USER:HASH"}, each key optional."""

    seal_public_key: bytes | None = None
    readonly: str | None = None

    def to_json(self) -> bytes:
        d: dict[str, Any] = {"format": SECURITY_FORMAT}
        if self.seal_public_key is not None:
            d["seal_public_key"] = base64.b64encode(self.seal_public_key).decode()
            d["seal_key_id"] = key_id(self.seal_public_key)
        if self.readonly:
            d["readonly"] = self.readonly
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | None) -> SecurityDoc:
        if not data:
            return cls()
        try:
            d = json.loads(data)
            if int(d.get("format", 0)) > SECURITY_FORMAT:
                raise ValueError(f"format {d['format']} is newer than this code's ({SECURITY_FORMAT})")
            key = base64.b64decode(d["seal_public_key"], validate=True) if "seal_public_key" in d else None
            if key is not None and len(key) != 32:
                raise ValueError(f"seal_public_key is {len(key)} bytes, not 32")
            return cls(seal_public_key=key, readonly=d.get("readonly") or None)
        except (ValueError, TypeError, KeyError, binascii.Error) as e:
            raise MetadataFormatError(f"corrupt security znode: {e}") from None


def no_auth_message(op: str, path: str, security: ZkSecurity) -> str:
    """Why ZooKeeper answered NoAuth, naming the operation, the path and whose credentials."""
    if op == "create" and path.rsplit("/", 2)[-2:-1] == ["idgen"]:
        return (f"ZooKeeper refused {op} on {path}: ledger ids no longer come from idgen, the cluster's "
                f"metadata was upgraded (`bk metadata upgrade`, layout 2): upgrade this client")
    if not security.auth:
        return f"ZooKeeper refused {op} on {path}: no credentials (set zk_auth)"
    return (f"ZooKeeper refused {op} on {path} to {security.scheme} user {security.principal!r}: the node's ACL "
            f"does not grant it (a wrong password, a read-only principal, or not this cluster's principal)")


def auth_failed_message(security: ZkSecurity) -> str:
    return f"ZooKeeper rejected the credentials for {security.scheme or 'no'} user {security.principal!r}"
