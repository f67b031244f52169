"""A real, throw-away ZooKeeper server for tests and the local sandbox.

Design note
-----------
BookKeeper's metadata lives in ZooKeeper, and the behaviour we depend on
(sessions, ephemeral znodes, watches, session expiry, sequential nodes) is
subtle enough that a fake would let bugs through. So tests run against the
real thing: Debian's ``zookeeper`` package (3.8 on bookworm), driven directly
from Python.

* We launch ``java ... org.apache.zookeeper.server.ZooKeeperServerMain zoo.cfg``
  ourselves instead of going through ``zkServer.sh``: the script daemonises,
  writes pid files to fixed places and reads ``/etc/zookeeper/conf``, which
  makes it hard to own the process and to run several servers side by side.
  A direct child in its own session gives us the exact pid to signal and makes
  sure a Ctrl-C on the test runner is not delivered to the JVM twice.
* Everything a server writes (``zoo.cfg``, ``log4j.properties``, the combined
  stdout/stderr log ``zookeeper.log`` and the ``data/`` snapshot and
  transaction-log directory) lives under the caller's ``data_dir``, so servers
  never share state and a failing test leaves its evidence in one place.
* The server binds only to its ``address``: 127.0.0.1 unless the caller names
  another (a test host's address, so clients on other hosts reach it), and the
  embedded Jetty admin server is disabled, so nothing is exposed beyond that
  one address and no second port is taken.
* Readiness is judged by the four-letter ``srvr`` command (whitelisted in
  ``zoo.cfg``), which only reports a ``Mode:`` once the server is actually
  serving requests - an open TCP port alone is not enough.
* Durability knobs are relaxed (``zookeeper.forceSync=no``, small
  pre-allocation): data still reaches the page cache, so it survives the
  process being killed and restarted, which is all tests need; only a host
  crash could lose it.
* Servers still running at interpreter exit are stopped by an ``atexit`` hook
  so an aborted test run does not leave JVMs behind. (A SIGKILL of the Python
  process itself cannot be covered this way.)

Only the standard library is used so the harness can run before any project
dependency is installed.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from types import TracebackType

__all__ = [
    "ZooKeeperServer",
    "ZooKeeperUnavailable",
    "free_port",
    "zookeeper_classpath",
    "find_java",
    "four_letter_word",
    "port_in_use",
]

_LOOPBACK = "127.0.0.1"
_MAIN_CLASS = "org.apache.zookeeper.server.ZooKeeperServerMain"

# Where Debian (and, as a fallback, an unpacked upstream tarball) keep things.
_DEBIAN_ENV_FILES = (
    "/etc/zookeeper/conf/environment",
    "/usr/share/zookeeper/bin/zkEnv.sh",
)
_ZK_JAR_CANDIDATES = (
    "/usr/share/java/zookeeper.jar",
    "/usr/share/zookeeper/zookeeper.jar",
)
_ZK_LIB_DIRS = (
    "/usr/share/zookeeper/lib",
)
_JAVA_SHARE = "/usr/share/java"
# slf4j -> log4j 1.2 binding. Debian's zookeeper.jar manifest pulls in only
# slf4j-api, which without a binding silently drops every log line; adding the
# binding makes our log4j.properties (and thus the log tail in error messages)
# work.
_LOGGING_JARS = ("slf4j-log4j12.jar", "log4j-1.2.jar")
# Netty jars the manifest leaves out but NettyServerCnxnFactory (the secure client port) needs:
# without them every TLS connection dies with NoClassDefFoundError ByteToMessageDecoder.
_NETTY_JARS = ("netty-codec.jar", "netty-resolver.jar", "netty-transport-native-unix-common.jar")

_INSTALL_HINT = "install it with `apt-get install zookeeper`"


class ZooKeeperUnavailable(RuntimeError):
    """ZooKeeper or Java is not installed, so no server can be started.

    A distinct type so callers (e.g. a conftest) can tell "not installed"
    from "installed but failed to start".
    """


def free_port(address: str = _LOOPBACK) -> int:
    """Return a TCP port on ``address`` (127.0.0.1 by default) that is free right now.

    The kernel picks it (bind to port 0), which avoids collisions between
    parallel test runs. There is an unavoidable window before the caller
    binds it; ``ZooKeeperServer.start`` reports a clear error if it was lost.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def _classpath_from_debian_env() -> list[str]:
    """Jar entries of the CLASSPATH that Debian's zkEnv.sh/environment exports.

    Older Debian releases list every dependency there rather than in the jar
    manifest, so honouring it keeps us working across releases. Directory
    entries (``/etc/zookeeper/conf``) are dropped on purpose: we supply our
    own configuration and do not want the system one on the classpath.
    """
    for env_file in _DEBIAN_ENV_FILES:
        try:
            text = Path(env_file).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        m = re.search(r'^\s*(?:export\s+)?CLASSPATH=["\']?([^"\'\n]*)', text, re.M)
        if not m:
            continue
        return [
            entry
            for entry in m.group(1).split(":")
            if entry.endswith(".jar") and "$" not in entry and os.path.isfile(entry)
        ]
    return []


