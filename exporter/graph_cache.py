"""Re-exports reuse the lowered graph: trace, FX passes and lowering are most of an export's time,
and their result depends on the architecture, the options and the libraries, never on the weight
values (weights reach the package when it is written: ``exporter.weights``). So each session's
lowered graph is kept, with its weights as placeholders, under a key of everything that shapes it,
and a re-export of another checkpoint of the same architecture (a training run's, or the same
model in memory after more steps) starts from the ONNX passes.

Where: ``$XDG_CACHE_HOME/genai-exporter/graphs`` (``~/.cache/...`` when unset), or the folder the
caller names; ``--no-cache`` (API ``cache=False``) or ``GENAI_EXPORTER_NO_CACHE=1`` turns it off.
The export takes the same steps after lowering whether or not a cache is used (the lowered graph is
always serialized and read back, weights as placeholders), so a package from the cache is
byte-identical to one exported without it.

The key is a sha256 of: this cache's format; the exporter's own source files; the Python, torch,
transformers, onnx, onnx_ir, onnxscript, onnxruntime and numpy versions; the model's class, its
config (less its path and the transformers version that saved it) and attention implementation;
the source files of every module class in the model (a subclass or an edited copy of a model's
code changes the key); every saved tensor's name, shape and dtype; the non-persistent buffers'
values (rotary tables: traced into the graph); where the weights come from; the export settings
(profile, precision, options, the probed layout, multimodal facts) and the plan. A model with
forward hooks, or a module whose ``forward`` is replaced on the instance, is not cached: no key
can see what such code does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
import torch

from exporter import weights

FORMAT = 1
# The least recently used entries go once the cache holds more than this.
MAX_BYTES = 4 << 30
NO_CACHE_VARIABLE = "GENAI_EXPORTER_NO_CACHE"
_LIBRARIES = ("torch", "transformers", "onnx", "onnx-ir", "onnxscript", "onnxruntime", "numpy")
_PROJECT_ROOT = Path(__file__).resolve().parents[1]
_PROJECT_PACKAGES = ("exporter", "fx_passes", "ep_profiles")
_CONFIG_FIELDS_OUTSIDE_KEY = ("_name_or_path", "transformers_version", "_commit_hash")


@dataclass
class LoweredSession:
    """A session's graph as lowered and serialized, weights as placeholders, with what the steps
    before it decided: the FX pass records and where each weight is read."""

    model_proto: bytes
    recipes: weights.Recipes
    fx_passes: list[dict[str, Any]]

    @classmethod
    def of(cls, model: ir.Model, recipes: weights.Recipes, fx_passes: list[dict[str, Any]]) -> LoweredSession:
        return cls(ir.serde.serialize_model(model).SerializeToString(), recipes, fx_passes)

    def model(self) -> ir.Model:
        return ir.serde.deserialize_model(onnx.ModelProto.FromString(self.model_proto))


def default_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "genai-exporter" / "graphs"


def chosen_folder(cache: bool | str | Path) -> Path | None:
    """The cache folder ``export(cache=...)`` asks for: None where the cache is off."""
    if cache is False:
        return None
    if cache is True:
        return None if os.environ.get(NO_CACHE_VARIABLE, "") not in ("", "0") else default_folder()
    return Path(cache).expanduser()


class GraphCache:
    """One export's entry: a folder per key, a serialized graph and a JSON record per session. A
    session's record is written last and holds its graph's sha256, so a torn or altered entry reads
    as a miss."""

    def __init__(self, root: Path, key: str):
        self.root, self.key = root, key
        self.folder = root / key

    def read(self, session: str) -> LoweredSession | None:
        try:
            record = json.loads((self.folder / f"{session}.json").read_text())
            proto = (self.folder / f"{session}.onnx").read_bytes()
        except (OSError, ValueError):
            return None
        if record.get("format") != FORMAT or record.get("sha256") != hashlib.sha256(proto).hexdigest():
            return None
        with contextlib.suppress(OSError):  # a read-only cache still serves
            os.utime(self.folder)  # recently used: pruned last
        return LoweredSession(proto, weights.recipes_from_json(record["recipes"]), record["fx_passes"])

    def write(self, session: str, lowered: LoweredSession, ingredients: dict[str, Any]) -> None:
        """Writes atomically (each file renamed into place, the record last), then prunes the
        least recently used entries over ``MAX_BYTES``. Raises OSError where the folder is not
        writable (the export goes on without it)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {"format": FORMAT, "sha256": hashlib.sha256(lowered.model_proto).hexdigest(),
                  "recipes": weights.recipes_to_json(lowered.recipes), "fx_passes": lowered.fx_passes}
        _write_atomically(self.folder / f"{session}.onnx", lowered.model_proto)
        _write_atomically(self.folder / "key.json", json.dumps(ingredients, indent=1, sort_keys=True).encode())
        _write_atomically(self.folder / f"{session}.json", json.dumps(record).encode())
        prune(self.root, keep=self.folder)


