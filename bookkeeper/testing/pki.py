"""A throw-away PKI for tests: a trustme CA, and leaves signed by its key.

Why not trustme for the leaves too: trustme puts only DNS/IP/e-mail SANs in a leaf, and a
bookie's certificate must carry the SAN URI `bookie://HOST:PORT`. So the CA is trustme's (its
key written next to it, 0600) and every leaf comes from bookkeeper.security.pki, the code
`bk tls` runs, signed with that key: tests exercise the certificates operators get.

Where trustme is not installed (it is a test requirement; `bk bench cluster --tls` runs in a
user's install too) the CA comes from `pki.make_ca` instead: the same kind of certificate.

Each leaf goes to a directory of its own (`dir/leaf-N/`), so a new certificate for the same
bookie never overwrites one a running bookie holds; `install` then puts a pair in place by
rename, as an operator's roll would.
"""
from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Sequence

from bookkeeper.security import pki


class TestPKI:
    """A CA in `dir` (`ca_file`, `ca_key_file`) that issues bookie and client certificates."""

    __test__ = False  # not a pytest test class despite its name

    def __init__(self, dir: str, *, organization: str = "bookkeeper tests") -> None:  # noqa: A002
        self.dir = str(dir)
        os.makedirs(self.dir, exist_ok=True)
        self.ca_file, self.ca_key_file = _make_ca(self.dir, organization)
        self._leaves = itertools.count(1)
        self._others = itertools.count(1)

    def _leaf_dir(self) -> str:
        return os.path.join(self.dir, f"leaf-{next(self._leaves)}")

    def bookie(self, bookie_id: str, hosts: Sequence[str] = ("127.0.0.1",), *, days: float = 30) -> tuple[str, str]:
        """(cert, key) of a bookie certificate naming `bookie://<bookie_id>` and the hosts."""
        return pki.issue_bookie_cert(self.ca_file, self.ca_key_file, self._leaf_dir(), bookie_id=bookie_id,
                                     hosts=list(hosts), days=days)

    def expiring_bookie(self, bookie_id: str, seconds: float, hosts: Sequence[str] = ("127.0.0.1",)
                        ) -> tuple[str, str]:
        """A bookie certificate that expires `seconds` from now."""
        return self.bookie(bookie_id, hosts, days=seconds / 86400)

    def client(self, principal: str, *, days: float = 30) -> tuple[str, str]:
        """(cert, key) of a client certificate whose subject CN is `principal`."""
        return pki.issue_client_cert(self.ca_file, self.ca_key_file, self._leaf_dir(), principal=principal,
                                     days=days)

    def expiring_client(self, principal: str, seconds: float) -> tuple[str, str]:
        """A client certificate that expires `seconds` from now."""
        return self.client(principal, days=seconds / 86400)

    def server(self, hosts: Sequence[str] = ("127.0.0.1",), *, days: float = 30) -> tuple[str, str]:
        """(cert, key) of a plain server certificate (ZooKeeper, admin HTTP) for `hosts`."""
        return pki.issue_server_cert(self.ca_file, self.ca_key_file, self._leaf_dir(), hosts=list(hosts), days=days)

    def other_ca(self) -> TestPKI:
        """Another CA (under this one's dir) that this one's holders do not trust."""
        return TestPKI(os.path.join(self.dir, f"other-ca-{next(self._others)}"), organization="untrusted tests")

    def bundle(self, *cas: TestPKI) -> str:
        """A CA file holding this CA and `cas` (a bundle as during a CA roll); its path."""
        path = os.path.join(self.dir, f"bundle-{next(self._leaves)}.pem")
        with open(path, "wb") as out:
            for ca in (self, *cas):
                with open(ca.ca_file, "rb") as f:
                    out.write(f.read())
        return path


def _make_ca(dir: str, organization: str) -> tuple[str, str]:  # noqa: A002
    """(ca.pem, ca-key.pem) in `dir`: trustme's CA, or pki's without trustme."""
    try:
        import trustme
    except ImportError:
        return pki.make_ca(dir, common_name=organization)
    ca = trustme.CA(organization_name=organization)
    ca_file, ca_key_file = os.path.join(dir, "ca.pem"), os.path.join(dir, "ca-key.pem")
    ca.cert_pem.write_to_path(ca_file)
    fd = os.open(ca_key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(ca.private_key_pem.bytes())
    return ca_file, ca_key_file


def install(src: str, dest: str) -> None:
    """Put a copy of `src` at `dest` by rename (never a half-written file there), keeping its mode."""
    tmp = f"{dest}.installing"
    shutil.copy2(src, tmp)
    os.replace(tmp, dest)