def zookeeper_classpath() -> str:
    """Return a Java classpath that can run a ZooKeeper server.

    Resolution order: ``$ZOOKEEPER_CLASSPATH`` verbatim if set (escape hatch
    for non-Debian layouts), else Debian's jars (``/etc/zookeeper/conf/
    environment``, ``/usr/share/java/zookeeper.jar`` whose manifest names its
    dependencies, ``/usr/share/zookeeper/lib``), plus the slf4j/log4j binding
    so the server's log is not silently discarded.

    Raises ZooKeeperUnavailable naming the package to install if no ZooKeeper
    jar is found.
    """
    override = os.environ.get("ZOOKEEPER_CLASSPATH", "").strip()
    if override:
        return override

    entries: list[str] = _classpath_from_debian_env()
    for jar in _ZK_JAR_CANDIDATES:
        if os.path.isfile(jar):
            entries.append(jar)
    for lib in _ZK_LIB_DIRS:
        if os.path.isdir(lib):
            entries.extend(sorted(str(p) for p in Path(lib).glob("*.jar")))

    if not any(os.path.basename(e).startswith("zookeeper") for e in entries):
        raise ZooKeeperUnavailable(
            "ZooKeeper jars not found (looked at "
            + ", ".join(_ZK_JAR_CANDIDATES + _ZK_LIB_DIRS + _DEBIAN_ENV_FILES)
            + f"); {_INSTALL_HINT}, or set ZOOKEEPER_CLASSPATH"
        )

    # Explicit jute jar: the manifest Class-Path covers it on Debian 3.8, but
    # being explicit costs nothing and protects against a stripped manifest.
    for name in ("zookeeper-jute.jar", *_LOGGING_JARS, *_NETTY_JARS):
        path = os.path.join(_JAVA_SHARE, name)
        if os.path.isfile(path):
            entries.append(path)

    seen: set[str] = set()
    unique = [e for e in entries if not (e in seen or seen.add(e))]
    return os.pathsep.join(unique)


def find_java() -> str:
    """Return the path of the ``java`` executable.

    ``$JAVA_HOME/bin/java`` wins when set (the conventional explicit choice),
    otherwise ``java`` on ``PATH``. Raises ZooKeeperUnavailable if neither
    exists.
    """
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = os.path.join(java_home, "bin", "java")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("java")
    if found:
        return found
    raise ZooKeeperUnavailable(
        "no `java` found on PATH or in $JAVA_HOME/bin; "
        "`apt-get install zookeeper` pulls in a JRE (default-jre)"
    )


