"""The bookie's admin HTTP (`http_port`): heartbeat, Prometheus metrics of every shard, state,
readiness, the maintenance switch, info, garbage collection and auto-recovery status
(Reference: Apache BookKeeper's HTTP admin).

Lives in: the supervisor process, a WSGI server on a bounded pool of threads (a GC an
operator waits on must not hold up a scrape, and a flood of requests must not grow threads
without bound: over ADMIN_THREADS running and ADMIN_QUEUE waiting, a connection is answered
503 and closed; over TLS it is closed unanswered, as answering needs a handshake the accepting
thread must not wait for). TLS, authentication and roles: bookkeeper/bookie/admin_security.py
(HTTPS whenever the bookie's `tls` is not off; liveness open, GETs `read`, the rest `admin`).
Routes (docs/api.md section 10):
  GET  /heartbeat                     "OK"
  GET  /metrics                       Prometheus text: every shard's metrics labelled shard,
                                      the bookie's own (state, disks, shards up, restarts)
  GET  /api/v1/bookie/state           {"state", "reason", "shards": [{"index", "state", "reason"}]}
  GET  /api/v1/bookie/is_ready        200 {"ready": true, "state"} once registered in ZooKeeper with
                                      every shard serving; else 503 {"ready": false, "reason"}
  GET  /api/v1/bookie/state/readonly  {"readonly": the maintenance switch, "state", "reason"}
  PUT  /api/v1/bookie/state/readonly  body {"readonly": bool}: sets the switch (kept across
                                      restarts), answers as GET once shards and registration follow
  GET  /api/v1/bookie/info            {"bookie_id", "ledgers", "dirs": [{"path", "kind", "total_bytes",
                                      "free_bytes", "pool_bytes", "usage", "full"}]}
  POST /api/v1/bookie/gc              runs a GC pass on every shard, waits, returns the sums; while
                                      a forced pass runs, others are answered 409 at once
  GET  /api/v1/autorecovery/status    on every bookie: {"enabled", "auditor", "underreplicated"} from
                                      ZooKeeper, plus the embedded service's own keys where it runs
"""
from __future__ import annotations

import json
import logging
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from bookkeeper.bookie.add_trace import REPORT_PAGE, parse_peers, parse_seconds
from bookkeeper.bookie.admin_security import (OPEN_ROUTES, AdminGuard, AdminTLS, NoCredential, PlainHTTPOnTLS,
                                              Refusals, required_role)
from bookkeeper.bookie.metrics import PREFIX, families
from bookkeeper.bookie.state import READONLY, measure_dir
from bookkeeper.errors import AuthenticationError, AuthorizationError
from bookkeeper.meta.underreplication import UnderReplicationManager

if TYPE_CHECKING:
    from bookkeeper.bookie.supervisor import Supervisor

GC_TIMEOUT_S = 3600.0
ADMIN_THREADS = 8  # requests served at once (a forced GC holds one for its whole pass)
ADMIN_QUEUE = 256  # requests accepted and waiting for a thread; more are answered 503
REQUEST_TIMEOUT_S = 30.0  # a peer that sends nothing for this long gives its thread back
MAX_BODY_BYTES = 4096  # a request body (the read-only switch's is a few bytes)
PEERCERT = "bookkeeper.peercert"  # the environ key of a TLS peer's verified certificate (None: none)
PROMETHEUS_TEXT = "text/plain; version=0.0.4"
log = logging.getLogger("bookkeeper.bookie")
_GC_SUMS = ("ledgers_deleted", "logs_compacted", "logs_deleted", "entries_copied", "bytes_copied",
            "bytes_reclaimed")


