"""`_ring` embeds in other Cython code: a probe module cimports it, compiles, and routes keys."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import xxhash

PROBE = Path(__file__).parent / "cimport_probe" / "probe.pyx"


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    try:
        import _ring  # noqa: PLC0415 -- the compiled module may be missing: then the probe skips
    except ImportError:
        pytest.skip("installed without the compiled module (ROUTER_NO_EXTENSIONS at build time)")
    build = tmp_path_factory.mktemp("probe")
    shutil.copy(PROBE, build / "probe.pyx")
    include = os.path.dirname(_ring.__file__)
    assert os.path.exists(os.path.join(include, "_ring.pxd")), "the installed package must ship _ring.pxd"
    (build / "setup_probe.py").write_text(
        textwrap.dedent(f"""
        from setuptools import setup, Extension
        from Cython.Build import cythonize
        setup(ext_modules=cythonize([Extension("probe", ["probe.pyx"])], include_path=[{include!r}],
                                    compiler_directives={{"language_level": "3"}}))
    """)
    )
    subprocess.run(
        [sys.executable, "setup_probe.py", "build_ext", "--inplace"],
        cwd=build,
        check=True,
        capture_output=True,
    )
    built = next(build.glob("probe*.so"))
    spec = importlib.util.spec_from_file_location("probe", built)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_probe_routes_like_the_python_api(probe: ModuleType) -> None:
    import _ring  # noqa: PLC0415 -- the compiled module may be missing (the probe fixture skips first)

    ring = _ring.Ring([f"replica-{i}" for i in range(20)], 128, 77)
    keys = [f"session-{i}".encode() for i in range(3000)]
    assert probe.route_all(ring, keys) == list(ring.lookup_many(keys))
    ring.set_available(4, False)  # the probe reads whatever snapshot is current
    assert probe.route_all(ring, keys) == list(ring.lookup_many(keys))
    assert probe.snapshot_points(ring) == (19 * 128, 19, 20)


def test_probe_bounded_and_excluding_walks(probe: ModuleType) -> None:
    import _ring  # noqa: PLC0415 -- the compiled module may be missing (the probe fixture skips first)

    ring = _ring.Ring([f"r{i}" for i in range(6)], 32)
    loads = [3, 0, 9, 1, 0, 4]
    for i in range(500):
        key = f"k{i}".encode()
        assert probe.route_bounded(ring, key, loads, 1.25) == ring.lookup_bounded(key, loads, 1.25)
        flags = bytes([1, 0, 1, 0, 0, 1])
        assert probe.route_excluding(ring, key, flags) == ring.lookup_excluding(key, [0, 2, 5])


def test_probe_hashes_like_xxhash(probe: ModuleType) -> None:
    import _ring  # noqa: PLC0415 -- the compiled module may be missing (the probe fixture skips first)

    for seed in (0, 5, (1 << 64) - 1):
        ring = _ring.Ring(["a"], 1, seed)
        for n in (0, 3, 8, 16, 100, 200, 241, 5000):
            data = bytes(range(256)) * 20
            assert probe.hash_bytes(data[:n], seed, ring) == xxhash.xxh3_64_intdigest(data[:n], seed)
