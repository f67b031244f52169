"""How `bk` starts Python child processes (shards, harness bookies).

A child runs `python -P -m <module>`: `-P` keeps the current directory off
sys.path, so a `bk` installed from a wheel and started inside a source checkout
imports the installed package (with its compiled extensions) in its children too,
not the checkout's unbuilt tree. sys.executable is the interpreter of the running
`bk`, so children share its environment (venv).
"""
from __future__ import annotations

import sys


def python_command(*args: str) -> list[str]:
    """The argv that runs this interpreter with `args`, cwd not on sys.path."""
    return [sys.executable, "-P", *args]


def module_command(module: str, *args: str) -> list[str]:
    """The argv that runs `module` as __main__ under this interpreter, cwd not on sys.path."""
    return python_command("-m", module, *args)
