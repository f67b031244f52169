"""Bookie configuration: one frozen, validated dataclass loaded from TOML and env.

Precedence: defaults < TOML file < `BK_*` environment variables < explicit
overrides (the `bk bookie` command line). Apache BookKeeper's key names are
accepted as aliases so operators can carry their habits over.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bookkeeper.errors import ConfigError
from bookkeeper.proto import DEFAULT_MAX_FRAME_BYTES

ALIASES: dict[str, str] = {
    "metadataServiceUri": "metadata_uri",
    "zkServers": "metadata_uri",
    "bookiePort": "port",
    "listeningInterface": "bind_address",
    "advertisedAddress": "advertised_address",
    "bookieId": "bookie_id",
    "journalDirectory": "journal_dir",
    "journalDirectories": "journal_dir",
    "ledgerDirectories": "ledger_dirs",
    "nettyMaxFrameSizeBytes": "max_frame_bytes",
    "httpServerPort": "http_port",
    "journalMaxGroupWaitMSec": "journal_max_group_wait_us",
    "journalBufferedWritesThreshold": "journal_max_batch_bytes",
    "zkTimeout": "zk_session_timeout_ms",
    "gcWaitTime": "gc_interval_s",
    "logSizeLimit": "entry_log_max_bytes",
    "minorCompactionThreshold": "minor_compaction_threshold",
    "majorCompactionThreshold": "major_compaction_threshold",
    "minorCompactionInterval": "minor_compaction_interval_s",
    "majorCompactionInterval": "major_compaction_interval_s",
    "diskUsageWarnThreshold": "disk_usage_warn",
    "diskUsageThreshold": "disk_usage_threshold",
    "diskUsageLwmThreshold": "disk_usage_lwm",
    "diskCheckInterval": "disk_check_interval_s",
    "autoRecoveryDaemonEnabled": "autorecovery",
    "lostBookieRecoveryDelay": "lost_bookie_delay_s",
    "openLedgerRereplicationGracePeriod": "open_ledger_rereplication_grace_s",
    "auditorPeriodicCheckInterval": "audit_interval_s",
}

# Aliases whose Apache BookKeeper unit differs from ours: value multiplier.
_ALIAS_SCALE: dict[str, float] = {"journalMaxGroupWaitMSec": 1000.0, "gcWaitTime": 0.001,
                                  "diskCheckInterval": 0.001, "openLedgerRereplicationGracePeriod": 0.001}


def default_shards() -> int:
    """Usable cores of this process: one shard per core."""
    return max(1, len(os.sched_getaffinity(0)))


def default_address() -> str:
    """This host's address as other hosts should reach it."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


