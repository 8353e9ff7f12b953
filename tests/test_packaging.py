"""What `pip install .` (not -e) installs: every module of the three packages and the shipped
configs. An editable install hides a package left out of the wheel; users' installs do not."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.l1
ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_every_module_and_shipped_config(tmp_path):
    # Built from a copy: setuptools' build/ folder in the repository would carry earlier builds' files.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "exporter", "fx_passes", "ep_profiles"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                            if (ROOT / name).is_dir() else {}))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("genai_exporter-*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    expected = {path.relative_to(ROOT).as_posix()
                for package in ("exporter", "fx_passes", "ep_profiles")
                for pattern in ("*.py", "configs/*.json")
                for path in (ROOT / package).rglob(pattern) if "__pycache__" not in path.parts}
    assert any(name.startswith("exporter/onnx_passes/") for name in expected)
    assert sorted(expected - in_wheel) == []