class BookieCollector:
    """A prometheus_client collector that asks the shards at scrape time."""

    def __init__(self, sup: Supervisor, refusals: Refusals) -> None:
        self.sup = sup
        self.refusals = refusals

    def collect(self) -> Iterator[Metric]:
        sup = self.sup
        snaps = sup.shard_call({"op": "stats"}, timeout_s=2.0)
        yield from families(snaps)
        up = GaugeMetricFamily(PREFIX + "bookie_shards_up", "shard processes running")
        up.add_metric([], sum(1 for p in sup.procs.values() if p.poll() is None))
        yield up
        restarts = GaugeMetricFamily(PREFIX + "bookie_shard_restarts", "shard restarts since start")
        restarts.add_metric([], sup.restarts)
        yield restarts
        if sup.test_switches:  # only a test's bookie: it breaks a guarantee on purpose (testing_switches.py)
            switches = GaugeMetricFamily(PREFIX + "test_switch", "1 for each test-only switch this bookie runs "
                                         "with (BK_TEST_SWITCHES); absent in a real bookie", labels=["name"])
            for name in sorted(sup.test_switches):
                switches.add_metric([name], 1)
            yield switches
        ro = GaugeMetricFamily(PREFIX + "bookie_readonly", "1 if the bookie is registered read-only")
        ro.add_metric([], int(sup.state == READONLY))
        yield ro
        usage = GaugeMetricFamily(PREFIX + "disk_usage_ratio", "used share of each dir's filesystem",
                                  labels=["path", "kind"])
        for d in sup.dirs:
            usage.add_metric([d.path, d.kind], d.usage)
        yield usage
        if sup.autorecovery is not None:
            status = sup.autorecovery.status()
            under = GaugeMetricFamily(PREFIX + "autorecovery_under_replicated_ledgers",
                                      "ledgers marked under-replicated (as of this bookie's last look)")
            under.add_metric([], status.get("under_replicated", 0))
            yield under
            writes = GaugeMetricFamily(PREFIX + "autorecovery_auditor_zk_writes",
                                       "ZooKeeper writes the auditor in this bookie made")
            writes.add_metric([], status.get("auditor_zk_writes", 0))
            yield writes
        refused = CounterMetricFamily(PREFIX + "admin_http_refused_total",
                                      "admin HTTP requests refused, by reason", labels=["reason"])
        for reason, n in self.refusals.snapshot().items():
            refused.add_metric([reason], n)
        yield refused


def state_report(sup: Supervisor) -> dict[str, Any]:
    shards = sup.shard_call({"op": "stats"}, timeout_s=2.0)
    return {"bookie_id": sup.cfg.id, "state": sup.state, "reason": sup.reason,
            "shards": [{"index": i, "state": shards[i]["state"] if i in shards else "down",
                        "reason": shards[i]["reason"] if i in shards else "not answering"}
                       for i in sorted(sup.procs)]}


def info_report(sup: Supervisor) -> dict[str, Any]:
    """Ledgers held and each dir's room: free_bytes as the filesystem says, pool_bytes the
    journal's pool (reuse files, spares), usage the share the thresholds see (pool as free)."""
    shards = sup.shard_call({"op": "stats"}, timeout_s=2.0)
    cfg = sup.cfg
    dirs = []
    for d in sup.dirs:
        m = measure_dir(d.path, d.kind, warn=cfg.disk_usage_warn, lwm=cfg.disk_usage_lwm)
        dirs.append({"path": d.path, "kind": d.kind, "total_bytes": m.total_bytes, "free_bytes": m.free_bytes,
                     "pool_bytes": m.pool_bytes, "usage": round(m.usage, 4), "full": d.full})
    return {"bookie_id": cfg.id, "ledgers": sum(s["gauges"]["ledgers"] for s in shards.values()),
            "dirs": dirs}


def readiness_report(sup: Supervisor) -> tuple[str, dict[str, Any]]:
    """200 once registered with every shard serving (a read-only bookie is ready: it serves
    reads, and is registered as what it is), 503 with the reason otherwise."""
    reason = sup.readiness()
    if reason is None:
        return "200 OK", {"ready": True, "state": sup.state}
    return "503 Service Unavailable", {"ready": False, "reason": reason}


