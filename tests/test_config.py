"""Bookie configuration (bookkeeper/config.py): TOML, BK_* env, Apache aliases, validation.

docs/api.md section 4: one TOML file, every key optional but metadata_uri; `BK_*` env vars
override it; Apache BookKeeper key names are accepted as aliases.
"""
from __future__ import annotations

import re

import dataclasses
from pathlib import Path

import pytest

from bookkeeper.config import ALIASES, BookieConfig
from bookkeeper.errors import BKError, ConfigError
from bookkeeper.proto import DEFAULT_MAX_FRAME_BYTES

URI = "zk://127.0.0.1:2181/ledgers"


def write_toml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "bookie.toml"
    p.write_text(text)
    return p


def load(tmp_path: Path, text: str, env: dict[str, str] | None = None, **overrides) -> BookieConfig:
    """Load a TOML text with an explicit (by default empty) environment."""
    return BookieConfig.load(write_toml(tmp_path, text), env=env or {}, **overrides)


# -- TOML ------------------------------------------------------------------------------


def test_toml_minimal_gives_documented_defaults(tmp_path: Path) -> None:
    """Only metadata_uri is required; the rest takes docs/api.md defaults (bind 0.0.0.0, io_uring, 5 MiB frames)."""
    c = load(tmp_path, f'metadata_uri = "{URI}"\n')
    assert c.metadata_uri == URI
    assert c.bind_address == "0.0.0.0"
    assert c.journal_sync == "io_uring"
    assert c.max_frame_bytes == DEFAULT_MAX_FRAME_BYTES == 5 * 1024 * 1024
    assert c.shards >= 1
    assert isinstance(c.ledger_dirs, tuple) and c.ledger_dirs


def test_toml_values_are_loaded_with_their_types(tmp_path: Path) -> None:
    """Every key set in the TOML file reaches the config with its field type."""
    c = load(tmp_path, f"""
metadata_uri = "{URI}"
bind_address = "127.0.0.1"
advertised_address = "10.0.0.5"
bookie_id = "bk-1"
rack = "/r1"
port = 4000
shards = 3
shard_ports = [5000, 5001, 5002]
journal_dir = "/j"
ledger_dirs = ["/l1", "/l2"]
journal_sync = "thread"
journal_max_group_wait_us = 250
journal_max_batch_bytes = 65536
max_frame_bytes = 1048576
http_port = 8080
checkpoint_interval_s = 2.5
readonly = true
""")
    assert (c.bind_address, c.advertised_address, c.bookie_id, c.rack) == ("127.0.0.1", "10.0.0.5", "bk-1", "/r1")
    assert (c.port, c.shards, c.shard_ports) == (4000, 3, (5000, 5001, 5002))
    assert c.journal_dir == "/j" and c.ledger_dirs == ("/l1", "/l2")
    assert c.journal_sync == "thread"
    assert (c.journal_max_group_wait_us, c.journal_max_batch_bytes, c.max_frame_bytes) == (250, 65536, 1048576)
    assert c.http_port == 8080 and c.checkpoint_interval_s == 2.5 and c.readonly is True
    assert c.id == "bk-1"
    assert [c.port_of_shard(i) for i in range(3)] == [5000, 5001, 5002]


def test_shard_i_listens_on_port_plus_i_unless_listed(tmp_path: Path) -> None:
    """Shard i listens on port + i when shard_ports is not given (docs/api.md)."""
    c = load(tmp_path, f'metadata_uri = "{URI}"\nport = 3181\nshards = 4\n')
    assert [c.port_of_shard(i) for i in range(4)] == [3181, 3182, 3183, 3184]


def test_bookie_id_defaults_to_advertised_address_and_port(tmp_path: Path) -> None:
    """bookie_id defaults to advertised_address:port (docs/api.md)."""
    c = load(tmp_path, f'metadata_uri = "{URI}"\nadvertised_address = "10.1.2.3"\nport = 3999\n')
    assert c.id == "10.1.2.3:3999"


def test_config_is_immutable(tmp_path: Path) -> None:
    """The loaded config is frozen: nothing can change it after start."""
    c = load(tmp_path, f'metadata_uri = "{URI}"\n')
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.port = 1  # type: ignore[misc]


def test_missing_file_gives_config_error(tmp_path: Path) -> None:
    """A config path that does not exist is a ConfigError, not a traceback."""
    with pytest.raises(ConfigError, match="not found"):
        BookieConfig.load(tmp_path / "nope.toml", env={})


