"""Builds the compiled ring core `_ring` and ships its cimport contract beside it.

A failed compile fails the build. ROUTER_NO_EXTENSIONS=1 skips the extension on purpose:
the package then runs on the pure-Python twin (router/_ring_py.py).
"""

import os
import shutil

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

NO_EXTENSIONS = os.environ.get("ROUTER_NO_EXTENSIONS", "").strip().lower() not in ("", "0", "false", "no")
# Shipped at the top level next to `_ring`, so `cimport _ring` and type checkers find them.
CONTRACT_FILES = ("src/_ring.pxd", "src/_ring.pyi")


class BuildPyWithContract(build_py):
    def run(self) -> None:
        super().run()
        for path in CONTRACT_FILES:
            shutil.copy(path, os.path.join(self.build_lib, os.path.basename(path)))


def extensions() -> list:
    if NO_EXTENSIONS:
        return []
    from Cython.Build import cythonize

    ring = Extension(
        "_ring",
        ["src/_ring.pyx"],
        extra_compile_args=["-O3"],
    )
    return cythonize([ring], compiler_directives={"language_level": "3"})


setup(ext_modules=extensions(), cmdclass={"build_py": BuildPyWithContract})