def autorecovery_status(sup: Supervisor) -> tuple[str, dict[str, Any]]:
    """The cluster's auto-recovery as ZooKeeper has it (any bookie answers), plus the embedded
    service's own view where this bookie runs it."""
    assert sup.store is not None  # the admin HTTP starts after the ZooKeeper session
    try:
        cluster = UnderReplicationManager(sup.store).status()
    except Exception as e:  # kazoo's errors have no common root: the asker gets the reason
        return "503 Service Unavailable", {"error": f"ZooKeeper: {type(e).__name__}: {e}"}
    own = sup.autorecovery.status() if sup.autorecovery is not None else {}
    return "200 OK", {**own, **cluster}


def readonly_switch(sup: Supervisor) -> dict[str, Any]:
    return {"readonly": sup.manual_readonly, "state": sup.state, "reason": sup.reason}


def set_readonly_switch(sup: Supervisor, body: bytes) -> tuple[str, dict[str, Any]]:
    """PUT /api/v1/bookie/state/readonly: body {"readonly": true|false}; anything else is a 400."""
    try:
        request = json.loads(body)
    except ValueError as e:
        return "400 Bad Request", {"error": f'body must be JSON {{"readonly": true|false}}: {e}'}
    if not isinstance(request, dict) or set(request) != {"readonly"} or not isinstance(request["readonly"], bool):
        got = body[:200].decode(errors="replace")
        return "400 Bad Request", {"error": f'body must be {{"readonly": true|false}}, got {got}'}
    try:
        sup.set_readonly_switch(request["readonly"])
    except OSError as e:  # the switch could not be persisted: nothing changed
        return "500 Internal Server Error", {"error": f"could not persist the switch: {e}"}
    return "200 OK", readonly_switch(sup)


def run_gc(sup: Supervisor) -> dict[str, Any]:
    """A forced GC pass on every shard at once; the sums plus each shard's own result."""
    results = sup.shard_call({"op": "gc", "force": True}, timeout_s=GC_TIMEOUT_S)
    out: dict[str, Any] = {k: sum(r.get(k, 0) for r in results.values()) for k in _GC_SUMS}
    out["duration_s"] = max((r.get("duration_s", 0.0) for r in results.values()), default=0.0)
    out["shards"] = [results[i] for i in sorted(results)]
    out["shards_failed"] = sorted(set(sup.procs) - set(results))
    return out


def add_trace_report(sup: Supervisor) -> dict[str, Any]:
    """GET /api/v1/bookie/add_trace: each shard's records of the running or last add trace
    (bookkeeper/bookie/add_trace.py), read in pages of REPORT_PAGE (one page per turn of the
    shard's loop, never all at once), one shard after another, until a page reaches the
    newest record there was when that shard's read began (a running trace's last page may
    hold newer ones; records it drops meanwhile are missing, and counted in `dropped`); a
    shard that does not answer is left out."""
    def page(i: int, start: int) -> dict[str, Any] | None:  # None: the shard did not answer, or refused
        return sup.shard_call({"op": "add_trace", "from": start, "limit": REPORT_PAGE}, timeout_s=5.0,
                              shards=[i]).get(i)

    shards, failed = [], []
    for i in sorted(sup.procs):
        records: list[Any] = []
        last = page(i, 0)
        end = last["end"] if last else 0
        while last is not None:
            records += last["records"]
            if not last["records"] or last["next"] >= end:
                shards.append({"index": i, "fields": last["fields"], "records": records, "dropped": last["dropped"],
                               "peers": last["peers"], "remaining_s": last["remaining_s"]})
                break
            last = page(i, last["next"])
        else:
            failed.append(i)
    return {"shards": shards, "shards_failed": failed}