def test_invalid_toml_gives_config_error(tmp_path: Path) -> None:
    """A file that is not valid TOML is a ConfigError."""
    with pytest.raises(ConfigError, match="TOML"):
        load(tmp_path, "metadata_uri = \n[[[")


# -- env ----------------------------------------------------------------------------------


def test_env_bk_vars_override_toml(tmp_path: Path) -> None:
    """BK_* environment variables override the TOML file (docs/api.md precedence)."""
    env = {"BK_PORT": "4100", "BK_JOURNAL_SYNC": "thread", "BK_LEDGER_DIRS": "/a,/b",
           "BK_READONLY": "yes", "BK_CHECKPOINT_INTERVAL_S": "0.5", "BK_SHARD_PORTS": "7000,7001",
           "BK_SHARDS": "2"}
    c = load(tmp_path, f'metadata_uri = "{URI}"\nport = 4000\njournal_sync = "io_uring"\nledger_dirs = ["/x"]\n',
             env=env)
    assert c.port == 4100
    assert c.journal_sync == "thread"
    assert c.ledger_dirs == ("/a", "/b")
    assert c.readonly is True
    assert c.checkpoint_interval_s == 0.5
    assert c.shard_ports == (7000, 7001) and c.shards == 2


def test_env_overrides_a_key_given_by_its_apache_alias(tmp_path: Path) -> None:
    """BK_PORT wins over a TOML bookiePort: env beats the file whatever name the file used."""
    c = load(tmp_path, f'metadata_uri = "{URI}"\nbookiePort = 4000\n', env={"BK_PORT": "4200"})
    assert c.port == 4200


def test_env_supplies_metadata_uri(tmp_path: Path) -> None:
    """BK_METADATA_URI alone satisfies the required key."""
    c = BookieConfig.load(None, env={"BK_METADATA_URI": URI})
    assert c.metadata_uri == URI


