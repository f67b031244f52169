"""`bk bench` runs and prints one JSON object with the keys docs/api.md fixes (figures are printed,
never asserted: timing goals live in docs/performance.md, not in tests). Runs are a second or
two: a bench keeps both cores busy for as long as it measures, and these tests check what it
prints, not the figures."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.runtime(140)

REPO = Path(__file__).resolve().parents[1]


def bench(*args: str, tmp: Path) -> dict:
    p = subprocess.run([sys.executable, "-m", "bookkeeper.cli.main", "bench", *args, "--json", "--dir", str(tmp)],
                       cwd=REPO, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert {"ops_per_s", "mb_per_s", "latency_ms", "results"} <= doc.keys()
    assert set(doc["latency_ms"]) == {"p50", "p99", "p999"}
    assert doc["ops_per_s"] > 0
    print(json.dumps({k: doc[k] for k in ("name", "ops_per_s", "mb_per_s", "latency_ms")}))
    return doc


def test_bench_limits_and_journal_print_json(tmp_path: Path) -> None:
    limits = bench("limits", "--seconds", "1", tmp=tmp_path)
    assert len(limits["results"]) == 4
    journal = bench("journal", "--seconds", "1", "--size", "100", "--sync", "thread", tmp=tmp_path)
    assert journal["results"][0]["sync"] == "thread" and journal["results"][0]["entries_per_fsync"] >= 1


def test_bench_bookie_in_shard_reports_each_shard(tmp_path: Path) -> None:
    """--in-shard drives each pinned shard's storage path with no network; one figure per shard."""
    doc = bench("bookie", "--in-shard", "--shards", "2", "--window", "200", "--seconds", "1", tmp=tmp_path)
    assert len(doc["per_shard_ops_per_s"]) == 2 and all(x > 0 for x in doc["per_shard_ops_per_s"])
    assert not list(tmp_path.iterdir()), "bench leaves no data behind"


@pytest.mark.parametrize("args", [["bookie", "--shards", "1", "--window", "50"], ["cluster", "--window", "50"],
                                  ["read", "--entries", "2000"]], ids=["bookie", "cluster", "read"])
def test_bench_over_real_bookies_prints_json_and_rss(tmp_path: Path, args: list[str]) -> None:
    doc = bench(*args, "--seconds", "1.5", tmp=tmp_path)
    assert any("shard" in k for k in doc["peak_rss_mb"])
    assert not list(tmp_path.iterdir()), "bench leaves no data behind"


def test_bench_client_reports_cpu_per_add_for_both_quorum_configs(tmp_path: Path) -> None:
    """`bench client` measures a write handle against in-process echo bookies: one figure per
    E/Qw/Qa configuration, each with the client's CPU per add, and every add acknowledged."""
    doc = bench("client", "--seconds", "1", "--window", "50", tmp=tmp_path)
    names = [r["name"] for r in doc["results"]]
    assert [n.split()[1] for n in names] == ["1/1/1", "3/2/2"]
    assert all(r["ops_per_s"] > 0 and r["cpu_us_per_add"] > 0 for r in doc["results"])


@pytest.mark.parametrize("driver", ["callback", "batch"])
def test_bench_client_drives_the_handle_by_callbacks_or_batches(tmp_path: Path, driver: str) -> None:
    """`bench client --driver callback|batch`: the same two configurations through add_entry_callback
    or add_entries_async; `--driver raw` is refused (it drives no write handle)."""
    doc = bench("client", "--seconds", "1", "--window", "50", "--driver", driver, tmp=tmp_path)
    assert [r["driver"] for r in doc["results"]] == [driver, driver]
    assert all(r["ops_per_s"] > 0 and r["cpu_us_per_add"] > 0 for r in doc["results"])


