"""`_ring` and `_prefix` embed in other Cython code: probes cimport them, compile, route keys, match prompts."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from array import array
from pathlib import Path
from types import ModuleType

import pytest
import xxhash

# its subject is a build that embeds the compiled core, not which ring the router loads: CI runs it
# on the compiled pass only (pyproject.toml's one_pass marker)
pytestmark = pytest.mark.one_pass

PROBES = Path(__file__).parent / "cimport_probe"


def load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModuleType]:
    """Both probe modules, compiled in one build against the installed contracts."""
    try:
        import _prefix  # noqa: PLC0415 -- the compiled modules may be missing: then the probes skip
        import _ring  # noqa: PLC0415
    except ImportError:
        pytest.skip("installed without the compiled module (ROUTER_NO_EXTENSIONS at build time)")
    build = tmp_path_factory.mktemp("probe")
    for name in ("probe", "prefix_probe"):
        shutil.copy(PROBES / f"{name}.pyx", build / f"{name}.pyx")
    include = os.path.dirname(_ring.__file__)
    assert os.path.exists(os.path.join(include, "_ring.pxd")), "the installed package must ship _ring.pxd"
    assert os.path.dirname(_prefix.__file__) == include, "_prefix must sit beside the _ring it cimports"
    assert os.path.exists(os.path.join(include, "_prefix.pxd")), "the installed package must ship _prefix.pxd"
    (build / "setup_probe.py").write_text(
        textwrap.dedent(f"""
        from setuptools import setup, Extension
        from Cython.Build import cythonize
        modules = [Extension(name, [name + ".pyx"]) for name in ("probe", "prefix_probe")]
        setup(ext_modules=cythonize(modules, include_path=[{include!r}],
                                    compiler_directives={{"language_level": "3"}}))
    """)
    )
    subprocess.run(
        [sys.executable, "setup_probe.py", "build_ext", "--inplace"],
        cwd=build,
        check=True,
        capture_output=True,
    )
    return {name: load(next(build.glob(f"{name}.*.so")), name) for name in ("probe", "prefix_probe")}


@pytest.fixture(scope="module")
def probe(probes: dict[str, ModuleType]) -> ModuleType:
    return probes["probe"]


@pytest.fixture(scope="module")
def prefix_probe(probes: dict[str, ModuleType]) -> ModuleType:
    return probes["prefix_probe"]


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


def test_prefix_probe_matches_like_the_python_api(prefix_probe: ModuleType) -> None:
    import _prefix  # noqa: PLC0415 -- the compiled module may be missing (the probes fixture skips first)

    index = _prefix.PrefixIndex()
    for cap in (100, 100, 5):
        index.add_holder(cap)
    system = b"You are a careful assistant. " * 8
    first, second = system + b"user: hello there, how are you", system + b"user: what is a KV cache?"
    assert prefix_probe.send_and_match(index, first, 16, 3, 0) == (len(first) // 16, [len(first) // 16, 0, 0])
    added, matched = prefix_probe.send_and_match(index, second, 16, 3, 2)
    chain = _prefix.block_chain(second, 16, 3)
    assert added == len(chain) and matched == [index.match(h, chain) for h in range(3)]
    assert matched[0] == len(system) // 16 and matched[2] == 5
    assert prefix_probe.match(index, 0, chain) == index.match(0, chain)
    assert prefix_probe.match(index, 1, _prefix.block_chain(b"", 16)) == 0
    index.remove_holder(1)
    assert prefix_probe.match(index, 1, chain) == prefix_probe.match(index, 7, chain) == prefix_probe.no_holder()
    assert prefix_probe.truncate_and_evict(index, 0, chain, 4, 2) == (len(system) // 16 - 4, 2)
    assert index.size(0) == len(first) // 16 - (len(system) // 16 - 4) - 2


def test_prefix_probe_hashes_like_xxhash(prefix_probe: ModuleType) -> None:
    import _prefix  # noqa: PLC0415 -- the compiled module may be missing (the probes fixture skips first)

    data = bytes(range(256)) * 8
    for block_len in (7, 64, 241):
        for seed in (0, (1 << 64) - 1):
            index = _prefix.PrefixIndex()
            index.add_holder(10_000)
            added, _ = prefix_probe.send_and_match(index, data, block_len, seed, 0)
            keys, h = [], seed
            for start in range(0, len(data) - block_len + 1, block_len):
                h = xxhash.xxh3_64_intdigest(data[start : start + block_len], h)
                keys.append(h)
            assert added == len(keys) and index.match(0, _prefix.block_chain(data, block_len, seed)) == len(keys)
            assert prefix_probe.match(index, 0, array("Q", keys)) == len(keys)
