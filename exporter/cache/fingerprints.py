"""What every cached result depends on beyond its own inputs: this exporter's source and the
versions of Python and the libraries that shape a package. Read without importing any of them."""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
from collections.abc import Iterator
from pathlib import Path

_PROJECT_ROOT = Path(__file__).resolve().parents[2]
# The libraries whose versions shape an exported graph: tracing (torch and its sympy shapes),
# the models (transformers), lowering and the ONNX passes, and the constants numpy computes.
GRAPH_LIBRARIES = ("torch", "sympy", "transformers", "onnx", "onnx-ir", "onnxscript", "onnxruntime", "numpy")
_PROJECT_PACKAGES = ("exporter", "fx_passes", "ep_profiles")


def project_digest() -> str:
    """The sha256 of the exporter's own files (its Python code and the data files it ships)."""
    digest = hashlib.sha256()
    for path in sorted(_project_files()):
        digest.update(path.relative_to(_PROJECT_ROOT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _project_files() -> Iterator[Path]:
    for package in _PROJECT_PACKAGES:
        for path in (_PROJECT_ROOT / package).rglob("*"):
            if path.suffix in (".py", ".json") and "__pycache__" not in path.parts:
                yield path


def python_version() -> str:
    return platform.python_version()


def machine() -> str:
    """The CPU architecture: constants computed at export (rotary tables) may differ in their last
    bits between architectures, so a cache shared between machines keys on it (machines of one
    architecture with other vector units could still differ; a cache is meant for one machine)."""
    return platform.machine()


def versions(distributions: tuple[str, ...]) -> dict[str, str]:
    return {name: version(name) for name in distributions}


def version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
