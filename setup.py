"""The Cython extensions of bookkeeper-py (everything else is in pyproject.toml).

Cython sources mirror the compiled module path (ext/bookkeeper/_ext/*.pyx ->
bookkeeper._ext.*) so cross-module cimports resolve with include_path=["ext"].

`uring` cimports python-liburing (its .pxd files and liburing's headers ship in its
package): a build dependency as well as a runtime one (pyproject.toml).
"""
from pathlib import Path

import liburing
from Cython.Build import cythonize
from setuptools import Extension, setup

# liburing's .pxd include '../include/liburing.h', relative to its lib/ directory.
LIBURING_LIB = str(Path(liburing.__file__).parent / "lib")

EXTENSIONS = [
    Extension(f"bookkeeper._ext.{name}", [f"ext/bookkeeper/_ext/{name}.pyx"],
              extra_compile_args=["-O2"],
              include_dirs=[LIBURING_LIB] if name == "uring" else [])
    for name in ("wire", "journal", "client", "entrylog", "shardpath", "uring")
]

setup(
    ext_modules=cythonize(EXTENSIONS, include_path=["ext"], language_level=3,
                          compiler_directives={"embedsignature": True}),
)
