"""Write the package folder: model.onnx + external data, genai_config.json, tokenizer files and the
export report, into the staging folder ``exporter.package.destination`` gives (moved into place at the end,
so a failed export leaves nothing half-written behind).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exporter.errors import ExporterError, os_error_in

MODEL_FILENAME = "model.onnx"
DATA_FILENAME = "model.onnx.data"
GENAI_CONFIG_FILENAME = "genai_config.json"
REPORT_FILENAME = "export_report.json"
REPORT_MARKDOWN_FILENAME = "export_report.md"
# Tensors of at most this many bytes stay inside model.onnx (onnx_ir's default); the rest go to .data.
INLINE_TENSOR_BYTES = 256

if TYPE_CHECKING:  # a replayed export writes its package without importing onnx_ir
    import onnx_ir as ir


def save_model(model: ir.Model, folder: Path, filename: str = MODEL_FILENAME,
               on_tensor: Callable[[int], None] | None = None) -> None:
    """The model as ``filename`` (which may name a session's subfolder) with its weights as
    external data beside it (``<name>.data``, a path relative to the model file);
    ``on_tensor(bytes)`` is called as each external tensor is written."""
    import onnx_ir as ir

    path = folder / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    callback = (lambda tensor, info: on_tensor(tensor.nbytes)) if on_tensor else None
    ir.save(model, path, external_data=f"{path.name}.data", size_threshold_bytes=INLINE_TENSOR_BYTES,
            callback=callback)


def external_tensors(model: ir.Model) -> tuple[int, int]:
    """How many tensors ``save_model`` writes as external data, and their bytes."""
    sizes = [v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None]
    external = [size for size in sizes if size > INLINE_TENSOR_BYTES]
    return len(external), sum(external)


def save_json(data: Any, path: Path) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def save_tokenizer(tokenizer: Any, folder: Path) -> list[str]:
    """Saves the tokenizer's files into ``folder`` and returns their names.

    File names a tokenizer writes can come from a checkpoint (``vocab_files_names``), so each must
    be a plain name: one with a separator or ``..`` is refused before anything is written. The files
    go to a scratch folder first and only flat regular files are copied into the package.
    """
    for file_name in getattr(tokenizer, "vocab_files_names", {}).values():
        if not _is_plain_file_name(str(file_name)):
            raise ExporterError(
                f"the tokenizer asks to write '{file_name}', which is not a plain file name; refusing to write it"
            )
    with tempfile.TemporaryDirectory(dir=folder) as scratch_name:
        scratch = Path(scratch_name)
        try:
            tokenizer.save_pretrained(str(scratch))
        except OSError:
            raise
        except Exception as error:  # the Rust tokenizer's I/O errors are plain Exceptions
            if (os_error := os_error_in(error, folder)) is not None:
                raise os_error from error
            raise
        saved = []
        for path in sorted(scratch.iterdir()):
            if path.is_file() and not path.is_symlink() and _is_plain_file_name(path.name):
                shutil.copyfile(path, folder / path.name)
                saved.append(path.name)
    if "tokenizer.json" not in saved and "tokenizer.model" not in saved:
        raise ExporterError(
            "the tokenizer saved neither tokenizer.json nor tokenizer.model; ONNX Runtime GenAI needs one of them"
        )
    return saved


def _is_plain_file_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and Path(name).name == name and "\\" not in name


def file_record(path: Path) -> dict[str, Any]:
    """A written file's size and sha256, which ``check`` compares with what is on disk later."""
    with open(path, "rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    return {"bytes": path.stat().st_size, "sha256": digest}


def save_report(report, stages, folder: Path) -> None:
    """The export report, JSON and Markdown, with the stage timings and the size and sha256 of
    every file written before it."""
    report.stages = [s.to_dict() for s in stages.records]
    report.files = {p.relative_to(folder).as_posix(): file_record(p) for p in sorted(folder.rglob("*")) if p.is_file()}
    save_json(report.to_dict(), folder / REPORT_FILENAME)
    (folder / REPORT_MARKDOWN_FILENAME).write_text(report.to_markdown())
