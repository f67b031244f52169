"""Run the fuzz targets of tests/fuzz/targets under atheris (libFuzzer for Python).

    python tests/fuzz/run.py TARGET [--sanitized DIR] [libFuzzer flags and corpus dirs...]
        one target, as atheris.Fuzz runs it: until a crash, or a flag such as
        -max_total_time=N or -runs=N stops it
    python tests/fuzz/run.py --all --seconds N [--sanitized DIR]
        every target for N seconds each (`make fuzz`): new coverage goes to a scratch
        corpus, crashes into tests/fuzz/corpus/<target>/ as regression files; prints
        executions per second and crashes per target; exits 1 if any target crashed
    python tests/fuzz/run.py --seed
        (re)writes the seed corpora: each target's seeds(), made by the real encoders

--sanitized DIR: import the Cython modules (bookkeeper._ext.*) from DIR, a build made with
clang -fsanitize=address,undefined,fuzzer-no-link (`make fuzz` builds build/fuzz); the
fuzzing process then runs with atheris's asan_with_fuzzer.so preloaded and
PYTHONMALLOC=malloc, so that an over-read of a small bytes object is seen by ASan rather than
hidden inside pymalloc's arenas.

A run is two processes: this one, which owns a temporary directory (TMPDIR of the other) and
removes it at the end, and the one atheris fuzzes in (libFuzzer ends it with C's exit(): no
Python clean-up runs there).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

FUZZ_DIR = Path(__file__).resolve().parent
CORPUS = FUZZ_DIR / "corpus"
REPO = FUZZ_DIR.parents[1]
EXT_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def target_names() -> list[str]:
    return sorted(p.stem for p in (FUZZ_DIR / "targets").glob("[a-z]*.py"))


class _SanitizedExtensions(importlib.abc.MetaPathFinder):
    """Finds bookkeeper._ext.* in a separate build directory, before the normal build."""

    def __init__(self, root: Path) -> None:
        self.root = root / "bookkeeper" / "_ext"

    def find_spec(self, name: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if not name.startswith("bookkeeper._ext."):
            return None
        so = self.root / (name.rsplit(".", 1)[1] + EXT_SUFFIX)
        return importlib.util.spec_from_file_location(name, so) if so.exists() else None


def load_target(name: str, *, instrument: bool = False, sanitized: Path | None = None) -> ModuleType:
    """The target module; with instrument, the project's Python code it imports is
    instrumented for atheris's coverage feedback."""
    if str(FUZZ_DIR) not in sys.path:
        sys.path.insert(0, str(FUZZ_DIR))
    if sanitized is not None:
        sys.meta_path.insert(0, _SanitizedExtensions(sanitized))
    if not instrument:
        return importlib.import_module(f"targets.{name}")
    import atheris
    with atheris.instrument_imports(include=["bookkeeper", "targets"]):
        return importlib.import_module(f"targets.{name}")


def fuzz(name: str, sanitized: Path | None, libfuzzer_args: list[str]) -> int:
    """Fuzz in a child process whose temporary files (the targets' shards, logs, keys) all go
    to one directory removed here after it: libFuzzer ends its process with C's exit(), so a
    target's own clean-up never runs. Returns the child's exit status."""
    with tempfile.TemporaryDirectory(prefix=f"fuzz-{name}-") as tmp:
        env = {**sanitizer_env(sanitized), "TMPDIR": tmp}
        cmd = [sys.executable, str(FUZZ_DIR / "run.py"), name, "--child"]
        if sanitized is not None:
            cmd += ["--sanitized", str(sanitized)]
        return subprocess.run(cmd + libfuzzer_args, env=env, stdin=subprocess.DEVNULL).returncode


def fuzz_here(name: str, sanitized: Path | None, libfuzzer_args: list[str]) -> None:
    """atheris in this process: it never returns (libFuzzer exits when done or on a crash)."""
    import atheris
    module = load_target(name, instrument=True, sanitized=sanitized)
    atheris.Setup([sys.argv[0], *libfuzzer_args], module.one_input)
    atheris.Fuzz()


def write_seeds() -> None:
    for name in target_names():
        out = CORPUS / name
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("seed-*"):
            old.unlink()
        for data in load_target(name).seeds():
            (out / f"seed-{hashlib.sha1(data).hexdigest()[:12]}").write_bytes(data)


