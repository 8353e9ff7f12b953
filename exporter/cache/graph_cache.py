"""Re-exports reuse the lowered graph: trace, FX passes and lowering are most of an export's time,
and their result depends on the architecture, the options and the libraries, never on the weight
values (weights reach the package when it is written: ``exporter.weights``). So each session's
lowered graph is kept, with its weights as placeholders, under a key of everything that shapes it,
and a re-export of another checkpoint of the same architecture (a training run's, or the same
model in memory after more steps) starts from the ONNX passes.

Where: ``$XDG_CACHE_HOME/genai-exporter/graphs`` (``~/.cache/...`` when unset), or the folder the
caller names; ``--no-cache`` (API ``cache=False``) or ``GENAI_EXPORTER_NO_CACHE=1`` turns it off.
The export takes the same steps after lowering whether or not a cache is used (the lowered graph is
always serialized and read back, weights as placeholders), so every file of a package from the
cache but its report is byte-identical to one exported without it.

The key is a sha256 of: this cache's format; the exporter's own source files; the CPU architecture;
the Python, torch, sympy, transformers, onnx, onnx_ir, onnxscript, onnxruntime and numpy versions; the model's class and
config (less its path and the transformers version that saved it); the attention and experts
implementations every config of the model names, and the code registered under those names; the
source files defining the model's classes (and, for code outside transformers, the files beside
them); the live code of every function those classes and their modules hold (a method or function
patched at run time changes the key); every module's own attributes (a scaling set after the model
was built changes the key); every saved tensor's name, shape and dtype; the values of the buffers
(rotary tables; for a model in memory, its persistent buffers too); where the weights come from;
the export settings (profile, precision, options, the probed layout, multimodal facts) and the plan. A model with forward hooks
(but the one transformers' gradient checkpointing puts on the input embeddings, which changes no
value), a module whose ``forward`` is replaced on the instance, or a class with no source file (a
notebook's) is not cached: no key can see what such code does. What the key cannot see: edits to
installed libraries' files other than the model's own (their versions are keyed, not their files).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import inspect
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import torch
from torch._subclasses.fake_tensor import FakeTensor

from exporter.cache import fingerprints
from exporter.cache.cache_folder import (  # noqa: F401 (the cache's API)
    KEY_FILENAME,
    NO_CACHE_VARIABLE,
    chosen_folder,
    default_folder,
)
from exporter.weights.recipes import Recipes, recipes_from_json, recipes_to_json
from exporter.weights.stores import WeightStore

FORMAT = 1
# The least recently used entries go once the cache holds more than this.
MAX_BYTES = 4 << 30
_ENTRY_NAME = re.compile(r"^[0-9a-f]{32}$")
_TORN_ENTRY_WRITE = re.compile(r"^\.[0-9a-f]{32}\.")
# A hidden file this old in an entry is a write that was killed (a write takes seconds).
_TORN_WRITE_SECONDS = 3600
_CONFIG_FIELDS_OUTSIDE_KEY = ("_name_or_path", "transformers_version", "_commit_hash")


@dataclass
class LoweredSession:
    """A session's graph as lowered and serialized, weights as placeholders, with what the steps
    before it decided: the FX pass records and where each weight is read."""

    model_proto: bytes
    recipes: Recipes
    fx_passes: list[dict[str, Any]]

    @classmethod
    def of(cls, model: ir.Model, recipes: Recipes, fx_passes: list[dict[str, Any]]) -> LoweredSession:
        return cls(ir.serde.serialize_model(model).SerializeToString(), recipes, fx_passes)

    def model(self) -> ir.Model:
        return ir.serde.deserialize_model(onnx.ModelProto.FromString(self.model_proto))


class GraphCache:
    """One export's entry: a folder per key, a serialized graph and a JSON record per session. A
    session's record is written last and holds the sha256 of its graph, recipes and FX records, so
    a torn or altered entry reads as a miss."""

    def __init__(self, root: Path, key: str):
        self.root, self.key = root, key
        self.folder = root / key

    def read(self, session: str) -> LoweredSession | None:
        try:
            record = json.loads((self.folder / f"{session}.json").read_text())
            proto = (self.folder / f"{session}.onnx").read_bytes()
            if record["format"] != FORMAT or record["sha256"] != _digest(proto, record["recipes"], record["fx_passes"]):
                return None
            lowered = LoweredSession(proto, recipes_from_json(record["recipes"]), record["fx_passes"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # missing, torn or altered: a miss, rewritten by this export
        with contextlib.suppress(OSError):  # a read-only cache still serves
            os.utime(self.folder)  # recently used: pruned last
        return lowered

    def write(self, session: str, lowered: LoweredSession, ingredients: dict[str, Any]) -> None:
        """Writes atomically (each file renamed into place, the record last). Raises OSError where
        the folder is not writable (the export goes on without it)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        recipes = recipes_to_json(lowered.recipes)
        record = {"format": FORMAT, "sha256": _digest(lowered.model_proto, recipes, lowered.fx_passes),
                  "recipes": recipes, "fx_passes": lowered.fx_passes}
        _write_atomically(self.folder / f"{session}.onnx", lowered.model_proto)
        _write_atomically(self.folder / KEY_FILENAME, json.dumps(ingredients, indent=1, sort_keys=True).encode())
        _write_atomically(self.folder / f"{session}.json", json.dumps(record).encode())

    def prune(self) -> list[Path]:
        """The least recently used entries over ``MAX_BYTES`` removed, never this one."""
        return prune(self.root, keep=self.folder)