def start_add_trace(sup: Supervisor, body: bytes) -> tuple[str, dict[str, Any]]:
    """POST /api/v1/bookie/add_trace: body {"peers": ["host:port", ...], "seconds": N} starts a
    trace of those peers' adds on every shard (the last one's records are dropped); a bad body
    is a 400 and changes nothing."""
    try:
        request = json.loads(body)
        if not isinstance(request, dict) or set(request) != {"peers", "seconds"}:
            raise ValueError('body must be {"peers": ["host:port", ...], "seconds": N}')
        peers, seconds = sorted(parse_peers(request["peers"])), parse_seconds(request["seconds"])
    except ValueError as e:
        return "400 Bad Request", {"error": str(e)}
    results = sup.shard_call({"op": "add_trace", "peers": peers, "seconds": seconds}, timeout_s=5.0)
    return "200 OK", {"peers": peers, "seconds": seconds, "shards": sorted(results),
                      "shards_failed": sorted(set(sup.procs) - set(results))}


class OneGcAtATime:
    """POST /api/v1/bookie/gc: one forced pass at a time. A second request while one runs is
    answered 409 at once, saying since when: queueing it would hold an admin thread for up to
    an hour to redo work the running pass is doing, and a pass per request multiplies the
    compaction's disk traffic by the number of askers."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._since: float | None = None  # wall time the running pass started; None when none runs

    def __call__(self, sup: Supervisor) -> tuple[str, dict[str, Any]]:
        with self._mutex:
            now = time.time()
            if self._since is not None:
                return "409 Conflict", busy_answer(self._since, now)
            self._since = now
        try:
            return "200 OK", run_gc(sup)
        finally:
            with self._mutex:
                self._since = None


def busy_answer(since: float, now: float) -> dict[str, Any]:
    """The 409's body: a pass is running, since when (UTC) and for how long."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since))
    return {"error": f"a forced GC pass is running since {stamp} ({now - since:.1f} s): try again when it ends",
            "running_since": stamp}


READONLY_PATH = "/api/v1/bookie/state/readonly"
GC_PATH = "/api/v1/bookie/gc"
ADD_TRACE_PATH = "/api/v1/bookie/add_trace"
# Routes answered 200 with the report's JSON, and routes whose answer says its own status.
_REPORTS: dict[tuple[str, str], Callable[[Supervisor], dict[str, Any]]] = {
    ("GET", "/api/v1/bookie/state"): state_report, ("GET", "/api/v1/bookie/info"): info_report,
    ("GET", READONLY_PATH): readonly_switch, ("GET", ADD_TRACE_PATH): add_trace_report}
Answer = Callable[["Supervisor"], tuple[str, dict[str, Any]]]
_ANSWERS: dict[tuple[str, str], Answer] = {
    ("GET", "/api/v1/bookie/is_ready"): readiness_report, ("GET", "/api/v1/autorecovery/status"): autorecovery_status}


class _PooledWSGIServer(WSGIServer):
    """A WSGI server whose requests run on a fixed pool of threads, with at most ADMIN_QUEUE
    waiting: socketserver's ThreadingMixIn starts a thread per connection, so a flood (or peers
    that connect and send nothing) would grow threads without bound. With `tls` set, each
    connection's handshake runs on its worker thread, with the request's deadline."""

    request_queue_size = 128  # the listen backlog: a burst of askers is not made to retry SYNs
    tls: AdminTLS | None = None

    def server_activate(self) -> None:
        super().server_activate()
        self.refusals = Refusals()
        self._waiting: queue.SimpleQueue[tuple[Any, Any] | None] = queue.SimpleQueue()
        self._slots = threading.BoundedSemaphore(ADMIN_THREADS + ADMIN_QUEUE)
        for i in range(ADMIN_THREADS):  # daemon threads: a GC in progress does not hold up the bookie's exit
            threading.Thread(target=self._work, daemon=True, name=f"admin-http-{i}").start()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refusals.count("busy")
            if self.tls is None:
                _refuse_busy(request)
            self.shutdown_request(request)
            return
        self._waiting.put((request, client_address))

    def _work(self) -> None:
        while (job := self._waiting.get()) is not None:
            request, client_address = job
            try:
                request = self._secure(request, client_address)
                if request is not None:
                    self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                if request is not None:
                    self.shutdown_request(request)
                self._slots.release()

    def _secure(self, sock: socket.socket, client_address: Any) -> socket.socket | None:
        """The connection to serve: `sock` in plain text, its TLS wrapping after a handshake;
        None when refused (counted, closed)."""
        if self.tls is None:
            return sock
        try:
            return self.tls.accept(sock, timeout_s=REQUEST_TIMEOUT_S)
        except PlainHTTPOnTLS:
            self.refusals.count("plain_http")
            _refuse_plain(sock)
        except (ssl.SSLError, OSError) as e:
            self.refusals.count("tls_handshake")
            log.debug("admin HTTP: TLS handshake with %s failed: %s", client_address[0], e)
        sock.close()
        return None

    def server_close(self) -> None:
        super().server_close()
        for _ in range(ADMIN_THREADS):
            self._waiting.put(None)


