"""Is every file of a package what the export wrote? The report records each file's size and
sha256 (``package.file_record``); each model's external-data references must also lie inside
their files. A damaged package says so here in one line, before ONNX Runtime fails on it."""

from __future__ import annotations

import json
from pathlib import Path

import onnx

from exporter.package.files import REPORT_FILENAME, file_record
from exporter.units import size_text


def is_model_file(name: str) -> bool:
    """Graphs and weights: what no one edits by hand (genai_config.json and the processor and
    tokenizer files are meant to be tuned, so a change there is no damage)."""
    return name.endswith((".onnx", ".onnx.data"))


def edited_files(package: Path) -> list[str]:
    """The other recorded files whose bytes changed since the export (a user's edit)."""
    return [name for name, recorded in recorded_files(package).items()
            if not is_model_file(name) and (package / name).is_file()
            and file_record(package / name)["sha256"] != recorded["sha256"]]


def damaged_files(package: Path, model_files: list[Path]) -> list[str]:
    """One line per damaged graph or weights file: missing, cut or changed since the export
    recorded it, or too short for the tensors a model file places in it."""
    problems = []
    for name, recorded in recorded_files(package).items():
        if not is_model_file(name):
            continue
        path = package / name
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if size != recorded["bytes"]:
            problems.append(f"{name} is damaged: {size_text(size)} on disk, {size_text(recorded['bytes'])} when exported")
        elif file_record(path)["sha256"] != recorded["sha256"]:
            problems.append(f"{name} is damaged: its sha256 differs from the one recorded at export")
    if problems:
        return problems  # a damaged model file may not even parse
    for model_file in model_files:
        problems += _external_data_overruns(package, model_file)
    return problems


def recorded_files(package: Path) -> dict[str, dict]:
    try:
        files = json.loads((package / REPORT_FILENAME).read_text()).get("files", {})
    except (OSError, ValueError):
        return {}  # no report (or not ours): only the extents can be checked
    return {name: record for name, record in files.items() if isinstance(record, dict) and {"bytes", "sha256"} <= set(record)}


def _external_data_overruns(package: Path, model_file: Path) -> list[str]:
    try:
        graph = onnx.load(str(model_file), load_external_data=False).graph
    except Exception as error:  # no record to compare with, and it does not parse
        return [f"{model_file.relative_to(package).as_posix()} is damaged: it does not parse ({type(error).__name__})"]
    ends: dict[str, int] = {}
    for tensor in graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entry = {e.key: e.value for e in tensor.external_data}
        end = int(entry.get("offset", 0)) + int(entry.get("length", 0))
        ends[entry["location"]] = max(ends.get(entry["location"], 0), end)
    problems = []
    for location, end in sorted(ends.items()):
        path = model_file.parent / location
        name = path.relative_to(package).as_posix() if path.is_relative_to(package) else str(path)
        if not path.is_file():
            problems.append(f"{name} is missing ({model_file.name} keeps its weights there)")
        elif path.stat().st_size < end:
            problems.append(f"{name} is damaged: {size_text(path.stat().st_size)} on disk, "
                            f"its tensors reach {size_text(end)}")
    return problems