def _digest(proto: bytes, recipes: Any, fx_passes: Any) -> str:
    """The sha256 of everything a session's entry gives the export: its graph, recipes and FX records."""
    digest = hashlib.sha256(proto)
    digest.update(json.dumps([recipes, fx_passes], sort_keys=True).encode())
    return digest.hexdigest()


def _write_atomically(path: Path, data: bytes) -> None:
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as file:
        file.write(data)
    os.replace(file.name, path)


def prune(root: Path, keep: Path, max_bytes: int = MAX_BYTES) -> list[Path]:
    """Remove the least recently used entries until the cache holds at most ``max_bytes`` (never
    ``keep``, the entry just written), and files left by writes that were killed. Only folders that
    are entries (a key's name, holding a key record) are touched: a cache folder the user named may
    hold other things. Returns the entries it removed. Entries are the graph cache's and the command
    line's replays (``exporter.cache.replay``), whose records are written as a hidden folder renamed into
    place: one left by a killed write is removed too."""
    entries, total = [], 0
    for folder in root.iterdir():
        if _TORN_ENTRY_WRITE.match(folder.name) and folder.is_dir():
            with contextlib.suppress(OSError):
                if time.time() - folder.stat().st_mtime > _TORN_WRITE_SECONDS:
                    shutil.rmtree(folder)
            continue
        if not (_ENTRY_NAME.match(folder.name) and (folder / KEY_FILENAME).is_file()):
            continue
        try:
            files = [p for p in folder.iterdir() if p.is_file()]
            for path in files:
                if path.name.startswith(".") and time.time() - path.stat().st_mtime > _TORN_WRITE_SECONDS:
                    path.unlink()
            size = sum(p.stat().st_size for p in files if p.exists())
            if folder != keep:
                entries.append((folder.stat().st_mtime, size, folder))
            total += size
        except FileNotFoundError:
            continue  # another export pruned it meanwhile
    removed = []
    for _, size, folder in sorted(entries):
        if total <= max_bytes:
            break
        shutil.rmtree(folder, ignore_errors=True)
        total -= size
        removed.append(folder)
    return removed


def key_ingredients(model: torch.nn.Module, weight_store: WeightStore, settings, plan,
                    views: tuple[torch.nn.Module, ...] = ()) -> dict[str, Any] | str:
    """Everything the lowered graphs depend on, as JSON-able values; or, where the model runs code
    no key can see, why it cannot be cached. The kind of ``weight_store`` decides which tensors
    are traced with values and which buffers it provides. ``views``: modules traced around the
    model's own (a multimodal model's causal LM view), whose classes' code counts too."""
    if uncacheable := _unseen_code(model):
        return uncacheable
    classes = _model_classes(model, *views)
    if unfiled := next((cls for cls in classes if _source_file(cls) is None), None):
        return (f"class {_qualified_name(unfiled)} has no source file (defined in a notebook, on stdin or by exec), "
                "so no key can see its code")
    return {
        "format": FORMAT,
        "exporter": fingerprints.project_digest(),
        "python": fingerprints.python_version(),
        "machine": fingerprints.machine(),
        "libraries": fingerprints.versions(fingerprints.GRAPH_LIBRARIES),
        "model_class": _qualified_name(type(model)),
        "config": _config_values(model.config),
        "implementations": _implementations(model),
        "model_files": _source_file_digests(classes),
        "model_functions": _live_function_digests(classes),
        "module_attributes": _module_attributes(model),
        "hooks": {name: [_function_digest(h) for h in module._forward_hooks.values()]
                  for name, module in model.named_modules() if module._forward_hooks},
        "saved_tensors": {name: [list(t.shape), str(t.dtype)] for name, t in model.state_dict(keep_vars=True).items()},
        # Every buffer with values (rotary tables; a model in memory's persistent ones too, which a
        # pass may fold): fake and meta ones give their shape only.
        "buffers": {name: _tensor_digest(b) for name, b in model.named_buffers()},
        "weights": _qualified_name(type(weight_store)),
        # Less what the weights decide, which acts after the cached graphs.
        "settings": _jsonable({k: v for k, v in dataclasses.asdict(dataclasses.replace(
            settings, activation_aware_scales=None)).items() if k not in _WEIGHT_DEPENDENT_SETTINGS}),
        "plan": plan.to_dict(),
    }


