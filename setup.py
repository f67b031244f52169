"""The Cython extensions of bookkeeper-py (everything else is in pyproject.toml).

Cython sources mirror the compiled module path (ext/bookkeeper/_ext/*.pyx ->
bookkeeper._ext.*) so cross-module cimports resolve with include_path=["ext"].

`uring` cimports python-liburing (its .pxd files and liburing's headers ship in its
package): a build dependency as well as a runtime one (pyproject.toml).

Reproducible: the compiler records the directories it built in (the checkout, and pip's
isolated build environment, a new random path per build, where liburing's headers live) in
the debug info. They are mapped to fixed names, so two builds of one commit give the same
bytes wherever they run; the Ansible role relies on that to restart a bookie only when its
package really changed.
"""
from pathlib import Path

import liburing
from Cython.Build import cythonize
from setuptools import Extension, setup

# liburing's .pxd include '../include/liburing.h', relative to its lib/ directory.
LIBURING_LIB = str(Path(liburing.__file__).parent / "lib")
PREFIX_MAPS = [f"-ffile-prefix-map={Path(liburing.__file__).parent}=liburing",
               f"-ffile-prefix-map={Path.cwd()}=."]

EXTENSIONS = [
    Extension(f"bookkeeper._ext.{name}", [f"ext/bookkeeper/_ext/{name}.pyx"],
              extra_compile_args=["-O2", *PREFIX_MAPS],
              include_dirs=[LIBURING_LIB] if name == "uring" else [])
    for name in ("wire", "journal", "client", "entrylog", "shardpath", "uring")
]

setup(
    ext_modules=cythonize(EXTENSIONS, include_path=["ext"], language_level=3,
                          compiler_directives={"embedsignature": True}),
)
