"""Builds the compiled cores `_ring`, `_prefix`, `_kvwire`, `_kvshare`, `_held` and `_timers` and ships their cimport contracts and stubs beside them.

A failed compile fails the build. ROUTER_NO_EXTENSIONS=1 skips the extensions on purpose:
the package then runs on the pure-Python twins (router/_ring_py.py, router/_prefix_py.py,
router/_kvwire_py.py, router/_kvshare_py.py, router/_held_py.py, router/_timers_py.py).
"""

import os
import shutil

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

NO_EXTENSIONS = os.environ.get("ROUTER_NO_EXTENSIONS", "").strip().lower() not in ("", "0", "false", "no")
# Shipped at the top level next to the modules, so `cimport _ring`, `cimport _prefix` and type
# checkers find them (`_prefix` cimports `_ring`; `_kvwire`, `_kvshare`, `_held` and `_timers` have stubs only: nothing
# cimports them). src/_aged.pxd is inline code `_prefix` and `_kvshare` share at build time: not shipped.
CONTRACT_FILES = ("src/_ring.pxd", "src/_ring.pyi", "src/_prefix.pxd", "src/_prefix.pyi", "src/_kvwire.pyi", "src/_kvshare.pyi", "src/_held.pyi", "src/_timers.pyi")

# the modules are translated (Cython) and compiled (the C compiler) on every core at once, eight at most
JOBS = max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 8))


class BuildPyWithContract(build_py):
    def run(self) -> None:
        super().run()
        for path in CONTRACT_FILES:
            shutil.copy(path, os.path.join(self.build_lib, os.path.basename(path)))


def extensions() -> list:
    if NO_EXTENSIONS:
        return []
    from Cython.Build import cythonize  # noqa: PLC0415 -- needed only when building the extensions

    names = ("_ring", "_prefix", "_kvwire", "_kvshare", "_held", "_timers")
    modules = [Extension(name, [f"src/{name}.pyx"], extra_compile_args=["-O3"]) for name in names]
    return cythonize(modules, include_path=["src"], compiler_directives={"language_level": "3"}, nthreads=JOBS)


setup(
    ext_modules=extensions(),
    cmdclass={"build_py": BuildPyWithContract},
    options={"build_ext": {"parallel": JOBS}},
)