def key_of(ingredients: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(ingredients, sort_keys=True).encode()).hexdigest()[:32]


# Hooks that change no traced value: transformers' own, which gradient checkpointing (and so PEFT
# training) puts on the input embeddings to make their output require grads.
_GRAPH_NEUTRAL_HOOKS = frozenset({"PreTrainedModel.enable_input_require_grads.<locals>.make_inputs_require_grads"})


def _unseen_code(model: torch.nn.Module) -> str | None:
    for name, module in model.named_modules():
        hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
        if any(getattr(hook, "__qualname__", None) not in _GRAPH_NEUTRAL_HOOKS for hook in hooks):
            return f"module '{name or type(module).__name__}' has forward hooks"
        if "forward" in vars(module):
            return f"module '{name or type(module).__name__}' has its forward replaced on the instance"
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return "global module forward hooks are registered"
    return None


def _model_classes(*models: torch.nn.Module) -> list[type]:
    """The classes of the models' modules and their bases, less torch's (its version is keyed)."""
    classes = {c for model in models for m in model.modules() for c in type(m).__mro__}
    return sorted((c for c in classes if c is not object and c.__module__.split(".")[0] != "torch"),
                  key=_qualified_name)


def _source_file(cls: type) -> str | None:
    """The file defining ``cls``, or None: a class from a notebook, stdin or ``exec`` has none, or
    (in a script's ``__main__``) a file that does not hold it."""
    try:
        path = inspect.getsourcefile(cls)
        if not path or not Path(path).is_file():
            return None
        if not cls.__module__.startswith("transformers."):
            inspect.getsource(cls)  # the class is in that file (transformers' always are)
    except (TypeError, OSError, SyntaxError):
        return None
    return path


def _source_file_digests(classes: list[type]) -> dict[str, str]:
    """The sha256 of each file defining a class of the model, and, for code outside transformers (a
    checkpoint's own code, a user's subclass), of every Python file beside it (its helpers)."""
    paths = set()
    for cls in classes:
        path = Path(_source_file(cls))
        paths.add(path)
        if not cls.__module__.startswith("transformers."):
            paths.update(p for p in path.parent.glob("*.py") if p.is_file())
    return {_relative(str(path)): hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(paths)}


def _live_function_digests(classes: list[type]) -> dict[str, str]:
    """The code of every function the model's classes and their modules hold now: a method or a
    module's function replaced at run time (how Liger or Unsloth patch models) changes the key,
    which the source files alone would not see."""
    digests = {}
    for cls in classes:
        for name, value in vars(cls).items():
            if (digest := _function_digest(value)) is not None:
                digests[f"{_qualified_name(cls)}.{name}"] = digest
        for name, value in vars(sys.modules.get(cls.__module__, object)).items():
            if (digest := _function_digest(value)) is not None:
                digests[f"{cls.__module__}.{name}"] = digest
    return digests