def test_bench_client_refuses_the_raw_driver(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "bookkeeper.cli.main", "bench", "client", "--driver", "raw",
                        "--dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "applies to bench bookie only" in p.stderr and "Traceback" not in p.stderr


def test_bench_stream_reports_records_and_the_ratio_to_a_ledger(tmp_path: Path) -> None:
    """`bench stream`: the stream row first (records/s), then the ledger phase of the same run,
    and the ratio between them."""
    doc = bench("stream", "--seconds", "1", "--batch", "200", tmp=tmp_path)
    stream, ledger = doc["results"]
    assert stream["name"].startswith("stream 3/2/2") and ledger["name"].startswith("ledger 3/2/2")
    assert abs(stream["ratio_to_cluster"] - stream["ops_per_s"] / ledger["ops_per_s"]) < 0.01
    assert not list(tmp_path.iterdir()), "bench leaves no data behind"


def test_bench_spark_reads_the_same_ledgers_with_spark_and_the_client(tmp_path: Path) -> None:
    """`bench spark` (scaled down): a Spark row and a client row per entry size, Spark's checked
    against the client's row and byte counts inside the bench, with the ratio."""
    doc = bench("spark", "--scale", "0.02", tmp=tmp_path)
    names = [r["name"] for r in doc["results"]]
    assert [n.split()[0] for n in names] == ["spark", "client"] * 3
    spark_rows = doc["results"][0::2]
    assert [r["entry_bytes"] for r in spark_rows] == [100, 4096, 65536]
    assert all(r["ratio_to_client"] > 0 and r["rows"] > 0 for r in spark_rows)
    assert not list(tmp_path.iterdir()), "bench leaves no data behind"


def test_closed_loop_ends_with_the_error_of_a_sender_that_raises() -> None:
    """A sender that raises (e.g. at the outstanding bound) ends the run with its error instead
    of leaving the loop waiting for completions that will never come."""
    import asyncio

    import uvloop

    from bookkeeper.bench import histogram
    from bookkeeper.bench.cluster import closed_loop

    class Sender:
        def __init__(self, fail_after: int) -> None:
            self.sent, self.fail_after = 0, fail_after

        def start(self, on_done) -> None:  # noqa: ANN001
            self.on_done = on_done

        def send(self, data: bytes, t: float) -> None:
            if self.sent == self.fail_after:
                raise RuntimeError(f"refused after {self.sent}")
            self.sent += 1
            asyncio.get_running_loop().call_soon(self.on_done, t, self.sent - 1, None)

    for fail_after in (0, 2, 50):  # at once, among the first window, and later in the run
        with pytest.raises(RuntimeError, match=f"refused after {fail_after}"):
            uvloop.run(asyncio.wait_for(closed_loop([Sender(fail_after)], b"x", 30.0, 4, histogram()), 10))


LEDGERS_PHASES = ["create", "first add", "write", "write + creates", "close", "recovery open", "open", "delete",
                  "delete under load"]


def test_bench_ledgers_reports_every_phase_at_each_count(tmp_path: Path) -> None:
    """`bench ledgers` at two small counts: a row per phase and count with a rate and the CPU
    each process spent per op, the per-count figures (memory, znodes, idle CPU, the idle GC
    pass) and the --metadata figures. A figure not measured (RSS per ledger below 1,000
    ledgers) is null, never missing; the rest are numbers, and
    the rates and per-ledger costs positive ones."""
    doc = bench("ledgers", "--ledgers", "10,50", "--seconds", "1", "--metadata", "1000", tmp=tmp_path)
    assert doc["bench"] == "ledgers"
    assert [(r["ledgers"], r["phase"]) for r in doc["results"]] == [(n, p) for n in (10, 50) for p in LEDGERS_PHASES]
    for r in doc["results"]:
        assert r["ops_per_s"] > 0 and r["latency_ms"]["p99"] > 0, r
        assert set(r["cpu_us_per_op"]) == {"client", "bookie0", "bookie1", "bookie2", "zookeeper"}
        assert r["cpu_us_per_op"]["client"] > 0 and all(v >= 0 for v in r["cpu_us_per_op"].values()), r
        assert r["zk_requests_per_op"] >= 0 and r["py_gc_us_per_op"] >= 0, r
    rows = {(r["ledgers"], r["phase"]): r for r in doc["results"]}
    for n in (10, 50):
        assert rows[n, "create"]["zk_requests_per_op"] > 0 and rows[n, "write"]["mb_per_s"] > 0
        assert rows[n, "write + creates"]["ratio_to_write"] > 0 and rows[n, "write + creates"]["creates_per_s"] > 0
        delete = rows[n, "delete under load"]
        assert delete["gc_passes"] >= 1 and all(v > 0 for v in delete["add_p99_ms"].values())
        for row in (delete, rows[n, "write"]):  # the shards export them; each a part of the one before
            assert row["loop_lag_max_s"] >= row["loop_stall_max_s"] >= row["loop_blocked_max_s"] > 0, row
        creating = rows[n, "write + creates"]
        assert creating["slices"] == 8 and creating["adds_per_s_without"] > 0
        assert creating["ratio_to_write"] == pytest.approx(creating["ops_per_s"] / creating["adds_per_s_without"], rel=0.01)
        s = doc["per_ledgers"][str(n)]
        assert s["zk_znodes_per_ledger"] >= 1 and s["zk_bytes_per_ledger"] > 0 and s["ledgers_stored"] == 2 * n
        assert s["client_rss_bytes_per_handle"] is None and s["bookie_rss_bytes_per_stored_ledger"] is None  # N < 1000
        assert set(s["idle"]["cpu_percent"]) == set(rows[n, "create"]["cpu_us_per_op"])
        assert s["idle"]["gc"]["duration_s"] >= 0 and "zk_reads" in s["idle"]["gc"]
    md = doc["metadata"]
    assert md["ledgers"] == 1000 and md["populate_per_s"] > 0 and md["zk_bytes_per_ledger"] > 0
    assert md["list"]["lines"] >= 1000 and md["list"]["first_line_s"] > 0 and md["list"]["peak_rss_mb"] > 0
    assert md["gc_after"]["duration_s"] >= 0
    assert not list(tmp_path.iterdir()), "bench leaves no data behind"


def test_bench_ledgers_reads_the_loop_histograms_over_a_phase_and_else_none() -> None:
    """The shards' loop lag, stall and blocked maxima over a phase: each histogram's smallest
    bucket bound that holds every observation made between the phase's two scrapes; None
    when nothing was observed meanwhile, or when the bookies do not export it (n/a)."""
    from bookkeeper.bench.ledgers import LOOP_FIGURES, loop_maxima, parse_metrics

    def histograms(counts: dict[str, tuple[int, ...]]) -> dict:
        text = ""
        for key, c in counts.items():
            family = LOOP_FIGURES[key]
            text += f"# TYPE {family} histogram\n" + "".join(
                f'{family}_bucket{{le="{le}",shard="0"}} {n}\n' for le, n in zip(("0.01", "0.1", "1.0", "+Inf"), c))
            text += f"{family}_count {c[-1]}\n{family}_sum 0.5\n"
        return parse_metrics(text)

    before = histograms({"loop_lag_max": (5, 5, 5, 5), "loop_stall_max": (5, 5, 5, 5)})
    after = histograms({"loop_lag_max": (7, 8, 9, 9), "loop_stall_max": (5, 5, 5, 5)})
    # 4 new lags, the slowest in (0.1, 1.0]; no stall observed meanwhile; blocked not exported
    assert loop_maxima(before, after) == {"loop_lag_max_s": 1.0, "loop_stall_max_s": None, "loop_blocked_max_s": None}
    other = parse_metrics('# TYPE bookkeeper_ledgers gauge\nbookkeeper_ledgers{shard="0"} 3\n')
    assert set(loop_maxima(other, other).values()) == {None}


def test_bench_neighbour_reports_each_phase_with_the_shards_view(tmp_path: Path) -> None:
    """`bench neighbour`: the bulk peak, then the W=1 writer alone, beside bulk at a rate and
    beside closed-loop bulk; each W=1 row has its max, what the shards measured over the same
    seconds (add p99, journal sync p99, block bytes p99, loop lag) and CPU per process; a bulk
    phase names the rate the bulk writer kept (in its own process, with its own CPU)."""
    doc = bench("neighbour", "--seconds", "4", "--bulk-rate", "500", "--bulk-size", "256", tmp=tmp_path)
    assert doc["bench"] == "neighbour"
    rows = {r["phase"]: r for r in doc["results"]}
    assert list(rows) == ["bulk peak", "alone", "beside bulk at rate", "beside closed-loop bulk"]
    assert rows["bulk peak"]["bulk_adds_per_s"] > 0 and rows["bulk peak"]["bulk_bytes"] == 256
    for phase in ("alone", "beside bulk at rate", "beside closed-loop bulk"):
        r = rows[phase]
        assert r["ops_per_s"] > 0 and r["max_ms"] >= r["latency_ms"]["p99"] > 0
        assert set(r["shards"]) == {"add_p99_ms", "journal_sync_p99_ms", "journal_block_p99_bytes", "loop_lag_max_ms",
                                    "loop_stall_max_ms", "loop_blocked_max_ms"}
        assert r["shards"]["loop_blocked_max_ms"] <= r["shards"]["loop_stall_max_ms"] <= r["shards"]["loop_lag_max_ms"]
        assert 0 <= r["client_loop_blocked_max_ms"] <= r["client_loop_stall_max_ms"] <= r["client_loop_lag_max_ms"]
        assert r["shards"]["add_p99_ms"] > 0 and r["shards"]["journal_block_p99_bytes"] > 0
        assert any(k.startswith("client[") for k in r["cpu_percent"]) and sum(k.count("-shard[") for k in r["cpu_percent"]) == 3
        slow = r["slow_adds"]  # the bookies' add trace joined with the writer's own times
        assert slow["adds"] > 0 and slow["dropped"] == 0
        assert 0.9 * slow["adds"] <= slow["joined"] <= slow["adds"] and slow["slow"] >= 1
        for means in (slow["slow_mean_ms"], slow["all_mean_ms"], slow["slowest_ms"]):
            assert list(means) == ["to_shard", "queued", "sync", "answer", "to_client"]
            assert all(v >= 0 for v in means.values()) and means["sync"] > 0
    assert "bulk_adds_per_s" not in rows["alone"]
    at_rate = rows["beside bulk at rate"]
    assert at_rate["bulk_rate_target"] == 500 and 0 < at_rate["bulk_rate_kept"] <= 1.2 and at_rate["bulk_cpu_percent"] > 0
    assert rows["beside closed-loop bulk"]["bulk_adds_per_s"] > 0
    assert not list(tmp_path.iterdir()), "bench leaves no data behind"


@pytest.mark.parametrize("args, said", [(["--bulk-rate", "-1"], "--bulk-rate must be >= 0"),
                                        (["--bulk-size", "0"], "--bulk-size must be >= 1")])
def test_bench_neighbour_refuses_bad_numbers_before_starting_a_cluster(tmp_path: Path, args: list[str],
                                                                       said: str) -> None:
    p = subprocess.run([sys.executable, "-m", "bookkeeper.cli.main", "bench", "neighbour", *args,
                        "--dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and said in p.stderr and "Traceback" not in p.stderr
    assert not [d for d in tmp_path.rglob("*") if d.is_dir() and "neighbour-" in d.name]


def test_histogram_quantile_reads_bucket_deltas_summed_over_shards() -> None:
    """A histogram's quantile between two scrapes: the observations made between them, every
    shard's series summed; the smallest bucket bound holding that share; None when none."""
    from bookkeeper.bench.ledgers import histogram_quantile, parse_metrics

    name = "bookkeeper_add_entry_latency_seconds"

    def scrape(per_shard: dict[str, tuple[int, ...]]) -> dict:
        text = f"# TYPE {name} histogram\n"
        for shard, counts in per_shard.items():
            text += "".join(f'{name}_bucket{{le="{le}",shard="{shard}"}} {n}\n'
                            for le, n in zip(("0.001", "0.01", "0.1", "+Inf"), counts))
            text += f'{name}_count{{shard="{shard}"}} {counts[-1]}\n{name}_sum{{shard="{shard}"}} 0.1\n'
        return parse_metrics(text)

    before = scrape({"0": (10, 10, 10, 10), "1": (0, 0, 0, 0)})
    after = scrape({"0": (100, 100, 100, 100), "1": (0, 9, 10, 10)})  # 100 new: 90 <= 1 ms, 9 <= 10 ms, 1 <= 100 ms
    assert histogram_quantile(before, after, name, 0.5) == 0.001
    assert histogram_quantile(before, after, name, 0.95) == 0.01
    assert histogram_quantile(before, after, name, 1.0) == 0.1
    assert histogram_quantile(before, before, name, 0.99) is None
