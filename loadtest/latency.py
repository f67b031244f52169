"""Latency per request name with microsecond resolution (HDR histograms).

Locust's own statistics round every response time under 100 ms to whole
milliseconds, so a 0.4 ms add and a 1.4 ms add are both "1". Each locust process
records every request it fires here as well; workers ship their histograms to the
master with each stats report (encoded, then reset), the master adds them up, and the
process that owns the results writes `<csv prefix>_hdr.csv` beside locust's CSV files.
"""
from __future__ import annotations

import csv
from pathlib import Path

from hdrh.histogram import HdrHistogram

LOWEST_US, HIGHEST_US, SIGNIFICANT_DIGITS = 1, 600_000_000, 3
PERCENTILES = (50.0, 90.0, 99.0, 99.9)


def _histogram() -> HdrHistogram:
    return HdrHistogram(LOWEST_US, HIGHEST_US, SIGNIFICANT_DIGITS)


class LatencyRecorder:
    """HDR histograms keyed by (request type, name)."""

    def __init__(self) -> None:
        self.histograms: dict[tuple[str, str], HdrHistogram] = {}

    def record(self, request_type: str, name: str, response_time_ms: float) -> None:
        key = (request_type, name)
        h = self.histograms.get(key)
        if h is None:
            h = self.histograms[key] = _histogram()
        h.record_value(min(HIGHEST_US, max(LOWEST_US, round(response_time_ms * 1000))))

    def take_encoded(self) -> list[tuple[str, str, str]]:
        """Every histogram encoded for the master, then reset: each value travels once."""
        out = []
        for (rtype, name), h in self.histograms.items():
            if h.get_total_count():
                out.append((rtype, name, h.encode().decode("ascii")))
                h.reset()
        return out

    def add_encoded(self, encoded: list[tuple[str, str, str]]) -> None:
        for rtype, name, blob in encoded:
            key = (rtype, name)
            if key not in self.histograms:
                self.histograms[key] = _histogram()
            self.histograms[key].decode_and_add(blob.encode("ascii"))

    def rows(self) -> list[dict[str, str | int | float]]:
        rows: list[dict[str, str | int | float]] = []
        for (rtype, name), h in sorted(self.histograms.items()):
            row: dict[str, str | int | float] = {"Type": rtype, "Name": name, "Count": h.get_total_count(),
                                                 "Min (ms)": h.get_min_value() / 1000,
                                                 "Mean (ms)": round(h.get_mean_value() / 1000, 4)}
            for p in PERCENTILES:
                row[f"p{p:g} (ms)"] = h.get_value_at_percentile(p) / 1000
            row["Max (ms)"] = h.get_max_value() / 1000
            rows.append(row)
        return rows

    def write_csv(self, path: Path) -> None:
        rows = self.rows()
        if not rows:
            return
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
