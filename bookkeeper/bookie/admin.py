"""The bookie's admin HTTP (`http_port`): heartbeat, Prometheus metrics of every shard, state,
info, garbage collection and auto-recovery status (Reference: Apache BookKeeper's HTTP admin).

Lives in: the supervisor process, a threaded WSGI server on daemon threads (a GC an
operator waits on must not hold up a scrape). Routes (docs/api.md section 10):
  GET  /heartbeat                     "OK"
  GET  /metrics                       Prometheus text: every shard's metrics labelled shard,
                                      the bookie's own (state, disks, shards up, restarts)
  GET  /api/v1/bookie/state           {"state", "reason", "shards": [{"index", "state", "reason"}]}
  GET  /api/v1/bookie/info            {"bookie_id", "ledgers", "dirs": [{"path", "kind", "total_bytes",
                                      "free_bytes", "usage", "full"}]}
  POST /api/v1/bookie/gc              runs a GC pass on every shard, waits, returns the sums
  GET  /api/v1/autorecovery/status    the embedded auto-recovery's status (404 if not running)
"""
from __future__ import annotations

import json
import socketserver
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from bookkeeper.bookie.metrics import PREFIX, families
from bookkeeper.bookie.state import READONLY, disk_usage

if TYPE_CHECKING:
    from bookkeeper.bookie.supervisor import Supervisor

GC_TIMEOUT_S = 3600.0
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
    shards = sup.shard_call({"op": "stats"}, timeout_s=2.0)
    dirs = []
    for d in sup.dirs:
        total, free, used = disk_usage(d.path)
        dirs.append({"path": d.path, "kind": d.kind, "total_bytes": total, "free_bytes": free,
                     "usage": round(used, 4), "full": d.full})
    return {"bookie_id": sup.cfg.id, "ledgers": sum(s["gauges"]["ledgers"] for s in shards.values()),
            "dirs": dirs}


def run_gc(sup: Supervisor) -> dict[str, Any]:
    """A forced GC pass on every shard at once; the sums plus each shard's own result."""
    results = sup.shard_call({"op": "gc", "force": True}, timeout_s=GC_TIMEOUT_S)
    out: dict[str, Any] = {k: sum(r.get(k, 0) for r in results.values()) for k in _GC_SUMS}
    out["duration_s"] = max((r.get("duration_s", 0.0) for r in results.values()), default=0.0)
    out["shards"] = [results[i] for i in sorted(results)]
    out["shards_failed"] = sorted(set(sup.procs) - set(results))
    return out


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
        routes = {("GET", "/api/v1/bookie/state"): state_report, ("GET", "/api/v1/bookie/info"): info_report,
                  ("POST", "/api/v1/bookie/gc"): run_gc, ("PUT", "/api/v1/bookie/gc"): run_gc}
        if (method, path) in routes:
            return _json(start_response, "200 OK", routes[(method, path)](sup))
        if path == "/api/v1/autorecovery/status":
            if sup.autorecovery is None:
                return _json(start_response, "404 Not Found", {"error": "auto-recovery does not run in this bookie"})
            return _json(start_response, "200 OK", sup.autorecovery.status())
        if any(p == path for _m, p in routes):
            return _json(start_response, "405 Method Not Allowed", {"error": f"{method} not allowed on {path}"})
        return _json(start_response, "404 Not Found", {"error": f"no route {path}"})

    server = make_server(sup.cfg.bind_address or "0.0.0.0", sup.cfg.http_port, app,
                         server_class=_ThreadingWSGIServer, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, daemon=True, name="admin-http").start()
    return server


def _reply(start_response: Any, status: str, body: bytes, ctype: str) -> list[bytes]:
    start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(body)))])
    return [body]


def _json(start_response: Any, status: str, obj: Any) -> list[bytes]:
    return _reply(start_response, status, json.dumps(obj).encode() + b"\n", "application/json")
