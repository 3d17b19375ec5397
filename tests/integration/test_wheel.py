"""The built wheel ships the compiled core with its cimport contract (.pxd) and type stubs (.pyi)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# its subject is a build that embeds the compiled core, not which ring the router loads: CI runs it
# on the compiled pass only (pyproject.toml's one_pass marker)
pytestmark = pytest.mark.one_pass

ROOT = Path(__file__).parents[2]


def build_wheel(tmp_path_factory: pytest.TempPathFactory, no_extensions: bool) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "src", src / "src", ignore=shutil.ignore_patterns("*.c", "*.so", "__pycache__", "*.egg-info")
    )
    out = tmp_path_factory.mktemp("dist")
    env = {k: v for k, v in os.environ.items() if k != "ROUTER_NO_EXTENSIONS"}
    if no_extensions:
        env["ROUTER_NO_EXTENSIONS"] = "1"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        env=env,
    )
    return zipfile.ZipFile(next(out.glob("kv_affinity_router-*.whl")))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    return build_wheel(tmp_path_factory, no_extensions=False)


def test_wheel_ships_contract_stubs_and_extension(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    assert "_ring.pxd" in names
    assert "_ring.pyi" in names
    assert any(n.startswith("_ring.") and n.endswith(".so") for n in names)
    assert {"router/__init__.py", "router/ring.py", "router/_ring_py.py"} <= names
    assert wheel.read("_ring.pxd") == (ROOT / "src" / "_ring.pxd").read_bytes()


def test_wheel_declares_console_scripts(wheel: zipfile.ZipFile) -> None:
    entry_points = next(n for n in wheel.namelist() if n.endswith("entry_points.txt"))
    assert "router-bench = router.bench.cli:main" in wheel.read(entry_points).decode()


def test_opt_out_builds_a_pure_python_wheel(tmp_path_factory: pytest.TempPathFactory) -> None:
    names = build_wheel(tmp_path_factory, no_extensions=True).namelist()
    assert not any(n.endswith(".so") for n in names)
    assert "router/_ring_py.py" in names and "router/ring.py" in names
