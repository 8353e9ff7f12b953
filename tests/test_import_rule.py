"""L1: the import rule (ARCHITECTURE.md, "Layers and the import rule"), read off the source.

Every import of the project's own modules, at the top of a module or inside a function (a lazy
import is still a dependency), goes to a module of the same group or of a lower layer, and no
modules import each other in a circle. Imports under ``if TYPE_CHECKING:`` are annotations only
and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("exporter", "fx_passes", "ep_profiles")

# Group -> layer, lowest first. A module's group is its stage folder under exporter/, or its own
# name for a module at exporter/'s root; fx_passes and ep_profiles are one group each.
LAYERS = {
    # foundation: what everything may use
    "ep_profiles": 0, "exporter.units": 0, "exporter.int4_options": 0, "exporter.stages": 0,
    "exporter.errors": 1,
    "exporter": 2,  # the package's __init__: errors and options; export and ExportOnSave by name (importlib), its API
    "exporter.precisions": 2,
    "exporter.options": 3,  # what a caller asks for, resolved against profiles and precisions
    # the stages, in the order an export runs them
    "exporter.weights": 2,
    "exporter.load": 3, "fx_passes": 3,
    "exporter.trace": 4,
    "exporter.lower": 5, "exporter.sessions": 5, "exporter.onnx_passes": 5,
    "exporter.package": 6,
    "exporter.verify": 7, "exporter.cache": 7,
    # the spine and the surfaces
    "exporter.plan": 8, "exporter.progress": 8,
    "exporter.pipeline": 9,
    "exporter.training": 10, "exporter.cli": 10, "exporter.__main__": 11,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def _group(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "exporter":
        return parts[0]
    return ".".join(parts[:2])


def _resolve(name: str) -> str:
    """The project module an imported name lives in (``from exporter.load import sources`` names
    the module ``exporter.load.sources``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            found.add(f"relative import in {path.name}")  # resolves to nothing: the rule cannot place it
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in PACKAGES:
                for alias in node.names:
                    found.add(_resolve(f"{node.module}.{alias.name}"))
        elif isinstance(node, ast.Import):
            found.update(_resolve(a.name) for a in node.names if a.name.split(".")[0] in PACKAGES)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found - {""}


IMPORTS = {module: _imports(path) - {module} for module, path in MODULES.items()}


@pytest.mark.l1
def test_every_group_has_a_layer():
    assert sorted({_group(m) for m in MODULES} - set(LAYERS)) == []


def _upward(imports: dict[str, set[str]]) -> list[str]:
    return [f"{module} imports {target}" for module, targets in sorted(imports.items()) for target in sorted(targets)
            if target not in MODULES or (_group(target) != _group(module)
                                         and LAYERS[_group(target)] >= LAYERS[_group(module)])]


def _circles(imports: dict[str, set[str]]) -> list[str]:
    circles, state = [], {}

    def walk(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(imports.get(module, ())):
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                walk(target, path + [target])
        state[module] = "done"

    for module in sorted(imports):
        if module not in state:
            walk(module, [module])
    return circles


@pytest.mark.l1
def test_imports_go_down_the_layers():
    assert _upward(IMPORTS) == []


@pytest.mark.l1
def test_no_import_circles():
    assert _circles(IMPORTS) == []


@pytest.mark.l1
def test_the_checks_find_an_upward_import_and_a_circle():
    """A stage importing the pipeline goes up; two stage modules importing each other close a circle."""
    assert _upward({"exporter.load.sources": {"exporter.pipeline"}}) == [
        "exporter.load.sources imports exporter.pipeline"]
    assert _circles({"exporter.verify.check": {"exporter.verify.check_against"},
                     "exporter.verify.check_against": {"exporter.verify.check"}}) == [
        "exporter.verify.check -> exporter.verify.check_against -> exporter.verify.check"]


@pytest.mark.l1
def test_the_rule_can_fail(tmp_path):
    """The parser sees a lazy import inside a function, skips one under TYPE_CHECKING, and reports a
    relative import (which the rule could not place)."""
    source = tmp_path / "module.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from exporter.cli import main\n"
                      "def f():\n    from exporter.pipeline import export\n")
    assert _imports(source) == {"exporter.pipeline"}
    source.write_text("from . import sibling\n")
    assert _imports(source) == {"relative import in module.py"}
