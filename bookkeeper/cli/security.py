"""`bk tls ...` and `bk token ...`: certificates and tokens for a cluster (docs/security.md).

`bk tls ca` makes a CA; `bk tls issue`, `bk tls client` and `bk tls server` sign a bookie's,
a client's and a plain server's (ZooKeeper, admin HTTP) certificate with it
(bookkeeper.security.pki says what each holds). Each prints the files it wrote, one
`cert=PATH` / `key=PATH` line each, for scripts and Ansible. `bk token keygen` adds a key to
a keys file (the secret is never printed); `bk token create` prints a token, or writes it to a
0600 file with `--out` (for a client's `auth_token = "file:/path"`).
"""
from __future__ import annotations

import argparse
import os
from typing import Any

from bookkeeper.errors import ConfigError
from bookkeeper.security import pki
from bookkeeper.security.reload import LoadError
from bookkeeper.security.tokens import generate_keys_file, mint_token, read_keys_file


def _print_pair(cert: str, key: str) -> None:
    print(f"cert={cert}")
    print(f"key={key}")


def _ca_files(args: argparse.Namespace) -> tuple[str, str]:
    return os.path.join(args.ca_dir, "ca.pem"), os.path.join(args.ca_dir, "ca-key.pem")


def cmd_tls_ca(args: argparse.Namespace) -> int:
    _print_pair(*pki.make_ca(args.dir, common_name=args.common_name, days=args.days))
    return 0


def cmd_tls_issue(args: argparse.Namespace) -> int:
    _print_pair(*pki.issue_bookie_cert(*_ca_files(args), args.dir or args.ca_dir, bookie_id=args.bookie_id,
                                       hosts=args.host, days=args.days))
    return 0


def cmd_tls_client(args: argparse.Namespace) -> int:
    _print_pair(*pki.issue_client_cert(*_ca_files(args), args.dir or args.ca_dir, principal=args.principal,
                                       days=args.days))
    return 0


def cmd_tls_server(args: argparse.Namespace) -> int:
    _print_pair(*pki.issue_server_cert(*_ca_files(args), args.dir or args.ca_dir, hosts=args.host, days=args.days))
    return 0


def cmd_token_keygen(args: argparse.Namespace) -> int:
    generate_keys_file(args.keys_file, args.kid)
    print(f"added key id {args.kid} to {args.keys_file}")
    return 0


def cmd_token_create(args: argparse.Namespace) -> int:
    try:
        secret = read_keys_file(args.keys_file).get(args.kid)
    except LoadError as e:
        raise ConfigError(str(e)) from None
    if secret is None:
        raise ConfigError(f"keys file {args.keys_file}: no key id {args.kid}")
    try:
        token = mint_token(subject=args.subject, ttl_s=args.ttl_s, key_id=args.kid, secret=secret)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.out:
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(token + "\n")
        print(f"wrote a token for {args.subject} to {args.out}")
    else:
        print(token)
    return 0


def _add_tls_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    t = sub.add_parser("tls", parents=[common], help="a CA and certificates for bookies, clients, servers")
    tsub = t.add_subparsers(dest="tls_command", required=True)
    p = tsub.add_parser("ca", parents=[common], help="make a CA: DIR/ca.pem, DIR/ca-key.pem")
    p.add_argument("--dir", required=True, metavar="DIR", help="where to write the CA")
    p.add_argument("--common-name", default="bookkeeper CA", metavar="CN", help="the CA's name")
    p.add_argument("--days", type=float, default=pki.CA_DAYS, metavar="N", help=f"validity (default {pki.CA_DAYS})")
    p.set_defaults(func=cmd_tls_ca)

    def leaf(name: str, fn: Any, help_: str) -> Any:
        p = tsub.add_parser(name, parents=[common], help=help_)
        p.add_argument("--ca-dir", required=True, metavar="DIR", help="the CA's directory (bk tls ca --dir)")
        p.add_argument("--dir", default=None, metavar="DIR", help="where to write (default: the CA's directory)")
        p.add_argument("--days", type=float, default=pki.LEAF_DAYS, metavar="N",
                       help=f"validity (default {pki.LEAF_DAYS})")
        p.set_defaults(func=fn)
        return p
    p = leaf("issue", cmd_tls_issue, "a bookie's certificate (SAN URI bookie://ID)")
    p.add_argument("--bookie-id", required=True, metavar="HOST:PORT", help="the bookie id it names")
    p.add_argument("--host", action="append", default=[], metavar="H", help="a DNS name or IP it serves (repeat)")
    leaf("client", cmd_tls_client, "a client's certificate (CN = principal)").add_argument(
        "--principal", required=True, metavar="P", help="the principal mtls authenticates")
    leaf("server", cmd_tls_server, "a server's certificate (ZooKeeper, admin HTTP)").add_argument(
        "--host", action="append", required=True, metavar="H", help="a DNS name or IP it serves (repeat)")


def _add_token_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    t = sub.add_parser("token", parents=[common], help="token keys and tokens (auth_provider = token)")
    tsub = t.add_subparsers(dest="token_command", required=True)
    p = tsub.add_parser("keygen", parents=[common], help="add a random key to a keys file (0600)")
    p.add_argument("--keys-file", required=True, metavar="F", help="the TOML keys file (made if absent)")
    p.add_argument("--kid", required=True, metavar="K", help="the new key's id")
    p.set_defaults(func=cmd_token_keygen)
    p = tsub.add_parser("create", parents=[common], help="a token for a principal")
    p.add_argument("--keys-file", required=True, metavar="F", help="the TOML keys file")
    p.add_argument("--kid", required=True, metavar="K", help="the key to sign with")
    p.add_argument("--subject", required=True, metavar="S", help="the principal the token names")
    p.add_argument("--ttl-s", type=float, required=True, metavar="N", help="seconds until it expires")
    p.add_argument("--out", default=None, metavar="FILE", help="write it to FILE (0600) instead of stdout")
    p.set_defaults(func=cmd_token_create)


def add_security_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    """`bk tls ca|issue|client|server` and `bk token keygen|create`."""
    _add_tls_parsers(sub, common)
    _add_token_parsers(sub, common)
