"""The fuzz targets in `make test` (tests/fuzz/README.md): every corpus file replayed through
its target, every target fuzzed for a few seconds under atheris, and the proof that the
harness can fail: with the frame-length check switched off (BK_FUZZ_NO_LENGTH_CHECK=1, a
test-only switch of ext/bookkeeper/_ext/wire.pyx) the frame decoder's target finds the
over-read within 60 s.

The fuzzing runs are subprocesses (atheris exits its process when done), all started at
once by one fixture and each awaited by its own test: the module's wall time is about the
longest run, not their sum. They use the normal build; `make fuzz` runs them longer on a
build with ASan and UBSan.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import CORPUS, FUZZ_DIR, REPO, fuzz_command, load_target, summarize, target_names  # noqa: E402

FUZZ_SECONDS = 3
PROOF_SECONDS = 60
TARGETS = target_names()

def _regressions() -> list[str]:
    """corpus/<target>/<file> names of the inputs that once crashed (all but the seeds)."""
    return sorted(f"{p.parent.name}/{p.name}" for p in CORPUS.glob("*/*") if not p.name.startswith("seed-"))


@pytest.fixture(scope="module", autouse=True)
def _close_targets() -> Iterator[None]:
    """Targets that hold resources in this process (add_path's shard) are closed at the end."""
    yield
    for name in TARGETS:
        close = getattr(load_target(name), "close", None)
        if close is not None:
            close()


@pytest.mark.parametrize("target", TARGETS)
def test_every_seed_passes_its_target(target: str) -> None:
    """The seeds are what the real encoders make: each passes, so a failure here is the
    harness's or the encoders' (tests/fuzz/run.py --seed rewrites them)."""
    module = load_target(target)
    seeds = sorted((CORPUS / target).glob("seed-*"))
    assert seeds, f"no seeds in {CORPUS / target}: run tests/fuzz/run.py --seed"
    for path in seeds:
        module.one_input(path.read_bytes())


@pytest.mark.parametrize("name", _regressions())
def test_crash_found_once_stays_fixed(name: str) -> None:
    """Every input a fuzzer once crashed on (corpus/<target>/crash-*) is replayed for good."""
    target, _ = name.split("/")
    load_target(target).one_input((CORPUS / name).read_bytes())


@dataclass
class _Run:
    proc: subprocess.Popen
    log: Path
    artifacts: Path

    def finish(self, timeout_s: float) -> tuple[int, str, float | None, str | None]:
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            rc = self.proc.wait()
        output = self.log.read_text(errors="replace")
        return (rc, output, *summarize(output))

    def stop(self) -> None:
        """Kill the run and the process fuzzing under it (its own session)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _start(name: str, seconds: int, tmp: Path, env: dict[str, str]) -> _Run:
    scratch, artifacts = tmp / f"{name}-corpus", tmp / f"{name}-crashes"
    scratch.mkdir()
    artifacts.mkdir()
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        # The per-input bound past the test's own wait (fuzz_command says why); the runs' own
        # temporary files under tmp, which pytest removes, whatever ends them.
        proc = subprocess.Popen(fuzz_command(name, seconds, scratch, artifacts, None, input_timeout_s=600),
                                cwd=REPO, env={**env, "TMPDIR": str(tmp)}, start_new_session=True,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return _Run(proc, log, artifacts)


@pytest.fixture(scope="module")
def fuzz_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, _Run]]:
    """Every target fuzzed for FUZZ_SECONDS, and the proof run, started together."""
    tmp = tmp_path_factory.mktemp("fuzz")
    env = {k: v for k, v in os.environ.items() if k != "BK_FUZZ_NO_LENGTH_CHECK"}
    runs = {name: _start(name, FUZZ_SECONDS, tmp, env) for name in TARGETS}
    (tmp / "proof").mkdir()
    runs["proof"] = _start("parse_requests", PROOF_SECONDS, tmp / "proof", {**env, "BK_FUZZ_NO_LENGTH_CHECK": "1"})
    try:
        yield runs
    finally:
        for run in runs.values():
            run.stop()


@pytest.mark.parametrize("target", TARGETS)
def test_fuzzing_finds_no_crash(target: str, fuzz_runs: dict[str, _Run]) -> None:
    """A few seconds of atheris per target: a crash fails the test with its reproducer."""
    rc, output, rate, crash = fuzz_runs[target].finish(timeout_s=FUZZ_SECONDS + 120)
    print(f"{target}: {rate} executions/s")
    assert rc == 0 and crash is None, f"{target} crashed (exit {rc}); reproducer: {crash}\n{output[-4000:]}"
    assert rate is not None, f"{target}: no libFuzzer summary\n{output[-4000:]}"


def test_fuzzer_finds_the_over_read_with_the_frame_length_check_off(fuzz_runs: dict[str, _Run]) -> None:
    """Proof the harness can fail: with the frame-length check off, a frame shorter than its
    header is parsed past its end; the parse_requests target must find that within 60 s, and
    the input it found must be one the real decoder refuses cleanly."""
    rc, output, rate, crash = fuzz_runs["proof"].finish(timeout_s=PROOF_SECONDS + 120)
    assert rc != 0 and crash is not None, f"no crash found in {PROOF_SECONDS} s (exit {rc})\n{output[-4000:]}"
    assert "Negative size" in output or "AddressSanitizer" in output or "AssertionError" in output, output[-4000:]
    load_target("parse_requests").one_input(Path(crash).read_bytes())  # the switch is off in this process
    print(f"proof: crash found at {rate} executions/s: {crash}")


def test_the_length_check_switch_is_off_unless_asked() -> None:
    """The test-only switch is read from the environment at import, and off by default."""
    from bookkeeper._ext import wire
    assert wire.LENGTH_CHECK == (os.environ.get("BK_FUZZ_NO_LENGTH_CHECK") != "1")
    code = "from bookkeeper._ext import wire; print(wire.LENGTH_CHECK)"
    on = subprocess.run([sys.executable, "-c", code], env={**os.environ, "BK_FUZZ_NO_LENGTH_CHECK": "1"},
                        capture_output=True, text=True, check=True, cwd=FUZZ_DIR)
    assert on.stdout.strip() == "False"
