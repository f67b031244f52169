"""Fuzz targets (atheris harnesses), one module per target: tests/fuzz/README.md.

Each module defines `one_input(data: bytes) -> None`, which returns for any input the code
under test must accept or refuse cleanly and raises (an AssertionError naming the broken
property, or the code's own unexpected exception) for a bug, and `seeds() -> list[bytes]`,
valid inputs made by the project's real encoders (tests/fuzz/run.py --seed writes them into
tests/fuzz/corpus/<target>/). tests/fuzz/run.py runs one under atheris; tests/fuzz/test_fuzz.py
replays every corpus file through it in-process and fuzzes it for a few seconds.
"""
