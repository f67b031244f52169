"""A small certificate authority for a cluster: what `bk tls` and the Ansible roles issue.

Certificates (ECDSA P-256, SHA-256; valid from an hour ago, for clock skew):
- the CA: `ca.pem`, `ca-key.pem` (basicConstraints CA, keyCertSign);
- a bookie: SAN URI `bookie://<bookie_id>` (what clients check, docs/security.md) plus a
  DNS or IP SAN per host, subject CN = the bookie id, EKU serverAuth and clientAuth (a bookie
  is also a client of other bookies when auto-recovery copies entries);
- a client: subject CN = its principal (what `mtls` authenticates), EKU clientAuth, no
  bookie:// URI (so it can never pose as a bookie);
- a server (ZooKeeper, the admin HTTP): DNS/IP SANs of its hosts, EKU serverAuth.
Private keys are written 0600 (unencrypted PEM, PKCS#8); certificates 0644.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import re
import tempfile

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bookkeeper.errors import ConfigError
from bookkeeper.security.tls import BOOKIE_URI_SCHEME

CA_DAYS = 3650
LEAF_DAYS = 365
BACKDATE = datetime.timedelta(hours=1)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def _write(path: str, data: bytes, mode: int) -> None:
    """Write a file whole by rename, so a bookie reloading it never reads half a PEM. The temp
    file is new (O_EXCL, random name, 0600 from its creation: mkstemp), so a link planted at a
    predictable name in a shared directory cannot redirect the key."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _save(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, out_dir: str, stem: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    cert_path, key_path = os.path.join(out_dir, f"{stem}.pem"), os.path.join(out_dir, f"{stem}-key.pem")
    _write(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()), 0o600)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert_path, key_path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _validity(days: float) -> tuple[datetime.datetime, datetime.datetime]:
    if days <= 0:
        raise ConfigError(f"days must be > 0, got {days}")
    now = datetime.datetime.now(datetime.timezone.utc)
    return now - BACKDATE, now + datetime.timedelta(days=days)


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey,
             days: float) -> x509.CertificateBuilder:
    not_before, not_after = _validity(days)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(not_before).not_valid_after(not_after)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    """Signatures (ECDSA handshakes) for every certificate; signing certificates for a CA only."""
    return x509.KeyUsage(digital_signature=True, key_cert_sign=ca, crl_sign=ca, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
                         decipher_only=False)


def make_ca(dir: str, *, common_name: str, days: float = CA_DAYS) -> tuple[str, str]:  # noqa: A002 - the agreed name
    """A new CA in `dir`: (`dir/ca.pem`, `dir/ca-key.pem`). Refused where a CA already is: a new
    one there would leave every certificate the old one signed untrusted."""
    for stem in ("ca.pem", "ca-key.pem"):
        if os.path.exists(os.path.join(dir, stem)):
            raise ConfigError(f"{os.path.join(dir, stem)} exists: a new CA there would orphan every certificate "
                              f"the old one signed; remove it first or choose another directory")
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    cert = (_builder(name, name, key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(_key_usage(ca=True), critical=True)
            .sign(key, hashes.SHA256()))
    return _save(cert, key, dir, "ca")


def load_ca(ca_cert: str, ca_key: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A CA's certificate and key from PEM files; ConfigError naming the file that is wrong."""
    try:
        with open(ca_cert, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
    except (OSError, ValueError) as e:
        raise ConfigError(f"CA certificate {ca_cert}: {getattr(e, 'strerror', None) or e}") from None
    try:
        with open(ca_key, "rb") as f:
            key = serialization.load_pem_private_key(f.read(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"CA key {ca_key}: {getattr(e, 'strerror', None) or e}") from None
    if key.public_key() != cert.public_key():
        raise ConfigError(f"CA key {ca_key} does not belong to CA certificate {ca_cert}")
    return cert, key  # type: ignore[return-value]


def _host_names(hosts: list[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if not host or _UNSAFE.search(host.replace("*", "")):
                raise ConfigError(f"host {host!r}: not an IP address or a DNS name") from None
            names.append(x509.DNSName(host))
    return names


def _issue_leaf(ca_cert: str, ca_key: str, out_dir: str, stem: str, *, common_name: str,
                sans: list[x509.GeneralName], usages: list[x509.ObjectIdentifier], days: float) -> tuple[str, str]:
    issuer_cert, issuer_key = load_ca(ca_cert, ca_key)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (_builder(_name(common_name), issuer_cert.subject, key.public_key(), days)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(_key_usage(ca=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                              critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return _save(builder.sign(issuer_key, hashes.SHA256()), key, out_dir, stem)


def issue_bookie_cert(ca_cert: str, ca_key: str, out_dir: str, *, bookie_id: str, hosts: list[str],
                      days: float = LEAF_DAYS) -> tuple[str, str]:
    """A bookie's certificate naming `bookie://<bookie_id>`: (`bookie-<id>.pem`, `bookie-<id>-key.pem`)."""
    if not bookie_id or any(c.isspace() or c in "/?#@" for c in bookie_id):
        raise ConfigError(f"bookie id {bookie_id!r}: expected HOST:PORT")
    sans = [x509.UniformResourceIdentifier(BOOKIE_URI_SCHEME + bookie_id), *_host_names(hosts)]
    return _issue_leaf(ca_cert, ca_key, out_dir, "bookie-" + _UNSAFE.sub("_", bookie_id), common_name=bookie_id,
                       sans=sans, usages=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], days=days)


def issue_client_cert(ca_cert: str, ca_key: str, out_dir: str, *, principal: str,
                      days: float = LEAF_DAYS) -> tuple[str, str]:
    """A client's certificate, CN = `principal`: (`client-<principal>.pem`, `client-<principal>-key.pem`)."""
    if not principal:
        raise ConfigError("a client certificate needs a non-empty principal")
    return _issue_leaf(ca_cert, ca_key, out_dir, "client-" + _UNSAFE.sub("_", principal), common_name=principal,
                       sans=[], usages=[ExtendedKeyUsageOID.CLIENT_AUTH], days=days)


def issue_server_cert(ca_cert: str, ca_key: str, out_dir: str, *, hosts: list[str],
                      days: float = LEAF_DAYS) -> tuple[str, str]:
    """A plain TLS server's certificate (ZooKeeper, admin HTTP) for `hosts`:
    (`server-<first host>.pem`, `server-<first host>-key.pem`)."""
    if not hosts:
        raise ConfigError("a server certificate needs at least one host")
    return _issue_leaf(ca_cert, ca_key, out_dir, "server-" + _UNSAFE.sub("_", hosts[0]), common_name=hosts[0],
                       sans=_host_names(hosts), usages=[ExtendedKeyUsageOID.SERVER_AUTH], days=days)
