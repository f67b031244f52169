"""The bookie's admin HTTP (`http_port`): heartbeat, Prometheus metrics of every shard, state,
readiness, the maintenance switch, info, garbage collection and auto-recovery status
(Reference: Apache BookKeeper's HTTP admin).

Lives in: the supervisor process, a threaded WSGI server on daemon threads (a GC an
operator waits on must not hold up a scrape). Routes (docs/api.md section 10):
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
  POST /api/v1/bookie/gc              runs a GC pass on every shard, waits, returns the sums
  GET  /api/v1/autorecovery/status    on every bookie: {"enabled", "auditor", "underreplicated"} from
                                      ZooKeeper, plus the embedded service's own keys where it runs
"""
from __future__ import annotations

import json
import socketserver
import threading
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


READONLY_PATH = "/api/v1/bookie/state/readonly"
# Routes answered 200 with the report's JSON, and routes whose answer says its own status.
_REPORTS: dict[tuple[str, str], Callable[[Supervisor], dict[str, Any]]] = {
    ("GET", "/api/v1/bookie/state"): state_report, ("GET", "/api/v1/bookie/info"): info_report,
    ("POST", "/api/v1/bookie/gc"): run_gc, ("PUT", "/api/v1/bookie/gc"): run_gc,
    ("GET", READONLY_PATH): readonly_switch}
_ANSWERS: dict[tuple[str, str], Callable[[Supervisor], tuple[str, dict[str, Any]]]] = {
    ("GET", "/api/v1/bookie/is_ready"): readiness_report, ("GET", "/api/v1/autorecovery/status"): autorecovery_status}


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


def start_admin_http(sup: Supervisor) -> WSGIServer:
    """Serve the admin routes on the bookie's http_port (bind_address), on daemon threads."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BookieCollector(sup))  # type: ignore[arg-type]

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "GET")
        if path == "/heartbeat":
            return _reply(start_response, "200 OK", b"OK\n", "text/plain")
        if path == "/metrics":
            return _reply(start_response, "200 OK", generate_latest(registry), "text/plain; version=0.0.4")
        key = (method, path)
        if key in _REPORTS:
            return _json(start_response, "200 OK", _REPORTS[key](sup))
        if key in _ANSWERS:
            return _json(start_response, *_ANSWERS[key](sup))
        if key == ("PUT", READONLY_PATH):
            return _json(start_response, *_with_body(environ, lambda body: set_readonly_switch(sup, body)))
        if any(p == path for _m, p in [*_REPORTS, *_ANSWERS]):
            return _json(start_response, "405 Method Not Allowed", {"error": f"{method} not allowed on {path}"})
        return _json(start_response, "404 Not Found", {"error": f"no route {path}"})

    server = make_server(sup.cfg.bind_address or "0.0.0.0", sup.cfg.http_port, app,
                         server_class=_ThreadingWSGIServer, handler_class=_Quiet)
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
