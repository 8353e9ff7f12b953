"""How each weight initializer of a lowered graph is made from the checkpoint (``Recipes``: the saved
tensor and the slice a split piece reads), kept with a cached graph as JSON."""

from __future__ import annotations

import collections
import re

import onnx_ir as ir
from torch._subclasses.fake_tensor import FakeTensor

from exporter.weights.stores import Index

_PIECE = re.compile(r"^(?P<source>.+)\.use(?P<use>\d+)\.part(?P<part>\d+)$")


_TARGET_PREFIX = "model."  # the trace wrapper holds the HF model as ``model``


# initializer name -> (saved tensor name, slice of it or None): where ``attach`` reads its values.
Recipes = dict[str, tuple[str, Index]]


def recipes_to_json(recipes: Recipes) -> dict[str, list]:
    return {name: [tensor_name, None if index is None else [[s.start, s.stop] for s in index]]
            for name, (tensor_name, index) in recipes.items()}


def recipes_from_json(data: dict[str, list]) -> Recipes:
    return {name: (tensor_name, None if index is None else tuple(slice(start, stop) for start, stop in index))
            for name, (tensor_name, index) in data.items()}


def recipes_of(model: ir.Model, shapes: dict[str, tuple[int, ...]], names: dict[str, str],
             real_weights: bool) -> Recipes:
    recipes: Recipes = {}
    pieces: dict[tuple[str, str], list[tuple[int, str, tuple[int, ...]]]] = collections.defaultdict(list)
    for name, value in model.graph.initializers.items():
        if value.const_value is None:
            continue
        if not _is_fake(value.const_value) and not (real_weights and _is_saved_tensor(name, shapes, names)):
            continue
        match = _PIECE.match(name)
        if match:
            shape = tuple(value.const_value.shape.numpy())
            pieces[(match["source"], match["use"])].append((int(match["part"]), name, shape))
        else:
            recipes[name] = (_tensor_name(name, shapes, names), None)
    for (target, _), parts in pieces.items():
        tensor_name = _tensor_name(target, shapes, names)
        whole = shapes[tensor_name]
        parts.sort()
        axis = next(a for a in range(len(whole)) if parts[0][2][a] != whole[a])
        start = 0
        for _, name, shape in parts:
            recipes[name] = (tensor_name, (slice(None),) * axis + (slice(start, start + shape[axis]),))
            start += shape[axis]
        if start != whole[axis]:
            raise RuntimeError(f"pieces of {target} cover {start} of {whole[axis]} along axis {axis}")
    return recipes


def _is_saved_tensor(name: str, shapes, names: dict[str, str]) -> bool:
    match = _PIECE.match(name)
    return _saved_name(match["source"] if match else name, names) in shapes


def _saved_name(target: str, names: dict[str, str]) -> str:
    """The source model's name of a program's state-dict target."""
    name = target.removeprefix(_TARGET_PREFIX)
    return names.get(name, name)


def _tensor_name(target: str, shapes, names: dict[str, str]) -> str:
    name = _saved_name(target, names)
    if name not in shapes:
        raise RuntimeError(f"initializer {target} is no saved tensor of the model")
    return name


def _is_fake(tensor) -> bool:
    return isinstance(getattr(tensor, "raw", None), FakeTensor)
