"""The built wheel ships the compiled core with its cimport contract (.pxd) and type stubs (.pyi)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "src", src / "src", ignore=shutil.ignore_patterns("*.c", "*.so", "__pycache__", "*.egg-info")
    )
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
    )
    return zipfile.ZipFile(next(out.glob("kv_affinity_router-*.whl")))


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
