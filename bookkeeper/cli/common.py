"""What every `bk` sub-command module shares: the consoles, the usage error, the metadata URI.

Why a module of its own: `main` builds the parser from the sub-command modules (streams,
...), and they need these too; here neither imports the other.
"""
from __future__ import annotations

import argparse
import os
import sys

from typing import Any

from rich.console import Console
from rich.table import Table

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def cli_table(*headers: str, **options: Any) -> Table:
    """A rich table (options: Table's) whose cells wrap, and fold a word too long for its column,
    instead of cutting it with an ellipsis: at 80 columns (a small terminal, or any pipe, where
    rich has no width to read) every header and value still shows whole. Every `bk` table is one."""
    t = Table(**options)
    for header in headers:
        t.add_column(header, overflow="fold")
    return t


class UsageError(Exception):
    """A mistake on the command line: printed as one line, exit code 2."""


def metadata_uri(args: argparse.Namespace) -> str:
    """--metadata-uri, else BK_METADATA_URI, else a usage error."""
    uri = getattr(args, "metadata_uri", None) or os.environ.get("BK_METADATA_URI")
    if not uri:
        raise UsageError("no metadata URI: pass --metadata-uri zk://host:port/ledgers or set BK_METADATA_URI")
    return uri


# The client settings `bk` takes from the environment (BK_<KEY>, like BK_METADATA_URI): the
# trust settings, which a shell on a secured cluster sets once for every command.
CLIENT_ENV_KEYS = ("tls", "tls_ca_file", "tls_cert_file", "tls_key_file", "auth_provider", "auth_token", "zk_auth",
                   "password_seal_key_file")


def client_settings(env: dict[str, str] | None = None) -> dict[str, str]:
    """`BookKeeper.connect` keywords from BK_TLS, BK_TLS_CA_FILE, BK_TLS_CERT_FILE, BK_TLS_KEY_FILE,
    BK_AUTH_PROVIDER, BK_AUTH_TOKEN, BK_ZK_AUTH and BK_PASSWORD_SEAL_KEY_FILE (unset ones keep the
    client's defaults)."""
    env = os.environ if env is None else env
    return {k: env[f"BK_{k.upper()}"] for k in CLIENT_ENV_KEYS if env.get(f"BK_{k.upper()}")}


def error_line(message: str) -> None:
    """One plain line on stderr: no wrapping, no markup (the text may quote user input)."""
    print(" ".join(message.split()), file=sys.stderr)
