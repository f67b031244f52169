"""Roles per principal, from a file reloaded live.

Authz file (TOML):

    [principals]
    "alice" = ["write", "read"]
    "recovery" = ["read", "recover"]
    "ops" = ["admin"]
    "*" = ["read"]            # every authenticated principal, on top of its own roles

Roles: `write` (add; the first claim of a ledger id), `read`, `recover` (fence, recovery add,
re-replication), `admin` (admin POSTs, decommission, recover, deleting other principals'
ledgers). Without a file (path None) authorization is off: every principal has every role.
`generation` goes up at each successful reload, so a connection may cache its roles and look
again only when it changed.
"""
from __future__ import annotations

import tomllib

from bookkeeper.errors import AuthorizationError, ConfigError
from bookkeeper.security.reload import LoadError, ReloadCounters, Reloading

ROLES = ("write", "read", "recover", "admin")
WILDCARD = "*"
ALL_ROLES = frozenset(ROLES)
ANONYMOUS = "anonymous"  # the principal of every connection to a bookie without auth_provider


def parse_policy(text: str, path: str) -> dict[str, frozenset[str]]:
    """principal -> roles from the text of an authz file; LoadError naming what is wrong."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise LoadError(f"authz file {path}: not TOML: {e}") from None
    extra = sorted(set(doc) - {"principals"})
    if extra:
        raise LoadError(f"authz file {path}: unknown top-level key(s) {extra}: only a [principals] table")
    table = doc.get("principals", {})
    if not isinstance(table, dict):
        raise LoadError(f"authz file {path}: principals must be a table of principal = [roles]")
    policy = {}
    for principal, roles in table.items():
        if not principal:
            raise LoadError(f"authz file {path}: an empty principal name")
        if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
            raise LoadError(f"authz file {path}: principal {principal!r}: roles must be a list of strings")
        unknown = sorted(set(roles) - ALL_ROLES)
        if unknown:
            raise LoadError(f"authz file {path}: principal {principal!r}: unknown role(s) {unknown}; "
                            f"roles are {list(ROLES)}")
        policy[principal] = frozenset(roles)
    return policy


def read_policy(path: str) -> dict[str, frozenset[str]]:
    try:
        with open(path, "rb") as f:
            return parse_policy(f.read().decode("utf-8"), path)
    except OSError as e:
        raise LoadError(f"authz file {path}: cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise LoadError(f"authz file {path}: not UTF-8 text") from None


def roles_in(policy: dict[str, frozenset[str]], principal: str) -> frozenset[str]:
    """A principal's own roles and the wildcard's."""
    return policy.get(principal, frozenset()) | policy.get(WILDCARD, frozenset())


class AuthzPolicy(ReloadCounters):
    """Who may do what (per shard or per process); `maybe_reload` is a stat at most once per
    interval, a bad new file keeps the old policy (counted, `last_error`)."""

    def __init__(self, path: str | None, reload_interval_s: float = 60.0) -> None:
        if reload_interval_s <= 0:
            raise ConfigError(f"tls_reload_interval_s must be > 0, got {reload_interval_s}")
        self.path = path
        self.generation = 0
        self._reloading: Reloading[dict[str, frozenset[str]]] | None = None
        if path is None:
            return
        try:
            self._reloading = Reloading([path], lambda: read_policy(path), what=f"authz file {path}",
                                          reload_interval_s=reload_interval_s)
        except LoadError as e:
            raise ConfigError(f"authz_file: {e}") from None

    @property
    def enabled(self) -> bool:
        return self._reloading is not None




    def maybe_reload(self, now: float | None = None) -> bool:
        """Re-read the file if it changed (`now`: monotonic s); True (and a new generation) if it did."""
        if self._reloading is None or not self._reloading.maybe_reload(now):
            return False
        self.generation += 1
        return True

    def roles(self, principal: str) -> frozenset[str]:
        """The principal's roles: its own and the wildcard's; every role with authorization off."""
        return ALL_ROLES if self._reloading is None else roles_in(self._reloading.value, principal)

    def check(self, principal: str, role: str) -> None:
        """Pass if `principal` has `role`; else AuthorizationError naming both."""
        if role not in ALL_ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {list(ROLES)}")
        if role not in self.roles(principal):
            raise AuthorizationError(f"principal {principal!r} lacks role {role!r}")
