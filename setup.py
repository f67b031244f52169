"""Build of the bookkeeper package and its Cython hot path (sources in ext/).

Cython sources mirror the compiled module path (ext/bookkeeper/_ext/*.pyx ->
bookkeeper._ext.*) so cross-module cimports resolve with include_path=["ext"].
"""
from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup

EXTENSIONS = [
    Extension(f"bookkeeper._ext.{name}", [f"ext/bookkeeper/_ext/{name}.pyx"],
              extra_compile_args=["-O2"])
    for name in ("wire", "journal", "client", "entrylog")
]

setup(
    name="bookkeeper-py",
    version="0.1.0",
    description="Apache BookKeeper re-implemented in Python: replicated, durable log storage",
    packages=find_packages(include=["bookkeeper", "bookkeeper.*"]),
    ext_modules=cythonize(EXTENSIONS, include_path=["ext"], language_level=3,
                          compiler_directives={"embedsignature": True}),
    python_requires=">=3.11",
    entry_points={"console_scripts": ["bk = bookkeeper.cli.main:main"]},
)
