"""Weight stores: where the weights are kept, read one tensor at a time: a safetensors folder (``SafetensorsWeights``: only the
slice a split piece needs, through transformers' own conversions), random draws from a fixed seed
(``RandomWeights``), or a model in memory (``ModelWeights``); each accounts for every saved tensor
(``UnreadTensors``: what was left over, an error under ``strict``)."""

from __future__ import annotations

import collections
import json
import math
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import onnx_ir as ir
import torch

from exporter.errors import ExporterError
from exporter.weights.checkpoint_conversions import (
    DEQUANTIZED_FORMATS,
    ConvertedTensors,
    plan_conversions,
    quantization_method,
    refused_format,
)
from exporter.weights.safetensors_header import read_header

Index = tuple[slice, ...] | None


@dataclass(frozen=True)
class UnreadTensors:
    """Checkpoint tensors an export did not read, by why."""

    unmatched: tuple[str, ...] = ()  # no saved tensor of the model has this key: renamed, unconverted?
    unused: tuple[str, ...] = ()  # a tensor of the model the traced graph never reads
    left_out: tuple[str, ...] = ()  # a part of the checkpoint the export leaves out on purpose
    left_out_why: str = ""

    @property
    def unexplained(self) -> tuple[str, ...]:
        return self.unmatched + self.unused

    def notes(self) -> list[str]:
        notes = []
        if self.unmatched:
            notes.append("checkpoint tensors that match no tensor of the model, not read (renamed or unconverted "
                         f"keys?): {len(self.unmatched)}: {_names(self.unmatched)}")
        if self.unused:
            notes.append("checkpoint tensors of model tensors the exported graph never reads: "
                         f"{len(self.unused)}: {_names(self.unused)}")
        if self.left_out:
            notes.append(f"checkpoint tensors left out, {self.left_out_why}: {len(self.left_out)}")
        return notes


def _names(keys, shown: int = 6) -> str:
    listed = ", ".join(keys[:shown])
    return listed + (f" and {len(keys) - shown} more" if len(keys) > shown else "")


class WeightStore(Protocol):
    description: str
    # Whether persistent buffers come from the store too (a checkpoint), or keep the values the
    # model was built with (random weights: init values are what a fresh model has).
    provides_buffers: bool

    def tensor(self, name: str, index: Index, dtype: torch.dtype) -> torch.Tensor:
        """Saved tensor ``name`` (transformers' name), or the slice ``index`` of it, in ``dtype``."""
        ...

    def unread(self, read: set[str]) -> UnreadTensors:
        """What the store holds beyond the saved tensors ``read`` by the exported graph."""
        ...

    def verbatim_range(self, name: str, index: Index, dtype: ir.DataType) -> FileRange | None:
        """Where a file holds the bytes of ``name`` (its slice ``index``) in ``dtype`` as the package
        stores them, if one does (a checkpoint whose tensor has the package's dtype)."""
        ...

    def stored_tensor(self, name: str) -> StoredTensor | None:
        """Which file and key store ``name`` as one tensor, if one does (a checkpoint's tensor that
        no conversion of transformers' builds from several)."""
        ...


@dataclass(frozen=True)
class FileRange:
    """Bytes of a file that are a package tensor's bytes as they are: the writer copies them file
    to file (``copy_file_range`` in the kernel where the OS has it, through ``onnx_ir``'s
    ``ExternalTensor``) instead of reading them into memory and writing them back."""

    path: Path
    offset: int
    length: int
    file_name: str = ""  # its name in the checkpoint folder, the file the export opened (a replay records it)


@dataclass(frozen=True)
class StoredTensor:
    """A checkpoint tensor as stored: its file (the name the export opened), key, safetensors dtype
    name and shape."""

    file_name: str
    key: str
    dtype: str
    shape: tuple[int, ...]


# q/k RMSNorm scales of a random Gemma 4: at 1.0, attention logits have std ~ sqrt(head_dim) with
# scaling 1.0, softmax is nearly argmax and the model is chaotic (on full-size E2B a one-ulp fp16
# nudge of its input moves the logits by 62% relative L2 on one EP), so no two EPs can be compared.
TEMPERED_QK_NORM_SCALE = 0.25


_QK_NORMS = ("q_norm.weight", "k_norm.weight")