def port_in_use(port: int, address: str = _LOOPBACK) -> bool:
    """True if address:port (127.0.0.1 by default) cannot be bound the way the JVM will bind it.

    Java sets SO_REUSEADDR on server sockets on Linux, so we do too: a port
    with only TIME_WAIT leftovers is usable, a listening one is not.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError:
            return True
    return False


def four_letter_word(host: str, port: int, cmd: str, timeout_s: float = 2.0) -> str:
    """Send a ZooKeeper four-letter command and return the full reply.

    The server answers and closes the connection, so we read to EOF.
    """
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.sendall(cmd.encode("ascii"))
        chunks: list[bytes] = []
        while True:
            data = s.recv(4096)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks).decode("utf-8", errors="replace")


# Servers that are running, so they can be stopped at interpreter exit.
_RUNNING: set["ZooKeeperServer"] = set()
_RUNNING_LOCK = threading.Lock()


@atexit.register
def _stop_all_at_exit() -> None:
    """Stop every server this process started and did not stop: no stray JVMs."""
    with _RUNNING_LOCK:
        servers = list(_RUNNING)
    for server in servers:
        try:
            server.stop()
        except Exception:  # pragma: no cover - best effort at shutdown
            pass


_LOG4J_PROPERTIES = """\
# Written by bookkeeper.testing.zookeeper: everything to stdout, which the
# harness redirects to zookeeper.log next to this file.
log4j.rootLogger=INFO, CONSOLE
log4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender
log4j.appender.CONSOLE.Target=System.out
log4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout
log4j.appender.CONSOLE.layout.ConversionPattern=%d{ISO8601} %-5p [%t:%C{1}@%L] - %m%n
"""


def _prop_escape(value: str) -> str:
    """Escape a value for a Java .properties/zoo.cfg line (backslash is special)."""
    if "\n" in value or "\r" in value:
        raise ValueError(f"newline not allowed in ZooKeeper config value: {value!r}")
    return value.replace("\\", "\\\\")


def _ipv4(address: str) -> str:
    """``address`` if it is one IPv4 address (the JVM runs with preferIPv4Stack), else a ValueError naming it."""
    try:
        return str(ipaddress.IPv4Address(address))
    except ValueError:
        raise ValueError(f"address must be one IPv4 address such as 127.0.0.1, got {address!r}") from None


class ZooKeeperServer:
    """A real standalone ZooKeeper from Debian's `zookeeper` package, on 127.0.0.1 (or the
    ``address`` given), for tests and the sandbox.

    The port is fixed at construction (a free one if not given) so that the
    connect string is known before ``start`` and stays the same across a
    ``stop``/``start`` restart; the data directory is kept across restarts
    too, so a restarted server has the same znodes.

    Usage::

        with ZooKeeperServer(tmp_path / "zk") as zk:
            client = KazooClient(hosts=zk.connect_string)
    """

    #: Generous upper bound for client-requested session timeouts, so tests
    #: that ask for long sessions get what they ask for instead of a clamp.
    MAX_SESSION_TIMEOUT_MS = 600_000

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        port: int | None = None,
        tick_ms: int = 500,
        tls_cert_file: str | os.PathLike[str] | None = None,
        tls_ca_file: str | os.PathLike[str] | None = None,
        tls_client_auth: bool = False,
        address: str = _LOOPBACK,
    ) -> None:
        """Prepare (but do not start) a server rooted at ``data_dir``.

        ``tick_ms`` defaults to 500 ms rather than ZooKeeper's 2000 so that
        session-expiry tests run quickly (minimum session timeout is 2 ticks).

        ``tls_cert_file`` (one PEM file: the PKCS#8 private key, then the
        certificate chain) adds a secure client port (TLS 1.3 only, Netty),
        ``secure_port``; ``tls_ca_file`` (PEM) is the trust store for client
        certificates, required with ``tls_client_auth``. The plain port stays
        open for the harness's four-letter readiness checks, and
        ``metadata_uri`` names the secure one.

        ``address`` is the one IPv4 address the server binds and every connect
        string and URI names: a test host's address lets clients on other hosts
        reach it (the free ports are checked on that address).
        """
        if tick_ms <= 0:
            raise ValueError(f"tick_ms must be positive, got {tick_ms}")
        if port is not None and not (0 < port < 65536):
            raise ValueError(f"port out of range: {port}")
        if tls_client_auth and not (tls_cert_file and tls_ca_file):
            raise ValueError("tls_client_auth needs tls_cert_file and tls_ca_file")
        if tls_ca_file and not tls_cert_file:
            raise ValueError("tls_ca_file without tls_cert_file: the server has no certificate for its TLS port")
        self._address = _ipv4(address)
        self._data_dir = Path(os.path.abspath(os.fspath(data_dir)))
        self._port = port if port is not None else free_port(self._address)
        self._tls_cert_file = os.path.abspath(os.fspath(tls_cert_file)) if tls_cert_file else None
        self._tls_ca_file = os.path.abspath(os.fspath(tls_ca_file)) if tls_ca_file else None
        self._tls_client_auth = tls_client_auth
        self._secure_port = free_port(self._address) if tls_cert_file else None
        self._tick_ms = tick_ms
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.RLock()
        #: Seconds the last successful ``start`` took until serving.
        self.startup_seconds: float | None = None

    # ------------------------------------------------------------------ props
    @property
    def address(self) -> str:
        """The address the server binds and its connect string names (127.0.0.1 by default)."""
        return self._address

    @property
    def port(self) -> int:
        """Client port on ``address``."""
        return self._port

    @property
    def secure_port(self) -> int | None:
        """The TLS client port on ``address``, or None when the server was made without a certificate."""
        return self._secure_port

    @property
    def pid(self) -> int | None:
        """Pid of the JVM while it is running, else None."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return None
        return proc.pid

    @property
    def connect_string(self) -> str:
        """ZooKeeper client connect string, e.g. ``127.0.0.1:2181``."""
        return f"{self._address}:{self._port}"

    @property
    def data_dir(self) -> Path:
        """Directory holding config, log and data of this server."""
        return self._data_dir

    @property
    def log_path(self) -> Path:
        """The server's combined stdout/stderr log (appended across restarts)."""
        return self._data_dir / "zookeeper.log"

    @property
    def config_path(self) -> Path:
        """The generated zoo.cfg."""
        return self._data_dir / "zoo.cfg"

    def metadata_uri(self, root: str = "/ledgers", *, tls: bool | None = None) -> str:
        """BookKeeper ``metadataServiceUri`` for this server, e.g. ``zk://127.0.0.1:2181/ledgers``;
        ``zk+tls://127.0.0.1:<secure_port>/ledgers`` for the TLS port (the default when the
        server has one; ``tls=False`` names the plain port)."""
        if not root.startswith("/"):
            root = "/" + root
        if tls is None:
            tls = self._secure_port is not None
        if not tls:
            return f"zk://{self._address}:{self._port}{root}"
        if self._secure_port is None:
            raise ValueError("this ZooKeeperServer has no TLS port (make it with tls_cert_file)")
        return f"zk+tls://{self._address}:{self._secure_port}{root}"

    def is_running(self) -> bool:
        """True while the JVM process is alive (not necessarily serving)."""
        return self.pid is not None

    # ------------------------------------------------------------- lifecycle
    def _write_config(self) -> Path:
        """Write zoo.cfg and log4j.properties; return the log4j path."""
        data = self._data_dir / "data"
        data.mkdir(parents=True, exist_ok=True)
        cfg = "\n".join(
            [
                "# Written by bookkeeper.testing.zookeeper; rewritten on every start.",
                f"tickTime={self._tick_ms}",
                f"dataDir={_prop_escape(str(data))}",
                f"clientPort={self._port}",
                f"clientPortAddress={self._address}",
                f"minSessionTimeout={2 * self._tick_ms}",
                f"maxSessionTimeout={max(self.MAX_SESSION_TIMEOUT_MS, 20 * self._tick_ms)}",
                # All clients come from one or a few addresses; the default
                # cap of 60 per IP would bite tests that open many sessions.
                "maxClientCnxns=0",
                "admin.enableServer=false",
                "4lw.commands.whitelist=*",
                *self._tls_lines(),
                "",
            ]
        )
        self.config_path.write_text(cfg, encoding="utf-8")
        log4j = self._data_dir / "log4j.properties"
        log4j.write_text(_LOG4J_PROPERTIES, encoding="utf-8")
        return log4j

    def _tls_lines(self) -> list[str]:
        """zoo.cfg lines of the secure client port: Netty (the only factory with TLS), PEM key
        and trust stores (3.8 reads PEM), TLS 1.3 only with its own cipher suites (3.8.0's
        default suite list names only TLS 1.2 ones: a 1.3-only port refuses every handshake
        with "No appropriate protocol" without them)."""
        if self._secure_port is None:
            return []
        lines = [
            f"secureClientPort={self._secure_port}",
            f"secureClientPortAddress={self._address}",
            "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory",
            f"ssl.keyStore.location={_prop_escape(str(self._tls_cert_file))}",
            "ssl.keyStore.type=PEM",
            "ssl.protocol=TLSv1.3",
            "ssl.enabledProtocols=TLSv1.3",
            "ssl.ciphersuites=TLS_AES_128_GCM_SHA256,TLS_AES_256_GCM_SHA384,TLS_CHACHA20_POLY1305_SHA256",
            f"ssl.clientAuth={'need' if self._tls_client_auth else 'none'}",
        ]
        if self._tls_ca_file:
            lines += [f"ssl.trustStore.location={_prop_escape(self._tls_ca_file)}", "ssl.trustStore.type=PEM"]
        return lines

    def _command(self, log4j: Path) -> list[str]:
        """The java command line (no shell involved)."""
        return [
            find_java(),
            "-cp",
            zookeeper_classpath(),
            "-Xms32m",
            f"-Xmx{os.environ.get('BK_TEST_ZK_HEAP', '256m')}",  # bk bench ledgers --metadata 10^6 needs ~3g
            # Small heap, few GC threads; faster start with the C1 compiler
            # only - ZooKeeper's load in tests is tiny.
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-XX:-UsePerfData",
            "-XX:+ExitOnOutOfMemoryError",
            "-Djava.awt.headless=true",
            "-Djava.net.preferIPv4Stack=true",
            f"-Dlog4j.configuration={log4j.as_uri()}",
            f"-Dzookeeper.log.dir={self._data_dir}",
            # Belt and braces for the zoo.cfg settings of the same name.
            "-Dzookeeper.admin.enableServer=false",
            "-Dzookeeper.4lw.commands.whitelist=*",
            # See design note: page cache is durable enough for tests.
            "-Dzookeeper.forceSync=no",
            "-Dzookeeper.preAllocSize=4096",
            "-Dzookeeper.jmx.log4j.disable=true",
            _MAIN_CLASS,
            str(self.config_path),
        ]

    def _log_tail(self, since: int = 0, max_lines: int = 40) -> str:
        """Last lines the server logged since byte offset ``since``."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                end = f.tell()
                start = max(since, end - 64 * 1024)
                f.seek(start)
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            return "(no log)"
        lines = text.splitlines()[-max_lines:]
        return "\n".join(lines) if lines else "(log is empty)"

    def _serving(self) -> bool:
        """True once ``srvr`` reports a mode, i.e. the server serves requests."""
        try:
            reply = four_letter_word(self._address, self._port, "srvr", timeout_s=1.0)
        except OSError:
            return False
        return "Mode:" in reply

    def start(self, timeout_s: float = 30.0) -> None:
        """Launch the JVM and block until it serves requests.

        Raises RuntimeError (with the tail of the server log) if the port is
        taken, the JVM exits, or it is not serving within ``timeout_s``; in
        the latter case the JVM is killed first so nothing leaks.
        """
        with self._lock:
            if self._proc is not None:
                if self._proc.poll() is None:
                    raise RuntimeError(
                        f"ZooKeeper on {self.connect_string} is already running (pid {self._proc.pid})"
                    )
                self._proc = None
            if port_in_use(self._port, self._address):
                raise RuntimeError(
                    f"cannot start ZooKeeper: port {self._port} on {self._address} is already in use"
                )

            self._data_dir.mkdir(parents=True, exist_ok=True)
            log4j = self._write_config()
            cmd = self._command(log4j)

            with open(self.log_path, "ab") as log:
                log_offset = log.tell()
                log.write(
                    f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} bookkeeper.testing.zookeeper "
                    f"starting: {' '.join(cmd)}\n".encode()
                )
                log.flush()
                # Own session/process group: terminal signals aimed at the
                # test runner do not reach the JVM; we alone decide its end.
                self._proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self._data_dir,
                    start_new_session=True,
                )
            with _RUNNING_LOCK:
                _RUNNING.add(self)

            t0 = time.monotonic()
            deadline = t0 + timeout_s
            while True:
                rc = self._proc.poll()
                if rc is not None:
                    self._forget()
                    tail = self._log_tail(log_offset)
                    reason = (
                        f"port {self._port} on {self._address} is already in use"
                        if "BindException" in tail or "Address already in use" in tail
                        else f"exit code {rc}"
                    )
                    raise RuntimeError(
                        f"ZooKeeper exited during startup ({reason}); log {self.log_path}:\n{tail}"
                    )
                if self._serving():
                    # Re-check: if ours died and someone else answered on the
                    # port in between, do not report success.
                    if self._proc.poll() is None:
                        self.startup_seconds = time.monotonic() - t0
                        return
                    continue
                if time.monotonic() >= deadline:
                    self.stop()
                    raise RuntimeError(
                        f"ZooKeeper on {self.connect_string} not serving after {timeout_s:.1f}s "
                        f"(killed it); log {self.log_path}:\n{self._log_tail(log_offset)}"
                    )
                time.sleep(0.05)

    def _forget(self) -> None:
        """Drop the (already exited) process from our bookkeeping."""
        self._proc = None
        with _RUNNING_LOCK:
            _RUNNING.discard(self)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server: SIGTERM, wait up to ``timeout_s``, then SIGKILL.

        Signals go to the pid only (the JVM is the sole member of its group).
        Idempotent: calling it on a stopped or never-started server is a no-op.
        The data directory is left in place so a later ``start`` resumes it.
        """
        with self._lock:
            proc = self._proc
            if proc is None:
                return
            try:
                if proc.poll() is None:
                    try:
                        os.kill(proc.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
                    try:
                        proc.wait(timeout=timeout_s)
                    except subprocess.TimeoutExpired:
                        try:
                            os.kill(proc.pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                        proc.wait()
            finally:
                self._forget()

    def restart(self, down_s: float = 0.0, timeout_s: float = 30.0) -> None:
        """Stop the server, stay down ``down_s`` seconds, start it again.

        Same port, same data directory: the znodes and the sessions (a session
        is a transaction too) come back with it, as after an operator's restart.
        Clients see a disconnection; a session whose client does not reconnect
        within its timeout of the new start expires then.
        """
        self.stop()
        if down_s > 0:
            time.sleep(down_s)
        self.start(timeout_s)

    def session_ids(self) -> set[int]:
        """Ids of the sessions that have a live client connection now (``cons``).

        A session restored by a restart has none until its client reconnects
        (and expires if that takes longer than its timeout): this is how a test
        tells a resumed session from one that only has not expired yet.
        """
        reply = four_letter_word(self._address, self._port, "cons")
        return {int(m, 16) for m in re.findall(r"sid=0x([0-9a-f]+)", reply)}

    def __enter__(self) -> "ZooKeeperServer":
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.pid else "stopped"
        return f"ZooKeeperServer({self.connect_string}, {state}, data_dir={str(self._data_dir)!r})"