@dataclass(frozen=True, slots=True)
class BookieConfig:
    """Everything a bookie (supervisor and shards) reads at start. Immutable."""

    metadata_uri: str
    bind_address: str = "0.0.0.0"
    advertised_address: str = ""
    bookie_id: str = ""
    rack: str = "/default-rack"
    port: int = 3181
    shard_ports: tuple[int, ...] = ()
    shards: int = field(default_factory=default_shards)
    journal_dir: str = "data/journal"
    ledger_dirs: tuple[str, ...] = ("data/ledgers",)
    journal_sync: str = "io_uring"
    journal_max_group_wait_us: int = 0
    journal_max_batch_bytes: int = 4 * 1024 * 1024
    journal_max_batch_entries: int = 65536
    journal_max_block_bytes: int = 1024 * 1024
    journal_preallocate_bytes: int = 64 * 1024 * 1024
    journal_file_max_bytes: int = 512 * 1024 * 1024
    journal_reuse_files: int = 4
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    write_cache_max_bytes: int = 64 * 1024 * 1024
    checkpoint_interval_s: float = 10.0
    gc_interval_s: float = 60.0
    http_port: int = 0
    zk_session_timeout_ms: int = 10_000
    pin_shards: bool = True
    readonly: bool = False
    # Space (docs/compaction.md): entry logs roll at this size; a log whose live share is under a
    # threshold is compacted (its live entries copied, then the file deleted) at that interval.
    entry_log_max_bytes: int = 1 << 30
    minor_compaction_threshold: float = 0.2
    minor_compaction_interval_s: float = 3600.0
    major_compaction_threshold: float = 0.8
    major_compaction_interval_s: float = 86400.0
    compaction_rate_mb_s: float = 64.0
    # Disks (docs/operations.md): per journal and ledger dir, used share of the filesystem.
    disk_usage_warn: float = 0.90
    disk_usage_threshold: float = 0.95
    disk_usage_lwm: float = 0.85
    disk_check_interval_s: float = 10.0
    # Auto-recovery (docs/autorecovery.md): the auditor and a replication worker in this bookie.
    autorecovery: bool = False
    lost_bookie_delay_s: float = 30.0
    open_ledger_rereplication_grace_s: float = 30.0
    audit_interval_s: float = 5.0
    # Bounds on every peer (docs/protocol.md, Bounds): per shard.
    max_connections: int = 10_000
    write_buffer_high_bytes: int = 4 * 1024 * 1024
    max_long_polls_per_connection: int = 1_000
    idle_timeout_s: float = 600.0
    # Trust (docs/security.md): TLS by START_TLS, the AUTH exchange, authorization, ZooKeeper
    # credentials. Files are re-read every tls_reload_interval_s when they change.
    tls: str = "off"
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    tls_client_auth: bool = False
    tls_reload_interval_s: float = 60.0
    auth_provider: str = ""
    auth_token_keys_file: str = ""
    auth_token: str = ""
    authz_file: str = ""
    auth_timeout_s: float = 10.0
    max_unauthenticated_connections: int = 1_000
    zk_auth: str = ""
    password_seal_key_file: str = ""

    def validate(self) -> BookieConfig:
        """Raise ConfigError naming the first invalid key; return self for chaining."""
        if not self.metadata_uri.startswith(("zk://", "zk+tls://")):
            raise ConfigError(f"metadata_uri must look like zk://host:port/ledgers (zk+tls:// for ZooKeeper's "
                              f"TLS port), got {self.metadata_uri!r}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535, got {self.port}")
        if self.shards < 1:
            raise ConfigError(f"shards must be >= 1, got {self.shards}")
        if self.shard_ports and len(self.shard_ports) != self.shards:
            raise ConfigError(f"shard_ports lists {len(self.shard_ports)} ports for {self.shards} shards")
        if self.journal_sync not in ("io_uring", "thread"):
            raise ConfigError(f"journal_sync must be 'io_uring' or 'thread', got {self.journal_sync!r}")
        if not self.ledger_dirs:
            raise ConfigError("ledger_dirs must list at least one directory")
        for name in ("checkpoint_interval_s", "gc_interval_s", "minor_compaction_interval_s",
                     "major_compaction_interval_s", "compaction_rate_mb_s", "disk_check_interval_s",
                     "audit_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.http_port < 65536:
            raise ConfigError(f"http_port must be in 0..65535 (0: off), got {self.http_port}")
        if self.max_frame_bytes < 1024:
            raise ConfigError(f"max_frame_bytes must be >= 1024, got {self.max_frame_bytes}")
        if self.journal_max_batch_bytes < 4096:
            raise ConfigError("journal_max_batch_bytes must be >= 4096")
        if self.journal_max_block_bytes < 4096:
            raise ConfigError(f"journal_max_block_bytes must be >= 4096, got {self.journal_max_block_bytes}")
        if self.journal_reuse_files < 0:
            raise ConfigError(f"journal_reuse_files must be >= 0 (0: delete trimmed files), got "
                              f"{self.journal_reuse_files}")
        if self.journal_max_batch_entries < 1:
            raise ConfigError(f"journal_max_batch_entries must be >= 1, got {self.journal_max_batch_entries}")
        if self.entry_log_max_bytes < 64 * 1024:
            raise ConfigError(f"entry_log_max_bytes must be >= 65536, got {self.entry_log_max_bytes}")
        if not 0 <= self.minor_compaction_threshold <= self.major_compaction_threshold <= 1:
            raise ConfigError("need 0 <= minor_compaction_threshold <= major_compaction_threshold <= 1, got "
                              f"{self.minor_compaction_threshold} and {self.major_compaction_threshold}")
        if not 0 < self.disk_usage_lwm <= self.disk_usage_warn <= self.disk_usage_threshold <= 1:
            raise ConfigError("need 0 < disk_usage_lwm <= disk_usage_warn <= disk_usage_threshold <= 1, got "
                              f"{self.disk_usage_lwm}, {self.disk_usage_warn}, {self.disk_usage_threshold}")
        for name in ("lost_bookie_delay_s", "open_ledger_rereplication_grace_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_connections", "max_long_polls_per_connection"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.write_buffer_high_bytes < 64 * 1024:
            raise ConfigError(f"write_buffer_high_bytes must be >= 65536, got {self.write_buffer_high_bytes}")
        if self.idle_timeout_s < 0:
            raise ConfigError(f"idle_timeout_s must be >= 0 (0: off), got {self.idle_timeout_s}")
        validate_trust(self)
        if self.auth_timeout_s <= 0:
            raise ConfigError(f"auth_timeout_s must be > 0, got {self.auth_timeout_s}")
        if self.max_unauthenticated_connections < 1:
            raise ConfigError(f"max_unauthenticated_connections must be >= 1, got "
                              f"{self.max_unauthenticated_connections}")
        if self.auth_provider == "token" and not self.auth_token_keys_file:
            raise ConfigError("auth_provider = 'token' needs auth_token_keys_file (the keys tokens are signed with)")
        if self.tls_client_auth and not self.tls_ca_file:
            raise ConfigError("tls_client_auth = true needs tls_ca_file (the CA client certificates are checked against)")
        if self.tls != "off" and not (self.tls_cert_file and self.tls_key_file):
            raise ConfigError(f"tls = {self.tls!r} needs tls_cert_file and tls_key_file (the bookie's certificate)")
        return self

    @property
    def address(self) -> str:
        """The address registered for clients."""
        return self.advertised_address or default_address()

    @property
    def id(self) -> str:
        """The bookie id: configured, or advertised_address:port."""
        return self.bookie_id or f"{self.address}:{self.port}"

    def port_of_shard(self, index: int) -> int:
        """Shard i listens on port + i unless shard_ports lists it."""
        return self.shard_ports[index] if self.shard_ports else self.port + index

    def shard_journal_dir(self, index: int) -> Path:
        return Path(self.journal_dir) / f"shard-{index}"

    def shard_ledger_dir(self, index: int) -> Path:
        """Where shard i keeps its index (and entry logs in the first ledger dir)."""
        return Path(self.ledger_dirs[0]) / f"shard-{index}"

    def shard_ledger_dirs(self, index: int) -> list[Path]:
        """Shard i's directory in every ledger dir: its entry logs go to any of them."""
        return [Path(d) / f"shard-{index}" for d in self.ledger_dirs]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> BookieConfig:
        """Build from a mapping with our keys or Apache BookKeeper aliases; unknown keys fail."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in raw.items():
            name = ALIASES.get(key, key)
            if name in _REPLACED:
                raise ConfigError(_REPLACED[name])
            if name not in names:
                raise ConfigError(f"unknown config key {key!r}")
            if key == "journalDirectories" and isinstance(value, list) and len(value) == 1:
                value = value[0]  # Apache BookKeeper lists journal dirs; one journal per shard here
            if key in _ALIAS_SCALE:  # Apache unit -> ours, then the field's type
                scaled = _coerce(name, value, "float") * _ALIAS_SCALE[key]
                value = round(scaled) if names[name].type == "int" else scaled
            values[name] = _coerce(name, value, names[name].type)
        if "metadata_uri" not in values:
            raise ConfigError("metadata_uri is required")
        return cls(**values).validate()

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, *,
             env: dict[str, str] | None = None, **overrides: Any) -> BookieConfig:
        """Load TOML (if given), then BK_* env vars, then overrides."""
        raw: dict[str, Any] = {}
        if path is not None:
            try:
                with open(path, "rb") as f:
                    raw.update(tomllib.load(f))
            except FileNotFoundError as e:
                raise ConfigError(f"config file not found: {path}") from e
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"config file {path} is not valid TOML: {e}") from e
        names = {f.name for f in dataclasses.fields(cls)}
        for key, value in (os.environ if env is None else env).items():
            if key.startswith("BK_") and key[3:].lower() in names:
                raw[key[3:].lower()] = value
        raw.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_dict(raw)


# Keys that once existed, with what replaced them (a clear error rather than "unknown key").
_REPLACED: dict[str, str] = {
    "tls_enabled": "config key 'tls_enabled' was replaced by tls = \"off\" | \"optional\" | \"require\"",
}

TLS_MODES = ("off", "optional", "require")


def validate_trust(cfg: Any) -> None:
    """The trust keys a bookie and a client share (BookieConfig, ClientConfig): raise ConfigError
    naming the first bad one. Files are checked for existence here, their contents when loaded."""
    if cfg.tls not in TLS_MODES:
        raise ConfigError(f"tls must be one of {', '.join(TLS_MODES)}, got {cfg.tls!r}")
    if cfg.tls_reload_interval_s <= 0:
        raise ConfigError(f"tls_reload_interval_s must be > 0, got {cfg.tls_reload_interval_s}")
    if bool(cfg.tls_cert_file) != bool(cfg.tls_key_file):
        raise ConfigError("tls_cert_file and tls_key_file go together: give both or neither")
    for name in ("tls_cert_file", "tls_key_file", "tls_ca_file"):
        path = getattr(cfg, name)
        if path and not os.path.exists(path):
            raise ConfigError(f"{name}: no such file {path!r}")
    if cfg.auth_provider and cfg.auth_provider not in ("mtls", "token") and "." not in cfg.auth_provider:
        raise ConfigError(f"auth_provider must be 'mtls', 'token' or a class path package.module:Class, "
                          f"got {cfg.auth_provider!r}")
    if cfg.zk_auth.startswith("file:"):
        if not os.path.exists(cfg.zk_auth[len("file:"):]):
            raise ConfigError(f"zk_auth: no such file {cfg.zk_auth[len('file:'):]!r}")
    elif cfg.zk_auth and not (cfg.zk_auth == "sasl" or cfg.zk_auth.startswith("digest:")
                              and cfg.zk_auth.count(":") >= 2):
        raise ConfigError("zk_auth must be 'digest:USER:PASSWORD', 'sasl' or file:/path (holding one of those)")


def _coerce(name: str, value: Any, annotation: str) -> Any:
    """Turn env strings and TOML values into the field's type, with a clear error."""
    try:
        if annotation.startswith("tuple"):
            if isinstance(value, str):
                value = [v for v in value.split(",") if v]
            inner = int if "int" in annotation else str
            return tuple(inner(v) for v in value)
        if annotation == "bool":
            if isinstance(value, str):
                if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("1", "true", "yes")
            return bool(value)
        if annotation == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if annotation == "float":
            return float(value)
        if not isinstance(value, str):
            raise TypeError(value)
        return value
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config key {name!r}: invalid value {value!r} ({annotation})") from e
