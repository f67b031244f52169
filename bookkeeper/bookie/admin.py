"""The bookie's admin HTTP (`http_port`): heartbeat, Prometheus metrics of every shard, state,
readiness, the maintenance switch, info, garbage collection and auto-recovery status
(Reference: Apache BookKeeper's HTTP admin).

Lives in: the supervisor process, a WSGI server on a bounded pool of threads (a GC an
operator waits on must not hold up a scrape, and a flood of requests must not grow threads
without bound: over ADMIN_THREADS running and ADMIN_QUEUE waiting, a connection is answered
503 and closed). Routes (docs/api.md section 10):
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
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from bookkeeper.bookie.metrics import PREFIX, families
from bookkeeper.bookie.state import READONLY, measure_dir
from bookkeeper.meta.underreplication import UnderReplicationManager

if TYPE_CHECKING:
    from bookkeeper.bookie.supervisor import Supervisor

GC_TIMEOUT_S = 3600.0
ADMIN_THREADS = 8  # requests served at once (a forced GC holds one for its whole pass)
ADMIN_QUEUE = 256  # requests accepted and waiting for a thread; more are answered 503
REQUEST_TIMEOUT_S = 30.0  # a peer that sends nothing for this long gives its thread back
MAX_BODY_BYTES = 4096  # a request body (the read-only switch's is a few bytes)
_GC_SUMS = ("ledgers_deleted", "logs_compacted", "logs_deleted", "entries_copied", "bytes_copied",
            "bytes_reclaimed")


class BookieCollector:
    """A prometheus_client collector that asks the shards at scrape time."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup

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
# Routes answered 200 with the report's JSON, and routes whose answer says its own status.
_REPORTS: dict[tuple[str, str], Callable[[Supervisor], dict[str, Any]]] = {
    ("GET", "/api/v1/bookie/state"): state_report, ("GET", "/api/v1/bookie/info"): info_report,
    ("GET", READONLY_PATH): readonly_switch}
Answer = Callable[["Supervisor"], tuple[str, dict[str, Any]]]
_ANSWERS: dict[tuple[str, str], Answer] = {
    ("GET", "/api/v1/bookie/is_ready"): readiness_report, ("GET", "/api/v1/autorecovery/status"): autorecovery_status}


class _PooledWSGIServer(WSGIServer):
    """A WSGI server whose requests run on a fixed pool of threads, with at most ADMIN_QUEUE
    waiting: socketserver's ThreadingMixIn starts a thread per connection, so a flood (or peers
    that connect and send nothing) would grow threads without bound."""

    request_queue_size = 128  # the listen backlog: a burst of askers is not made to retry SYNs

    def server_activate(self) -> None:
        super().server_activate()
        self._waiting: queue.SimpleQueue[tuple[Any, Any] | None] = queue.SimpleQueue()
        self._slots = threading.BoundedSemaphore(ADMIN_THREADS + ADMIN_QUEUE)
        for i in range(ADMIN_THREADS):  # daemon threads: a GC in progress does not hold up the bookie's exit
            threading.Thread(target=self._work, daemon=True, name=f"admin-http-{i}").start()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            _refuse_busy(request)
            self.shutdown_request(request)
            return
        self._waiting.put((request, client_address))

    def _work(self) -> None:
        while (job := self._waiting.get()) is not None:
            request, client_address = job
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)
                self._slots.release()

    def server_close(self) -> None:
        super().server_close()
        for _ in range(ADMIN_THREADS):
            self._waiting.put(None)


def _refuse_busy(request: socket.socket) -> None:
    """503 written straight to a connection no thread can take (a few bytes into an empty send
    buffer: it does not block the accepting thread)."""
    body = json.dumps({"error": f"admin HTTP busy: {ADMIN_THREADS + ADMIN_QUEUE} requests in progress"}).encode()
    head = (f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) + 1}\r\nConnection: close\r\n\r\n").encode()
    try:
        request.setblocking(False)
        request.send(head + body + b"\n")
    except OSError:
        pass  # the peer is gone or not reading: closing it is all that is left


class _Quiet(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S

    def log_message(self, *args: Any) -> None:
        pass


def start_admin_http(sup: Supervisor) -> WSGIServer:
    """Serve the admin routes on the bookie's http_port (bind_address), on a bounded pool."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BookieCollector(sup))  # type: ignore[arg-type]
    gc = OneGcAtATime()
    answers: dict[tuple[str, str], Answer] = {**_ANSWERS, ("POST", GC_PATH): gc, ("PUT", GC_PATH): gc}

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "GET")
        if path == "/heartbeat":
            return _reply(start_response, "200 OK", b"OK\n", "text/plain")
        if path == "/metrics":
            return _reply(start_response, "200 OK", generate_latest(registry), "text/plain; version=0.0.4")
        key = (method, path)
        if key in _REPORTS:
            return _json(start_response, "200 OK", _REPORTS[key](sup))
        if key in answers:
            return _json(start_response, *answers[key](sup))
        if key == ("PUT", READONLY_PATH):
            return _json(start_response, *_with_body(environ, lambda body: set_readonly_switch(sup, body)))
        if any(p == path for _m, p in [*_REPORTS, *answers]):
            return _json(start_response, "405 Method Not Allowed", {"error": f"{method} not allowed on {path}"})
        return _json(start_response, "404 Not Found", {"error": f"no route {path}"})

    server = make_server(sup.cfg.bind_address or "0.0.0.0", sup.cfg.http_port, app,
                         server_class=_PooledWSGIServer, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, daemon=True, name="admin-http").start()
    return server


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


def _json(start_response: Any, status: str, obj: Any) -> list[bytes]:
    return _reply(start_response, status, json.dumps(obj).encode() + b"\n", "application/json")