def test_env_defaults_to_process_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without env=..., BK_* variables are read from os.environ."""
    monkeypatch.setenv("BK_METADATA_URI", URI)
    monkeypatch.setenv("BK_HTTP_PORT", "9191")
    c = BookieConfig.load()
    assert c.metadata_uri == URI and c.http_port == 9191


def test_unrelated_bk_env_vars_are_ignored(tmp_path: Path) -> None:
    """BK_* variables that name no config key (e.g. other tools' settings) do not break loading."""
    c = load(tmp_path, f'metadata_uri = "{URI}"\n', env={"BK_SOMETHING_ELSE": "1", "PORT": "1"})
    assert c.port == 3181


def test_explicit_overrides_beat_env_and_toml(tmp_path: Path) -> None:
    """Command-line overrides beat BK_* env and TOML; None overrides are ignored."""
    c = load(tmp_path, f'metadata_uri = "{URI}"\nport = 4000\n', env={"BK_PORT": "4100"}, port=4300,
             rack=None)
    assert c.port == 4300
    assert c.rack == "/default-rack"


# -- Apache aliases ------------------------------------------------------------------------


def test_apache_alias_names_are_accepted(tmp_path: Path) -> None:
    """Apache BookKeeper key names (bookiePort, journalDirectory, ledgerDirectories, ...) map to ours."""
    c = load(tmp_path, f"""
metadataServiceUri = "{URI}"
bookiePort = 3300
journalDirectory = "/bk/journal"
ledgerDirectories = ["/bk/l1", "/bk/l2"]
listeningInterface = "127.0.0.1"
advertisedAddress = "10.9.9.9"
bookieId = "apache-style"
nettyMaxFrameSizeBytes = 2097152
httpServerPort = 8000
zkTimeout = 30000
""")
    assert c.metadata_uri == URI
    assert c.port == 3300
    assert c.journal_dir == "/bk/journal"
    assert c.ledger_dirs == ("/bk/l1", "/bk/l2")
    assert c.bind_address == "127.0.0.1" and c.advertised_address == "10.9.9.9"
    assert c.bookie_id == "apache-style"
    assert c.max_frame_bytes == 2097152 and c.http_port == 8000
    assert c.zk_session_timeout_ms == 30000


def test_apache_comma_separated_ledger_directories(tmp_path: Path) -> None:
    """ledgerDirectories written Apache-style as one comma-separated string gives a list of dirs."""
    c = load(tmp_path, f'zkServers = "{URI}"\nledgerDirectories = "/d1,/d2,/d3"\n')
    assert c.ledger_dirs == ("/d1", "/d2", "/d3")
    assert c.metadata_uri == URI


def test_every_alias_targets_a_real_field() -> None:
    """Each alias maps to an existing config field."""
    names = {f.name for f in dataclasses.fields(BookieConfig)}
    assert set(ALIASES.values()) <= names


def test_group_wait_alias_converts_milliseconds_to_microseconds(tmp_path: Path) -> None:
    """journalMaxGroupWaitMSec is in ms (Apache) while journal_max_group_wait_us is in us: 2 ms -> 2000 us."""
    assert load(tmp_path, f'metadata_uri = "{URI}"\njournalMaxGroupWaitMSec = 2\n').journal_max_group_wait_us == 2000
    assert load(tmp_path, f'metadata_uri = "{URI}"\njournalMaxGroupWaitMSec = 0.5\n').journal_max_group_wait_us == 500


def test_group_wait_alias_as_quoted_string_is_still_milliseconds(tmp_path: Path) -> None:
    """A quoted journalMaxGroupWaitMSec = "2" (as in a carried-over properties file) still means 2 ms, not 2 us."""
    c = load(tmp_path, f'metadata_uri = "{URI}"\njournalMaxGroupWaitMSec = "2"\n')
    assert c.journal_max_group_wait_us == 2000


def test_journal_directories_alias_list_is_not_stringified(tmp_path: Path) -> None:
    """Apache's journalDirectories is a list: ["/j"] means the directory /j (or a ConfigError), never "['/j']"."""
    try:
        c = load(tmp_path, f'metadata_uri = "{URI}"\njournalDirectories = ["/bk/j"]\n')
    except ConfigError as e:
        assert "journal" in str(e)
        return
    assert c.journal_dir == "/bk/j"


def test_gc_wait_time_alias_converts_milliseconds_to_seconds(tmp_path: Path) -> None:
    """gcWaitTime is in ms (Apache) while gc_interval_s is in seconds: 600000 -> 600 s, 1500 -> 1.5 s."""
    assert load(tmp_path, f'metadata_uri = "{URI}"\ngcWaitTime = 600000\n').gc_interval_s == 600.0
    assert load(tmp_path, f'metadata_uri = "{URI}"\ngcWaitTime = 1500\n').gc_interval_s == pytest.approx(1.5)


def test_apache_names_of_space_disk_and_recovery_keys(tmp_path: Path) -> None:
    """Apache BookKeeper's names (and units: milliseconds where it uses them) are accepted."""
    c = load(tmp_path, f'metadata_uri = "{URI}"\nlogSizeLimit = 1048576\nminorCompactionThreshold = 0.1\n'
                       'majorCompactionThreshold = 0.5\ndiskUsageThreshold = 0.9\ndiskUsageWarnThreshold = 0.88\n'
                       'diskUsageLwmThreshold = 0.8\ndiskCheckInterval = 2500\nautoRecoveryDaemonEnabled = true\n'
                       'lostBookieRecoveryDelay = 7\nopenLedgerRereplicationGracePeriod = 30000\n')
    assert (c.entry_log_max_bytes, c.minor_compaction_threshold, c.major_compaction_threshold) == (1 << 20, 0.1, 0.5)
    assert (c.disk_usage_threshold, c.disk_usage_warn, c.disk_usage_lwm) == (0.9, 0.88, 0.8)
    assert c.disk_check_interval_s == 2.5 and c.autorecovery is True
    assert c.lost_bookie_delay_s == 7 and c.open_ledger_rereplication_grace_s == 30.0


# -- bad values -------------------------------------------------------------------------------


@pytest.mark.parametrize("line,key", [
    ('port = "not-a-number"', "port"),
    ("port = 0", "port"),
    ("port = 70000", "port"),
    ("port = true", "port"),
    ("port = 3181.5", "port"),
    ("shards = 2.5", "shards"),
    ("http_port = 70000", "http_port"),
    ('journal_dir = ["/a", "/b"]', "journal_dir"),
    ("shards = 0", "shards"),
    ('journal_sync = "aio"', "journal_sync"),
    ("ledger_dirs = []", "ledger_dirs"),
    ("max_frame_bytes = 100", "max_frame_bytes"),
    ("journal_max_batch_bytes = 10", "journal_max_batch_bytes"),
    ("journal_reuse_files = -1", "journal_reuse_files"),
    ('checkpoint_interval_s = "soon"', "checkpoint_interval_s"),
    ('readonly = "maybe"', "readonly"),
    ('shard_ports = ["a", "b"]', "shard_ports"),
    ("shards = 2\nshard_ports = [1, 2, 3]", "shard_ports"),
    ("tls_enabled = true", "tls_enabled"),
    ('auth_provider = "sasl"', "auth_provider"),
    ("entry_log_max_bytes = 1000", "entry_log_max_bytes"),
    ("minor_compaction_threshold = 0.9", "minor_compaction_threshold"),  # above major's 0.8
    ("major_compaction_threshold = 1.5", "major_compaction_threshold"),
    ("disk_usage_lwm = 0.97", "disk_usage_lwm"),  # above the threshold: no hysteresis
    ("disk_usage_threshold = 1.2", "disk_usage_threshold"),
    ("compaction_rate_mb_s = 0", "compaction_rate_mb_s"),
    ("disk_check_interval_s = -1", "disk_check_interval_s"),
    ("lost_bookie_delay_s = -5", "lost_bookie_delay_s"),
    ('autorecovery = "perhaps"', "autorecovery"),
])
def test_bad_value_gives_config_error_naming_the_key(tmp_path: Path, line: str, key: str) -> None:
    """An invalid value raises ConfigError whose message names the offending key."""
    with pytest.raises(ConfigError) as ei:
        load(tmp_path, f'metadata_uri = "{URI}"\n{line}\n')
    assert key in str(ei.value)


@pytest.mark.parametrize("env,key", [
    ({"BK_PORT": "eighty"}, "port"),
    ({"BK_READONLY": "perhaps"}, "readonly"),
    ({"BK_JOURNAL_MAX_GROUP_WAIT_US": "1ms"}, "journal_max_group_wait_us"),
])
def test_bad_env_value_gives_config_error_naming_the_key(tmp_path: Path, env: dict[str, str], key: str) -> None:
    """An invalid BK_* env value raises ConfigError naming the key."""
    with pytest.raises(ConfigError) as ei:
        load(tmp_path, f'metadata_uri = "{URI}"\n', env=env)
    assert key in str(ei.value)


def test_bad_alias_value_gives_config_error_naming_the_key(tmp_path: Path) -> None:
    """A bad value under an Apache alias raises ConfigError naming the key (alias or its target)."""
    with pytest.raises(ConfigError) as ei:
        load(tmp_path, f'metadata_uri = "{URI}"\nbookiePort = "x"\n')
    assert re.search(r"'bookiePort'|'port'", str(ei.value)), str(ei.value)


@pytest.mark.parametrize("uri", ["http://127.0.0.1:2181/ledgers", "127.0.0.1:2181", ""])
def test_metadata_uri_must_be_a_zk_uri(tmp_path: Path, uri: str) -> None:
    """metadata_uri must look like zk://host:port/path; anything else is a ConfigError naming it."""
    with pytest.raises(ConfigError, match="metadata_uri"):
        load(tmp_path, f'metadata_uri = "{uri}"\n')


def test_metadata_uri_with_any_root_path_is_accepted(tmp_path: Path) -> None:
    """metadata_uri may use any ZooKeeper path as its root (docs/api.md)."""
    c = load(tmp_path, 'metadata_uri = "zk://h1:2181,h2:2181/some/other/root"\n')
    assert c.metadata_uri.endswith("/some/other/root")


def test_unknown_key_gives_config_error_naming_it(tmp_path: Path) -> None:
    """A key that is neither ours nor an Apache alias is refused, named in the error."""
    with pytest.raises(ConfigError, match="journal_dri"):
        load(tmp_path, f'metadata_uri = "{URI}"\njournal_dri = "/typo"\n')


def test_missing_metadata_uri_gives_config_error(tmp_path: Path) -> None:
    """metadata_uri is the one required key: a config without it is a ConfigError naming it."""
    with pytest.raises(ConfigError, match="metadata_uri"):
        load(tmp_path, "port = 3181\n")
    with pytest.raises(ConfigError, match="metadata_uri"):
        BookieConfig.load(None, env={})


def test_config_error_is_a_bk_error() -> None:
    """ConfigError belongs to the BKError hierarchy (one error root)."""
    assert issubclass(ConfigError, BKError)
