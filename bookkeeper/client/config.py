"""Client configuration: one frozen, validated dataclass (keyword arguments of connect).

Names follow Apache BookKeeper's ClientConfiguration in Python form, units last.
"""
from __future__ import annotations

from dataclasses import dataclass

from bookkeeper.config import validate_trust
from bookkeeper.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Timeouts, bounds and policies of one BookKeeper client."""

    add_timeout_s: float = 10.0             # a bookie that does not answer an add in time is replaced
    read_timeout_s: float = 10.0            # per request; the read then tries another replica
    speculative_read_timeout_ms: int = 100  # ask the next replica if the first is this slow
    slow_bookie_penalty_s: float = 30.0     # a bookie that erred or timed out is tried last this long
    bookie_quarantine_s: float = 1800.0     # ... and is not picked for new ensembles this long, unless
                                            # nothing else is left (bookieQuarantineTimeSeconds)
    max_outstanding_adds: int = 20_000      # per ledger: add_entry waits, add_entry_async refuses
    read_window: int = 512                  # entries in flight per range read
    long_poll_timeout_ms: int = 2_000       # tail: how long a bookie holds a long-poll read
    explicit_lac_interval_ms: int = 10      # an idle writer sends its LAC after this long (0: never): the tick of
                                            # the client's LAC wheel; a handle made while it is 0 never does
    placement: str = "rack_aware"           # or "random"
    placement_strict: bool = False          # rack_aware: fail instead of degrading when racks are too few
    zk_session_timeout_ms: int = 10_000
    max_pending_creates: int = 1_000        # creates waiting on ZooKeeper; past it create_ledger waits
    metadata_timeout_s: float = 10.0        # ... and fails (MetadataServiceError) after this long
    zk_connect_timeout_s: float = 2.0       # per ZooKeeper address: a TCP connect not answered in time
                                            # fails (a refused one fails at once), see meta/zk_connect.py
    # Trust (docs/security.md): the bookies' TLS and AUTH exchange, ZooKeeper credentials.
    tls: str = "off"                        # off | optional | require
    tls_cert_file: str = ""                 # this client's certificate (mTLS), with tls_key_file
    tls_key_file: str = ""
    tls_ca_file: str = ""                   # the CA bookie certificates are checked against
    tls_reload_interval_s: float = 60.0     # changed files are picked up without reconnecting
    auth_provider: str = ""                 # mtls | token | package.module:Class
    auth_token: str = ""                    # the token itself, or file:/path (re-read at each exchange)
    zk_auth: str = ""                       # digest:USER:PASSWORD | sasl
    password_seal_key_file: str = ""        # opens sealed ledger passwords: auto-recovery's client only

    def validate(self) -> ClientConfig:
        for name in ("add_timeout_s", "read_timeout_s", "slow_bookie_penalty_s", "bookie_quarantine_s",
                     "zk_connect_timeout_s", "metadata_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.speculative_read_timeout_ms < 0:
            raise ConfigError("speculative_read_timeout_ms must be >= 0 (0: off)")
        if self.max_outstanding_adds < 1 or self.read_window < 1 or self.max_pending_creates < 1:
            raise ConfigError("max_outstanding_adds, read_window and max_pending_creates must be >= 1")
        if self.explicit_lac_interval_ms < 0:
            raise ConfigError("explicit_lac_interval_ms must be >= 0 (0: off)")
        if self.long_poll_timeout_ms < 1:
            raise ConfigError("long_poll_timeout_ms must be >= 1")
        if self.placement not in ("rack_aware", "random"):
            raise ConfigError(f"placement must be 'rack_aware' or 'random', got {self.placement!r}")
        validate_trust(self)
        if self.tls != "off" and not self.tls_ca_file:
            raise ConfigError(f"tls = {self.tls!r} needs tls_ca_file (the CA bookie certificates are checked against)")
        if self.auth_provider == "token" and not self.auth_token:
            raise ConfigError("auth_provider = 'token' needs auth_token (the token, or file:/path)")
        if self.auth_provider == "mtls" and not self.tls_cert_file:
            raise ConfigError("auth_provider = 'mtls' needs tls_cert_file and tls_key_file (this client's certificate)")
        return self