def sanitizer_env(sanitized: Path | None) -> dict[str, str]:
    """The environment of the fuzzing child: with a sanitized build, ASan's runtime (atheris's,
    which carries libFuzzer and UBSan's handlers) preloaded, and every allocation through malloc."""
    env = dict(os.environ)
    if sanitized is not None:
        import atheris
        env["LD_PRELOAD"] = str(Path(atheris.path()) / "asan_with_fuzzer.so")
        env["PYTHONMALLOC"] = "malloc"
        # Python never frees some of its memory on exit: not a finding. A UBSan report aborts.
        env["ASAN_OPTIONS"] = "detect_leaks=0:allocator_may_return_null=1"
        env["UBSAN_OPTIONS"] = "halt_on_error=1:abort_on_error=1:print_stacktrace=1"
    return env


def fuzz_command(name: str, seconds: int, scratch: Path, artifacts: Path, sanitized: Path | None, *,
                 input_timeout_s: int = 60) -> list[str]:
    """A bounded run from the target's seeds, copied into scratch, where libFuzzer adds what it
    finds; a crash is written under artifacts. The corpus's crash-* files are not given to it:
    libFuzzer would stop at the first one (each is replayed by tests/fuzz/test_fuzz.py).
    input_timeout_s: one input running longer is a crash. atheris checks it on a timer of
    half that period, which also fires while a crash is being written: on a loaded machine
    a short one killed runs (SIGALRM) before their crash input was saved."""
    for seed in (CORPUS / name).glob("seed-*"):
        shutil.copy(seed, scratch)
    cmd = [sys.executable, str(FUZZ_DIR / "run.py"), name]
    if sanitized is not None:
        cmd += ["--sanitized", str(sanitized)]
    return cmd + [f"-max_total_time={seconds}", "-rss_limit_mb=2048", f"-timeout={input_timeout_s}",
                  "-print_final_stats=1", f"-artifact_prefix={artifacts}/", str(scratch)]


_RUNS = re.compile(r"Done (\d+) runs in (\d+) second")
_CRASH = re.compile(r"Test unit written to (\S+)")


def summarize(output: str) -> tuple[float | None, str | None]:
    """(executions per second, path of the crash input or None) from libFuzzer's output."""
    runs = _RUNS.search(output)
    crash = _CRASH.search(output)
    rate = int(runs.group(1)) / max(1, int(runs.group(2))) if runs else None
    return rate, crash.group(1) if crash else None


def fuzz_all(seconds: int, sanitized: Path | None) -> int:
    crashed = 0
    print(f"{'target':<18} {'exec/s':>8}  crash")
    for name in target_names():
        with tempfile.TemporaryDirectory(prefix=f"fuzz-{name}-") as scratch:
            t0 = time.monotonic()
            proc = subprocess.run(fuzz_command(name, seconds, Path(scratch), CORPUS / name, sanitized),
                                  capture_output=True, text=True, timeout=seconds + 300, cwd=REPO,
                                  stdin=subprocess.DEVNULL)
        rate, crash = summarize(proc.stdout + proc.stderr)
        if proc.returncode != 0 and crash is None:
            print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
            crash = f"(exit {proc.returncode}, no input written)"
        crashed += crash is not None
        shown = f"{rate:8.0f}" if rate is not None else f"{'?':>8}"
        print(f"{name:<18} {shown}  {crash or '-'}   ({time.monotonic() - t0:.0f} s)", flush=True)
        if crash:
            print(proc.stderr[-4000:], file=sys.stderr)
    return 1 if crashed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", nargs="?", choices=target_names())
    parser.add_argument("--all", action="store_true")
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--seed", action="store_true")
    parser.add_argument("--sanitized", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.seed:
        write_seeds()
        return 0
    if args.all:
        return fuzz_all(args.seconds, args.sanitized)
    if args.target is None:
        parser.error("a target, --all or --seed")
    if args.child:
        fuzz_here(args.target, args.sanitized, rest)
    return fuzz(args.target, args.sanitized, rest)


if __name__ == "__main__":
    sys.exit(main())
