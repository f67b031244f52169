"""File primitives the journal and the entry log share (per shard, any thread)."""
from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a directory's entries (a new or renamed file's name) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def zero_fill(path: Path, size: int) -> None:
    """Create (or truncate) path and write `size` zero bytes, durably.

    Why zeros and not fallocate: fallocate leaves unwritten extents, and every later
    fdatasync into them must also commit the extent conversion (docs/performance.md).
    """
    chunk = bytes(min(size, 1 << 20))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = 0
        while off < size:
            off += os.pwrite(fd, chunk[: size - off], off)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace path's content durably and all at once: a crash leaves the old file or the new
    one, never a torn one (a temporary file in the same directory, fsync'd, renamed over it,
    the directory fsync'd)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)
