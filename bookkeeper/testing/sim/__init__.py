"""A deterministic simulator of a whole cluster: `bk sim` (docs/simulation.md).

One thread, virtual time, one seed. What runs is production code: the client (`BookKeeper`,
write and read handles, recovery, `RequestPipe` and `AddTracker` in C), the bookie's shard
(`ShardServer`, the C `AddPath`, `Journal`, `LedgerStorage` on real files), and
`ZkMetadataStore`. What is simulated is their world: the event loop's clock (loop.py), the
network (net.py: real frames, split and delayed, partitions, resets), ZooKeeper at the znode
level (zk.py), the journal device (disk.py: latency, EIO, torn unsynced writes), and faults.
The oracle (oracle.py) checks the invariants as frames and acknowledgements happen; a
violation ends the run with its seed, its invariant and the trace's last lines.

`run(seed, ops)` is the whole API: the same seed, ops and commit give the same trace.
"""
from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bookkeeper.meta import ledger_metadata
from bookkeeper.testing.sim.loop import SimLoop, Stuck
from bookkeeper.testing.sim.mutations import MUTATIONS, applied
from bookkeeper.testing.sim.oracle import Violation
from bookkeeper.testing.sim.world import Result, SimConfig, World

__all__ = ["MUTATIONS", "Result", "SimConfig", "Violation", "run"]


@contextlib.contextmanager
def _cheap_passwords() -> Iterator[None]:
    """Password digests at scrypt's least cost: a run creates and opens hundreds of ledgers,
    and each digest at the production cost is 70 ms of CPU that changes no decision."""
    saved = ledger_metadata.SCRYPT_N
    ledger_metadata.SCRYPT_N = 2
    try:
        yield
    finally:
        ledger_metadata.SCRYPT_N = saved


def run(config: SimConfig, *, mutation: str | None = None, trace_file: Path | None = None) -> Result:
    """One simulated run of config (its seed and ops); the trace goes to trace_file if given."""
    with tempfile.TemporaryDirectory(prefix="bk-sim-") as tmp, _cheap_passwords(), applied(mutation):
        loop = SimLoop()
        try:
            world = World(config, loop, Path(tmp), mutation=mutation, keep_trace=trace_file is not None)
            try:
                loop.run_until_complete(world.main())
            except Stuck as e:
                world.oracle.fail("stuck", f"the whole world waits on nothing ({e})")
            except Exception as e:  # noqa: BLE001 - an exception out of the run is a finding with its seed
                world.oracle.fail("unhandled-exception", f"the run failed: {e!r}")
            finally:
                loop.run_until_complete(world.shutdown())
        finally:
            loop.close()
    if trace_file is not None and world.trace.lines is not None:
        trace_file.write_text("\n".join(world.trace.lines) + "\n")
    return world.result()