def _refuse_busy(request: socket.socket) -> None:
    """503 written straight to a connection no thread can take (a few bytes into an empty send
    buffer: it does not block the accepting thread)."""
    body = json.dumps({"error": f"admin HTTP busy: {ADMIN_THREADS + ADMIN_QUEUE} requests in progress"}).encode()
    try:
        request.setblocking(False)
        request.send(_plain_answer("503 Service Unavailable", body))
    except OSError:
        pass  # the peer is gone or not reading: closing it is all that is left


def _refuse_plain(sock: socket.socket) -> None:
    """400 in plain text to a plain HTTP request on the TLS port, saying to use HTTPS (a
    reset would leave the caller guessing). Its request is read first, so that closing with
    unread bytes does not reset the connection before the answer is taken."""
    body = json.dumps({"error": "this admin HTTP serves HTTPS only (tls is on at this bookie): use https:// "
                                "with the CA of the bookie's certificate (bk: BK_TLS_CA_FILE)"}).encode()
    try:
        sock.recv(MAX_BODY_BYTES * 16)
        sock.sendall(_plain_answer("400 Bad Request", body))
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the peer is gone: nothing to tell it


def _plain_answer(status: str, body: bytes) -> bytes:
    head = (f"HTTP/1.0 {status}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) + 1}\r\nConnection: close\r\n\r\n").encode()
    return head + body + b"\n"


class _Quiet(WSGIRequestHandler):
    """No request log (a request line can carry anything; headers hold tokens); the TLS peer's
    verified certificate, if it gave one, in the environ for mtls."""

    timeout = REQUEST_TIMEOUT_S

    def log_message(self, *args: Any) -> None:
        pass

    def get_environ(self) -> dict[str, Any]:
        environ = super().get_environ()
        if isinstance(self.connection, ssl.SSLSocket):
            environ[PEERCERT] = self.connection.getpeercert() or None
            environ["wsgi.url_scheme"] = "https"
        return environ