def _write_atomically(path: Path, data: bytes) -> None:
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as file:
        file.write(data)
    os.replace(file.name, path)


def prune(root: Path, keep: Path, max_bytes: int = MAX_BYTES) -> list[Path]:
    """Remove the least recently used entries until the cache holds at most ``max_bytes`` (never
    ``keep``, the entry just written). Returns what it removed."""
    entries = []
    for folder in root.iterdir():
        if folder.is_dir() and folder != keep:
            size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
            entries.append((folder.stat().st_mtime, size, folder))
    total = sum(size for _, size, _ in entries) + sum(p.stat().st_size for p in keep.iterdir() if p.is_file())
    removed = []
    for _, size, folder in sorted(entries):
        if total <= max_bytes:
            break
        shutil.rmtree(folder, ignore_errors=True)
        total -= size
        removed.append(folder)
    return removed


def key_ingredients(model: torch.nn.Module, saved: dict[str, torch.Tensor], source_kind: str,
                    settings, plan) -> dict[str, Any] | str:
    """Everything the lowered graphs depend on, as JSON-able values; or, where the model runs code
    no key can see, why it cannot be cached."""
    if uncacheable := _unseen_code(model):
        return uncacheable
    config = model.config.to_dict()
    for field in _CONFIG_FIELDS_OUTSIDE_KEY:
        config.pop(field, None)
    saved_ids = {id(t) for t in saved.values()}
    return {
        "format": FORMAT,
        "exporter": _project_digest(),
        "python": platform.python_version(),
        "libraries": {name: _version(name) for name in _LIBRARIES},
        "model_class": _qualified_name(type(model)),
        "config": json.loads(json.dumps(config, sort_keys=True, default=repr)),
        "attention_implementation": str(getattr(model.config, "_attn_implementation", None)),
        "model_code": _model_code_digests(model),
        "saved_tensors": {name: [list(t.shape), str(t.dtype)] for name, t in saved.items()},
        "traced_buffers": {name: _tensor_digest(b) for name, b in model.named_buffers()
                           if id(b) not in saved_ids},
        "weights": source_kind,
        "settings": json.loads(json.dumps(dataclasses.asdict(settings), sort_keys=True, default=repr)),
        "plan": plan.to_dict(),
    }


def key_of(ingredients: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(ingredients, sort_keys=True).encode()).hexdigest()[:32]


def _unseen_code(model: torch.nn.Module) -> str | None:
    for name, module in model.named_modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return f"module '{name or type(module).__name__}' has forward hooks"
        if "forward" in vars(module):
            return f"module '{name or type(module).__name__}' has its forward replaced on the instance"
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return "global module forward hooks are registered"
    return None


def _model_code_digests(model: torch.nn.Module) -> dict[str, str]:
    """The sha256 of each source file defining a class of the model's modules (or the class's
    name alone where it has no file)."""
    files = {}
    for cls in {c for m in model.modules() for c in type(m).__mro__ if c.__module__ != "builtins"}:
        if cls.__module__.startswith("torch."):
            continue  # torch's own modules: its version is in the key
        try:
            path = inspect.getsourcefile(cls)
        except TypeError:
            path = None
        if path is None:
            files[_qualified_name(cls)] = "no source file"
        elif path not in files:
            files[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return {_relative(path): digest for path, digest in sorted(files.items())}


def _relative(path: str) -> str:
    """A source file's path below its sys.path entry (the key must not depend on where Python is
    installed)."""
    for entry in sorted(sys.path, key=len, reverse=True):
        if entry and path.startswith(entry.rstrip(os.sep) + os.sep):
            return path[len(entry.rstrip(os.sep)) + 1:]
    return path


def _project_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(_project_files()):
        digest.update(path.relative_to(_PROJECT_ROOT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _project_files() -> Iterator[Path]:
    for package in _PROJECT_PACKAGES:
        for path in (_PROJECT_ROOT / package).rglob("*"):
            if path.suffix in (".py", ".json") and "__pycache__" not in path.parts:
                yield path


def _tensor_digest(tensor: torch.Tensor) -> str:
    if tensor.device.type == "meta" or tensor.__class__.__name__ == "FakeTensor":
        return f"{list(tensor.shape)} {tensor.dtype} (no values)"
    values = tensor.detach().contiguous().cpu()
    if values.dtype == torch.bfloat16:
        values = values.view(torch.uint16)
    return hashlib.sha256(values.numpy().tobytes()).hexdigest() + f" {list(tensor.shape)} {tensor.dtype}"


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"