def _function_digest(value: Any, seen: frozenset[int] = frozenset()) -> str | None:
    """A digest of a function's code (its nested code, constants and names, and the functions its
    closure holds: a decorator's wrapped function), for functions, methods and properties; None
    for anything else."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return ",".join(_function_digest(f, seen) or "-" for f in (value.fget, value.fset))
    if inspect.ismethod(value):
        value = value.__func__
    if not inspect.isfunction(value):
        return None
    code = value.__code__
    if id(value) in seen:
        return "recursive"  # a closure holding the function itself
    digest = hashlib.sha256()
    _feed_code(digest, code)
    for cell in value.__closure__ or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        digest.update((_function_digest(contents, seen | {id(value)}) or type(contents).__qualname__).encode())
    return digest.hexdigest()[:16]


def _feed_code(digest, code) -> None:
    digest.update(code.co_code)
    digest.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for constant in code.co_consts:
        if inspect.iscode(constant):
            _feed_code(digest, constant)
        elif isinstance(constant, frozenset):  # its repr's order follows the string-hash seed
            digest.update(repr(sorted(map(repr, constant))).encode())
        else:
            digest.update(repr(constant).encode())


_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
# Where a model was read from, the warnings it has given and its generation settings (written to
# genai_config at every export, never traced; a GenerationConfig holds a string hash): they change
# between checkpoints or processes, never the graph.
_ATTRIBUTES_OUTSIDE_KEY = frozenset({"name_or_path", "warnings_issued", "generation_config"})


def _module_attributes(model: torch.nn.Module) -> dict[str, Any]:
    """Every module's own attributes beyond parameters, buffers and submodules (a head count, a
    scaling, a layer index, a tensor kept as a plain attribute): code reads them as it traces, and
    a caller may set them after the model was built."""
    configs: dict[int, Any] = {}
    values = {}
    for name, module in model.named_modules():
        for attribute, value in vars(module).items():
            # A cached_property's value appears at its first read (during a trace), derived from
            # the class's code and the other attributes, which are keyed.
            cached = isinstance(getattr(type(module), attribute, None), functools.cached_property)
            if attribute not in _MODULE_INTERNALS and attribute not in _ATTRIBUTES_OUTSIDE_KEY and not cached:
                values[f"{name}.{attribute}" if name else attribute] = _attribute_value(value, configs)
    return values


def _attribute_value(value: Any, configs: dict[int, Any], depth: int = 0) -> Any:
    from transformers import PretrainedConfig

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_attribute_value(v, configs, depth) for v in value]
    if isinstance(value, dict):
        return {str(k): _attribute_value(v, configs, depth) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(repr(_attribute_value(v, configs, depth)) for v in value)
    if isinstance(value, torch.Tensor):
        return _tensor_digest(value)
    if isinstance(value, (torch.dtype, torch.device, enum.Enum, slice)):
        return str(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, functools.partial):
        return {"partial": _function_digest(value.func) or _qualified_name(type(value.func)),
                "args": _attribute_value(value.args, configs), "keywords": _attribute_value(value.keywords, configs)}
    if isinstance(value, PretrainedConfig):
        if id(value) not in configs:  # shared by every layer: read once
            configs[id(value)] = _config_values(value)
        return configs[id(value)]
    if (digest := _function_digest(value)) is not None:
        return digest
    fields = getattr(value, "__dict__", None)
    if isinstance(fields, dict) and depth < 2 and not isinstance(value, (type, torch.nn.Module)):
        return {"type": _qualified_name(type(value)),
                "fields": {str(k): _attribute_value(v, configs, depth + 1) for k, v in fields.items()}}
    return _qualified_name(type(value))


def _implementations(model: torch.nn.Module) -> dict[str, str]:
    """The attention and experts implementations every config of the model names (a sub-config's
    may differ from the top one's), and the code of the attention and mask functions registered
    under those names (a custom registration changes the key)."""
    from transformers import PretrainedConfig
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    configs = {id(c): c for m in model.modules() if isinstance(c := getattr(m, "config", None), PretrainedConfig)}
    implementations = {}
    for index, config in enumerate(sorted(configs.values(), key=lambda c: type(c).__name__)):
        for field in ("_attn_implementation", "_experts_implementation"):
            name = getattr(config, field, None)
            implementations[f"{type(config).__name__}[{index}].{field}"] = str(name)
            for registry, what in ((ALL_ATTENTION_FUNCTIONS, "attention"), (ALL_MASK_ATTENTION_FUNCTIONS, "mask"),
                                   (ALL_EXPERTS_FUNCTIONS, "experts")):
                try:
                    function = registry[name]
                except (KeyError, TypeError):
                    continue
                implementations[f"{what} function {name}"] = (_function_digest(function)
                                                              or _qualified_name(type(function)))
    return implementations


def _config_values(config) -> dict[str, Any]:
    """A config's values, less those that name where it was read from and what saved it (at any
    depth: a multimodal config holds its sub-configs')."""
    def without(values: Any) -> Any:
        if isinstance(values, dict):
            return {k: without(v) for k, v in values.items() if k not in _CONFIG_FIELDS_OUTSIDE_KEY}
        return values

    return _jsonable(without(config.to_dict()))


_WEIGHT_DEPENDENT_SETTINGS = ("residual_exponent", "activation_aware_scales")


def _jsonable(values: Any) -> Any:
    # Unsorted here (a config may mix int and str keys); ``key_of`` sorts the string keys JSON gives.
    return json.loads(json.dumps(values, default=repr))


def _relative(path: str) -> str:
    """A source file's path below its sys.path entry (the key must not depend on where Python is
    installed)."""
    for entry in sorted(sys.path, key=len, reverse=True):
        if entry and path.startswith(entry.rstrip(os.sep) + os.sep):
            return path[len(entry.rstrip(os.sep)) + 1:]
    return path


def _tensor_digest(tensor: torch.Tensor) -> str:
    if tensor.device.type == "meta" or isinstance(tensor, FakeTensor):
        return f"{list(tensor.shape)} {tensor.dtype} (no values)"
    values = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)  # any dtype, float8 too
    return hashlib.sha256(values.numpy().tobytes()).hexdigest() + f" {list(tensor.shape)} {tensor.dtype}"


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"