def start_admin_http(sup: Supervisor) -> WSGIServer:
    """Serve the admin routes on the bookie's http_port (bind_address), on a bounded pool,
    over TLS unless the bookie's `tls` is off, authenticated as the bookie's clients are."""
    cfg = sup.cfg
    guard = AdminGuard.from_config(cfg)
    tls = AdminTLS(cfg, ask_client_cert=guard.client_certs_asked) if cfg.tls != "off" else None
    refusals = Refusals()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BookieCollector(sup, refusals))  # type: ignore[arg-type]
    gc = OneGcAtATime()
    answers: dict[tuple[str, str], Answer] = {**_ANSWERS, ("POST", GC_PATH): gc, ("PUT", GC_PATH): gc}
    # Routes that read a body: the read-only switch, starting an add trace.
    with_body: dict[tuple[str, str], Callable[[bytes], tuple[str, dict[str, Any]]]] = {
        ("PUT", READONLY_PATH): lambda body: set_readonly_switch(sup, body),
        ("POST", ADD_TRACE_PATH): lambda body: start_add_trace(sup, body)}
    known = {("GET", "/metrics"), *with_body, *_REPORTS, *answers}

    def serve(method: str, path: str, environ: dict[str, Any]) -> tuple[str, bytes, str]:
        key = (method, path)
        if key == ("GET", "/metrics"):
            return "200 OK", generate_latest(registry), PROMETHEUS_TEXT
        if key in _REPORTS:
            return _json_body("200 OK", _REPORTS[key](sup))
        if key in answers:
            return _json_body(*answers[key](sup))
        return _json_body(*_with_body(environ, with_body[key]))

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "GET")
        if path == "/heartbeat":
            return _reply(start_response, "200 OK", b"OK\n", "text/plain")
        if method not in ("GET", "HEAD") and environ.get("HTTP_ORIGIN"):
            # A browser's cross-site request (a page the operator visits POSTing here, with the
            # operator's client certificate, or on a bookie without auth): bk and curl send no Origin.
            refusals.count("cross_site")
            return _json(start_response, "403 Forbidden", {"error": "cross-site request refused (Origin header)"})
        principal = None
        if path not in OPEN_ROUTES:
            try:
                principal = guard.authenticate(environ.get("HTTP_AUTHORIZATION"), environ.get(PEERCERT))
            except AuthenticationError as e:
                refusals.count("no_credential" if isinstance(e, NoCredential) else "bad_credential")
                return _unauthenticated(start_response, e, bearer=guard.takes_bearer)
        if (method, path) not in known:
            if any(p == path for _m, p in known):
                return _json(start_response, "405 Method Not Allowed", {"error": f"{method} not allowed on {path}"})
            return _json(start_response, "404 Not Found", {"error": f"no route {path}"})
        role = required_role(method, path)
        if principal is not None and role is not None:
            try:
                guard.authorize(principal, role)
            except AuthorizationError as e:
                refusals.count("forbidden")
                return _json(start_response, "403 Forbidden", {"error": str(e), "principal": principal, "role": role})
        status, body, ctype = serve(method, path, environ)
        return _reply(start_response, status, body, ctype)

    server = make_server(cfg.bind_address or "0.0.0.0", cfg.http_port, app,
                         server_class=_PooledWSGIServer, handler_class=_Quiet)
    server.refusals, server.tls = refusals, tls  # before serving: the workers read them per connection
    threading.Thread(target=server.serve_forever, daemon=True, name="admin-http").start()
    return server


def _unauthenticated(start_response: Any, e: AuthenticationError, *, bearer: bool) -> list[bytes]:
    """401 with the reason (which never repeats the credential) and, where tokens are taken,
    the challenge RFC 6750 asks for."""
    body = json.dumps({"error": f"not authenticated: {e}"}).encode() + b"\n"
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    if bearer:
        headers.append(("WWW-Authenticate", 'Bearer realm="bookkeeper admin"'))
    start_response("401 Unauthorized", headers)
    return [body]


def _with_body(environ: dict[str, Any],
               handle: Callable[[bytes], tuple[str, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    """Read the request body (at most MAX_BODY_BYTES) and hand it to handle(body)."""
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return "400 Bad Request", {"error": "Content-Length is not a number"}
    if length > MAX_BODY_BYTES:
        return "413 Content Too Large", {"error": f"body over {MAX_BODY_BYTES} bytes"}
    return handle(environ["wsgi.input"].read(length) if length > 0 else b"")


def _reply(start_response: Any, status: str, body: bytes, ctype: str) -> list[bytes]:
    start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(body)))])
    return [body]


def _json_body(status: str, obj: Any) -> tuple[str, bytes, str]:
    return status, json.dumps(obj).encode() + b"\n", "application/json"


def _json(start_response: Any, status: str, obj: Any) -> list[bytes]:
    return _reply(start_response, *_json_body(status, obj))
