"""Weights that are never all in memory: trace a model whose parameters hold no data, then give
each ONNX initializer its values lazily, read or drawn when the package is written.

Gemma 4 E2B has 5.1 B parameters (20 GiB in fp32, 10 GiB in fp16); a 24 GiB machine cannot hold
them next to the traced program and their converted copies. So for a checkpoint folder (and for
``--random-weights``) the model is built with its parameters on the meta device
(``accelerate.init_empty_weights``; buffers such as rotary frequencies stay real, passes evaluate
them), traced with fake parameters, and after lowering every weight initializer becomes an
``onnx_ir.LazyTensor`` that reads its tensor from the safetensors files (only the slice a split
piece needs) or draws it, at the moment ``onnx_ir.save`` writes it. Each weight is materialised
once, at the package's precision; later lazy steps (transpose, int4 blocks) chain on it.

Initializer names are the program's state-dict targets: ``model.`` + the transformers parameter
name, and for a weight the split pass cut, ``<target>.use<U>.part<P>`` (pieces in order along
one axis).
"""

from __future__ import annotations

import collections
import contextlib
import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx_ir as ir
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from exporter.errors import ExporterError

_PIECE = re.compile(r"^(?P<source>.+)\.use(?P<use>\d+)\.part(?P<part>\d+)$")
_TARGET_PREFIX = "model."  # the trace wrapper holds the HF model as ``model``

Index = tuple[slice, ...] | None


class WeightSource(Protocol):
    description: str

    def tensor(self, name: str, index: Index, dtype: torch.dtype) -> torch.Tensor:
        """Parameter ``name`` (transformers' name), or the slice ``index`` of it, in ``dtype``."""
        ...


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build models with parameters on the meta device and real buffers."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        yield


def fake_parameters(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Swap each meta parameter for a fake CPU tensor (torch.export traces through it; tied
    parameters stay one object). Returns every parameter name's shape, aliases included."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swapped: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, parameter in list(module._parameters.items()):
            if parameter is None or parameter.device.type != "meta":
                continue
            if id(parameter) not in swapped:
                with mode:
                    fake = torch.empty(parameter.shape, dtype=parameter.dtype, device="cpu")
                swapped[id(parameter)] = torch.nn.Parameter(fake, requires_grad=False)
            module._parameters[name] = swapped[id(parameter)]
    return shapes


def has_meta_parameters(model: torch.nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


class RandomWeights:
    """What transformers' initialisation draws, without its cost: matrices ~ N(0, std), vectors
    (norm scales) ones. Each tensor's values follow from its name and slice, so a package is
    reproducible and a re-read gives the same numbers."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], std: float, seed: int = 0):
        self.shapes, self.std, self.seed = shapes, std, seed
        self.description = f"random weights (N(0, {std}) matrices, unit norm scales, seed {seed})"

    def tensor(self, name: str, index: Index, dtype: torch.dtype) -> torch.Tensor:
        shape = _sliced_shape(self.shapes[name], index)
        if len(shape) < 2:
            return torch.ones(shape, dtype=dtype)
        generator = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{name}:{index}".encode()))
        return (torch.randn(shape, generator=generator) * self.std).to(dtype)


class SafetensorsWeights:
    """A checkpoint folder's ``*.safetensors`` (sharded or not), read one tensor or slice at a time.

    A parameter is found under its own name, an alias of it (tied weights), or, for a text model
    taken out of a multimodal checkpoint, the one key that ends with the name's path below the
    top module (``model.layers.0...`` in ``model.language_model.layers.0...``).
    """

    def __init__(self, folder: Path, aliases: dict[str, list[str]]):
        from safetensors import safe_open

        self.folder, self.aliases = folder, aliases
        self.description = f"weights streamed from {folder}"
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        self.handles = {name: safe_open(str(folder / name), framework="pt") for name in files}
        self.file_of = {key: name for name, handle in self.handles.items() for key in handle.keys()}

    def key_of(self, name: str) -> str:
        for candidate in self.aliases.get(name, [name]):
            if candidate in self.file_of:
                return candidate
        for candidate in self.aliases.get(name, [name]):
            tail = "." + candidate.split(".", 1)[-1]
            matches = [key for key in self.file_of if key.endswith(tail)]
            if len(matches) > 1:  # e.g. a vision tower's layers too: the text model's prefix wins
                matches = [key for key in matches if key.removesuffix(tail) == self._text_prefix()]
            if len(matches) == 1:
                return matches[0]
        raise ExporterError(
            f"the checkpoint in {self.folder} has no tensor for parameter '{name}'; "
            "is it the checkpoint of this config?"
        )

    def _text_prefix(self) -> str | None:
        """The prefix under which most of the model's parameters sit in the checkpoint, judged by
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

    def tensor(self, name: str, index: Index, dtype: torch.dtype) -> torch.Tensor:
        key = self.key_of(name)
        handle = self.handles[self.file_of[key]]
        values = handle.get_tensor(key) if index is None else handle.get_slice(key)[index]
        return values.to(dtype)


def tied_aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """Every parameter name -> the names of the same tensor (itself first)."""
    groups: dict[int, list[str]] = collections.defaultdict(list)
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups[id(parameter)].append(name)
    return {name: [name, *(n for n in names if n != name)] for names in groups.values() for name in names}


def attach(model: ir.Model, source: WeightSource, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> int:
    """Give every fake-valued initializer a lazy tensor from ``source``; returns how many."""
    count = 0
    for name, (parameter, index) in _recipes(model, shapes).items():
        value = model.graph.initializers[name]
        placeholder = value.const_value

        def materialise(parameter=parameter, index=index, name=name) -> ir.TensorProtocol:
            return _to_ir(source.tensor(parameter, index, dtype), name)

        value.const_value = ir.LazyTensor(materialise, dtype=placeholder.dtype, shape=placeholder.shape, name=name)
        count += 1
    return count


def _recipes(model: ir.Model, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, Index]]:
    """initializer name -> (parameter name, slice of it or None)."""
    recipes: dict[str, tuple[str, Index]] = {}
    pieces: dict[tuple[str, str], list[tuple[int, str, tuple[int, ...]]]] = collections.defaultdict(list)
    for name, value in model.graph.initializers.items():
        if not _is_fake(value.const_value):
            continue
        match = _PIECE.match(name)
        if match:
            shape = tuple(value.const_value.shape.numpy())
            pieces[(match["source"], match["use"])].append((int(match["part"]), name, shape))
        else:
            recipes[name] = (_parameter_name(name, shapes), None)
    for (target, _), parts in pieces.items():
        parameter = _parameter_name(target, shapes)
        whole = shapes[parameter]
        parts.sort()
        axis = next(a for a in range(len(whole)) if parts[0][2][a] != whole[a])
        start = 0
        for _, name, shape in parts:
            recipes[name] = (parameter, (slice(None),) * axis + (slice(start, start + shape[axis]),))
            start += shape[axis]
        if start != whole[axis]:
            raise RuntimeError(f"pieces of {target} cover {start} of {whole[axis]} along axis {axis}")
    return recipes


def _parameter_name(target: str, shapes) -> str:
    name = target.removeprefix(_TARGET_PREFIX)
    if name not in shapes:
        raise RuntimeError(f"initializer {target} is no parameter of the model")
    return name


def _is_fake(tensor) -> bool:
    return isinstance(getattr(tensor, "raw", None), FakeTensor)


def _sliced_shape(shape: tuple[int, ...], index: Index) -> tuple[int, ...]:
    if index is None:
        return shape
    index = index + (slice(None),) * (len(shape) - len(index))
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))