class RandomWeights:
    """What transformers' initialisation draws, without its cost: matrices ~ N(0, std), biases
    zeros, other vectors (norm scales) ones, q/k norm scales ``TEMPERED_QK_NORM_SCALE``. Each
    tensor's values follow from its name and slice, so a package is reproducible and a re-read
    gives the same numbers."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], std: float, seed: int = 0):
        self.shapes, self.std, self.seed = shapes, std, seed
        self.provides_buffers = False
        self.description = (f"random weights (N(0, {std}) matrices, zero biases, unit norm scales, "
                            f"q/k norm scales {TEMPERED_QK_NORM_SCALE}, seed {seed})")

    def unread(self, read: set[str]) -> UnreadTensors:
        return UnreadTensors()  # nothing is stored: every tensor is drawn when read

    def verbatim_range(self, name: str, index: Index, dtype: ir.DataType) -> None:
        return None  # drawn, not stored

    def stored_tensor(self, name: str) -> None:
        return None

    def tensor(self, name: str, index: Index, dtype: torch.dtype) -> torch.Tensor:
        shape = _sliced_shape(self.shapes[name], index)
        if len(shape) < 2:
            if name.endswith(".bias"):
                return torch.zeros(shape, dtype=dtype)
            return torch.full(shape, TEMPERED_QK_NORM_SCALE if name.endswith(_QK_NORMS) else 1.0, dtype=dtype)
        generator = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{name}:{index}".encode()))
        return (torch.randn(shape, generator=generator) * self.std).to(dtype)


class ModelWeights:
    """The tensors of a model in memory (a caller's model, a preset, pickled weights loaded whole),
    read when the package is written as a checkpoint's are: a graph traced from one model serves
    any weights of its architecture (``exporter.cache.graph_cache``)."""

    provides_buffers = True
    description = "the model in memory"

    def __init__(self, model: torch.nn.Module):
        self.saved = model.state_dict(keep_vars=True)

    def tensor(self, name: str, index: Index, dtype: torch.dtype) -> torch.Tensor:
        values = self.saved[name].detach()
        return (values if index is None else values[index]).to(dtype)

    def unread(self, read: set[str]) -> UnreadTensors:
        return UnreadTensors()  # the model's tensors are the saved tensors: nothing else to account for

    def verbatim_range(self, name: str, index: Index, dtype: ir.DataType) -> None:
        return None  # in memory, not in a file

    def stored_tensor(self, name: str) -> None:
        return None


def _open_safetensors(path: Path):
    from safetensors import safe_open

    if not path.is_file():
        raise ExporterError(f"'{path}' is missing (the checkpoint's index names it); re-download or re-save the checkpoint")
    with open(path, "rb"):
        pass  # safetensors says "No such file" for any failure to open: let a permission error be one
    try:
        return safe_open(str(path), framework="pt")
    except OSError:
        raise  # permissions and the like: reported as what they are
    except Exception as error:  # safetensors' own error: truncated, or not a safetensors file
        raise ExporterError(f"'{path}' is not a readable safetensors file ({_first_line(error)}); "
                            "re-download or re-save the checkpoint") from error


_LAYER = re.compile(r"^(?P<stack>.*\.layers)\.(?P<index>\d+)\.")


def _layer_counts(names) -> dict[str, int]:
    """``'model.layers'`` -> 1 + the highest layer index under it, for every stack of layers."""
    stacks: dict[str, int] = {}
    for name in names:
        if match := _LAYER.match(name):
            stacks[match["stack"]] = max(stacks.get(match["stack"], 0), int(match["index"]) + 1)
    return stacks


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class SafetensorsWeights:
    """A checkpoint folder's ``*.safetensors`` (sharded or not), read one tensor or slice at a time.

    A saved tensor is found as transformers' ``from_pretrained`` would find it (its conversion
    mapping: renamed keys, and tensors its converters build from several keys, such as per-expert
    weights fused into one; ``checkpoint_conversions``), else under its own name, an alias of it
    (tied weights), or, for a text model taken out of a multimodal checkpoint, the one key that ends
    with the name's path below the top module (``model.layers.0...`` in
    ``model.language_model.layers.0...``).
    """

    provides_buffers = True

    def __init__(self, folder: Path, aliases: dict[str, list[str]]):
        self.folder, self.aliases = folder, aliases
        self.description = f"the checkpoint in {folder}"
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                raise ExporterError(f"'{index}' is not a safetensors index ({_first_line(error)}); "
                                    "re-download or re-save the checkpoint") from error
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        self.handles = {name: _open_safetensors(folder / name) for name in files}
        self._headers: dict[str, tuple[int, dict]] = {}  # file -> (where its data starts, its header)
        self.file_of = {key: name for name, handle in self.handles.items() for key in handle.keys()}
        self.key_for: dict[str, str] = {}  # saved tensor name -> checkpoint key, once matched
        self.converted = ConvertedTensors({}, {})  # transformers' conversions, planned by match()
        # Keys of parts of the checkpoint the export leaves out on purpose, and why.
        self.left_out: frozenset[str] = frozenset()
        self.left_out_why = ""
        # Whether match() compared values (a tied tensor saved under two keys): a check of this
        # checkpoint's values, which a replay (``exporter.cache.replay``) of another would not make.
        self.compared_values = False

    def match(self, model: torch.nn.Module) -> None:
        """Find the key(s) of every saved tensor of ``model`` (on meta will do) and check its shape
        and dtype: a missing, misshapen or unconvertible tensor is a one-line error now, before
        anything is traced or written."""
        saved = model.state_dict(keep_vars=True)
        self._check_layer_counts(saved)
        self.converted = plan_conversions(
            model, {key: tuple(self._slice(key).get_shape()) for key in self.file_of})
        for name, tensor in saved.items():
            if name in self.converted.groups:
                self._check_converted(name, tensor)
                continue
            try:
                key = self.key_of(name)
            except ExporterError as error:
                if quantization_method(getattr(model, "config", None)) not in (None, *DEQUANTIZED_FORMATS):
                    raise ExporterError(refused_format(model.config)) from error
                raise
            found = self._slice(key)
            stored, wanted = tuple(found.get_shape()), tuple(tensor.shape)
            where = f"checkpoint tensor '{key}' in {self.folder / self.file_of[key]}"
            if stored != wanted:
                raise ExporterError(
                    f"{where} has shape {list(stored)}, the model's '{name}' needs {list(wanted)}; "
                    "is it the checkpoint of this config?"
                )
            if (found.get_dtype() in _FLOAT_DTYPES) != tensor.is_floating_point():
                raise ExporterError(
                    f"{where} is {found.get_dtype()}, which cannot become the model's {tensor.dtype} '{name}'"
                )
        self._check_tied_copies_agree()

    def _slice(self, key: str):
        return self.handles[self.file_of[key]].get_slice(key)

    def _check_converted(self, name: str, tensor: torch.Tensor) -> None:
        group = self.converted.groups[name]
        keys = group.keys
        where = f"checkpoint tensors {_names(keys, 3)} (converted by transformers into '{name}')"
        if group.shapes[name] != tuple(tensor.shape):
            raise ExporterError(f"{where} give shape {list(group.shapes[name])}, the model needs "
                                f"{list(tensor.shape)}; is it the checkpoint of this config?")
        stored = {self._slice(key).get_dtype() for key in keys}
        if not group.dequantizes and any((dtype in _FLOAT_DTYPES) != tensor.is_floating_point() for dtype in stored):
            raise ExporterError(f"{where} are {'/'.join(sorted(stored))}, which cannot become the model's "
                                f"{tensor.dtype} '{name}'")

    def _check_layer_counts(self, saved: dict[str, torch.Tensor]) -> None:
        """A config and checkpoint with different numbers of layers say so in those terms: more in
        the config would fail on a missing tensor (a config that omits num_hidden_layers gets
        transformers' default, 32 for Llama), fewer would export part of the model."""
        stored = _layer_counts(self.file_of)
        for stack, count in _layer_counts(saved).items():
            matches = [s for s in stored if s == stack] or [s for s in stored if s.endswith("." + stack.split(".", 1)[-1])]
            if len(matches) != 1 or stored[matches[0]] == count:
                continue
            config = _read_json(self.folder / "config.json")
            text = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
            hint = ("; config.json does not set num_hidden_layers, so transformers took its default"
                    if "num_hidden_layers" not in text else "")
            raise ExporterError(f"the checkpoint in {self.folder} has {stored[matches[0]]} layers under "
                                f"'{matches[0]}', the config {count}{hint}; is it the checkpoint of this config?")

    def _check_tied_copies_agree(self) -> None:
        """A tied tensor saved under two keys must hold one value: the graph reads one of them."""
        for name, names in self.aliases.items():
            keys = sorted({self.key_for[n] for n in names if n in self.key_for})
            if name != names[0] or len(keys) < 2:
                continue
            self.compared_values = True
            first = self.handles[self.file_of[keys[0]]].get_tensor(keys[0])
            for key in keys[1:]:
                if not torch.equal(first, self.handles[self.file_of[key]].get_tensor(key)):
                    raise ExporterError(
                        f"the checkpoint in {self.folder} holds different values under '{keys[0]}' and '{key}', "
                        "which the config ties into one tensor; set tie_word_embeddings to false in its "
                        "config.json to export them as two"
                    )

    def unmatched_keys(self) -> list[str]:
        """Checkpoint keys no saved tensor of the model has (a tied duplicate, the same tensor
        saved under an alias, is had), less the parts left out on purpose."""
        names = set(self.key_for) | {alias for name in self.key_for for alias in self.aliases.get(name, ())}
        had = (set(self.key_for.values()) | (names & set(self.file_of))
               | {key for name in self.converted.groups for key in self.converted.keys_of(name)})
        return sorted(set(self.file_of) - had - self.left_out)

    def unread(self, read: set[str]) -> UnreadTensors:
        # A tied tensor is read under any of its names, and every key its names have is read with it.
        read_names = {alias for name in read for alias in self.aliases.get(name, [name])}
        read_keys = ({self.key_for[name] for name in read_names if name in self.key_for} | (read_names & set(self.file_of))
                     | {key for name in read_names if name in self.converted.groups for key in self.converted.keys_of(name)})
        had = {key for name in self.converted.groups for key in self.converted.keys_of(name)} | set(self.key_for.values())
        unused = sorted(had - read_keys)
        left_out = sorted(self.left_out)
        return UnreadTensors(tuple(self.unmatched_keys()), tuple(unused), tuple(left_out), self.left_out_why)

    def key_of(self, name: str) -> str:
        if name in self.key_for:
            return self.key_for[name]
        if name in self.converted.renamed:
            self.key_for[name] = self.converted.renamed[name]
            return self.key_for[name]
        for candidate in self.aliases.get(name, [name]):
            if candidate in self.file_of:
                self.key_for[name] = candidate
                return candidate
        for candidate in self.aliases.get(name, [name]):
            tail = "." + candidate.split(".", 1)[-1]
            matches = [key for key in self.file_of if key.endswith(tail)]
            if len(matches) > 1:  # e.g. a vision tower's layers too: the text model's prefix wins
                matches = [key for key in matches if key.removesuffix(tail) == self._text_prefix()]
            if len(matches) == 1:
                self.key_for[name] = matches[0]
                return matches[0]
        raise ExporterError(
            f"the checkpoint in {self.folder} has no tensor for '{name}'; "
            "is it the checkpoint of this config?"
        )

    def _text_prefix(self) -> str | None:
        """The prefix under which most of the model's tensors sit in the checkpoint, judged by
        the names that match one key only (``model.language_model`` in a multimodal one)."""
        if not hasattr(self, "_prefix"):
            prefixes = collections.Counter()
            for name in self.aliases:
                tail = "." + name.split(".", 1)[-1]
                matches = [key for key in self.file_of if key.endswith(tail)]
                if len(matches) == 1:
                    prefixes[matches[0].removesuffix(tail)] += 1
            self._prefix = prefixes.most_common(1)[0][0] if prefixes else None
        return self._prefix

    def stored_tensor(self, name: str) -> StoredTensor | None:
        if name in self.converted.groups:
            return None
        key = self.key_of(name)
        entry = self._header(self.file_of[key])[1][key]
        return StoredTensor(self.file_of[key], key, entry["dtype"], tuple(entry["shape"]))

    def verbatim_range(self, name: str, index: Index, dtype: ir.DataType) -> FileRange | None:
        """The bytes of ``name``, or of its slice ``index``, where a checkpoint file stores them in
        ``dtype`` as they are: a tensor kept in that dtype and unconverted, whole or cut along its
        first axis only (rows are contiguous in safetensors' row-major layout)."""
        if name in self.converted.groups:
            return None
        key = self.key_of(name)
        file_name = self.file_of[key]
        data_start, header = self._header(file_name)
        entry = header[key]
        if _SAFETENSORS_IR_DTYPES.get(entry["dtype"]) != dtype:
            return None
        shape, (begin, end) = tuple(entry["shape"]), entry["data_offsets"]
        rows = _leading_rows(shape, index)
        if rows is None or end - begin != math.prod(shape) * dtype.itemsize:
            return None  # another cut, or a header that disagrees with itself: the reader judges it
        first, count = rows
        row_bytes = int(math.prod(shape[1:]) * dtype.itemsize)
        if count * row_bytes == 0:
            return None  # onnx_ir cannot read an empty range back; an empty tensor costs nothing anyway
        return FileRange((self.folder / file_name).resolve(), data_start + begin + first * row_bytes, count * row_bytes,
                         file_name)

    def _header(self, file_name: str) -> tuple[int, dict]:
        if file_name not in self._headers:
            self._headers[file_name] = read_header(self.folder / file_name)
        return self._headers[file_name]

    def tensor(self, name: str, index: Index, dtype: torch.dtype) -> torch.Tensor:
        if name in self.converted.groups:
            whole = self.converted.read(name, lambda key: self.handles[self.file_of[key]].get_tensor(key))
            return (whole if index is None else whole[index]).to(dtype)
        key = self.key_of(name)
        handle = self.handles[self.file_of[key]]
        values = handle.get_tensor(key) if index is None else handle.get_slice(key)[index]
        return values.to(dtype)


# safetensors' dtype names of the floating types (torch converts any of them to any other).
_FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


# safetensors' dtype names -> ONNX's, for the types whose bytes both store alike (little-endian).
_SAFETENSORS_IR_DTYPES = {
    "F64": ir.DataType.DOUBLE, "F32": ir.DataType.FLOAT, "F16": ir.DataType.FLOAT16, "BF16": ir.DataType.BFLOAT16,
    "I64": ir.DataType.INT64, "I32": ir.DataType.INT32, "I16": ir.DataType.INT16, "I8": ir.DataType.INT8,
    "U8": ir.DataType.UINT8,
}


IR_SAFETENSORS_DTYPES = {dtype: name for name, dtype in _SAFETENSORS_IR_DTYPES.items()}


def _leading_rows(shape: tuple[int, ...], index: Index) -> tuple[int, int] | None:
    """(first row, row count) when ``index`` keeps whole rows of a contiguous run along the first
    axis and everything along the others; None for any other cut."""
    if index is None or not shape:
        return (0, shape[0] if shape else 1)
    if not index or len(index) > len(shape) or any(s.step not in (None, 1) for s in index):
        return None
    if any(s.indices(n) != (0, n, 1) for s, n in zip(index[1:], shape[1:], strict=False)):
        return None
    start, stop, _ = index[0].indices(shape[0])
    return start, max(stop - start, 0)


def _sliced_shape(shape: tuple[int, ...], index: Index) -> tuple[int, ...]:
    if index is None:
        return shape
    index = index + (slice(None),) * (len(shape) - len(index))
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))


def account(store: WeightStore, attached: int, read: set[str], strict: bool) -> list[str]:
    """What the report says of the attached weights (of every session): how many tensors stream
    from where, and the checkpoint tensors no graph reads (an error under ``strict``)."""
    unread = store.unread(read)
    if strict and unread.unexplained:
        raise ExporterError(f"--strict: {unread.notes()[0]}")
    notes = [f"{attached} weight tensors written one at a time (never all in memory) from {store.description}",
             *unread.notes()]
    converted = getattr(store, "converted", None)
    if converted is not None and (dequantized := sorted({n for n, g in converted.groups.items() if g.dequantizes})):
        named = dequantized[0] + (", ..." if len(dequantized) > 1 else "")
        notes.append(f"{len(dequantized)} weights ({named}) dequantized from the checkpoint's "
                     f"{converted.quantization_method} "
                     "blocks by transformers' quantizer, as from_pretrained does without its kernels; the package's "
                     "precision then applies to them")
    return notes
