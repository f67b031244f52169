"""The Cython extensions of bookkeeper-py (everything else is in pyproject.toml).

Cython sources mirror the compiled module path (ext/bookkeeper/_ext/*.pyx ->
bookkeeper._ext.*) so cross-module cimports resolve with include_path=["ext"].
"""
from Cython.Build import cythonize
from setuptools import Extension, setup

EXTENSIONS = [
    Extension(f"bookkeeper._ext.{name}", [f"ext/bookkeeper/_ext/{name}.pyx"],
              extra_compile_args=["-O2"])
    for name in ("wire", "journal", "client", "entrylog", "shardpath")
]

setup(
    ext_modules=cythonize(EXTENSIONS, include_path=["ext"], language_level=3,
                          compiler_directives={"embedsignature": True}),
)