def _to_ir(tensor: torch.Tensor, name: str) -> ir.TensorProtocol:
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits, typed
        return ir.Tensor(tensor.view(torch.uint16).numpy(), dtype=ir.DataType.BFLOAT16, name=name)
    return ir.Tensor(tensor.numpy(), name=name)


class FoldWeightTransposes(ir.passes.InPlacePass):
    """``Transpose(weight)`` whose weight feeds nothing else -> one transposed initializer, lazy
    (computed when written), so a MatMul reads its weight as stored instead of transposing it at
    every step. torch.onnx lowers linear layers that way, and constant folding leaves the
    Transpose of any weight over its size limit (every weight of a full-size model).
    ``fold_shared``: also fold a weight that has other readers (a tied LM head), storing it twice."""

    def __init__(self, fold_shared: bool = True):
        super().__init__()
        self.fold_shared = fold_shared

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, folded = model.graph, 0
        for node in list(graph):
            if node.op_type != "Transpose" or node.domain != "":
                continue
            source = node.inputs[0]
            if source is None or not source.is_initializer() or source.const_value is None or source in graph.outputs:
                continue
            shared = len(source.uses()) > 1
            if shared and not self.fold_shared:
                continue
            tensor, out = source.const_value, node.outputs[0]
            rank = len(tensor.shape)
            perm = list(node.attributes.get_ints("perm", list(reversed(range(rank)))))
            shape = ir.Shape([tensor.shape[p] for p in perm])
            name = out.name

            def transposed(tensor=tensor, perm=perm, name=name) -> ir.TensorProtocol:
                return ir.Tensor(np.ascontiguousarray(np.transpose(tensor.numpy(), perm)), name=name)

            lazy = ir.LazyTensor(transposed, dtype=tensor.dtype, shape=shape, name=name)
            replacement = ir.Value(name=name, shape=shape, type=ir.TensorType(tensor.dtype), const_value=lazy)
            out.name = None
            ir.convenience.replace_all_uses_with(out, replacement)
            graph.remove(node, safe=True)
            if not shared:
                graph.initializers.pop(source.name)
            graph.register_initializer(replacement)
            folded += 1
        return ir.passes.PassResult(model, modified=bool(folded))
