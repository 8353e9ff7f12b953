"""Where each weight initializer's bytes come from, for a replay: a checkpoint range copied as it is
(``FileRange``) or one stored tensor cut, converted and laid out by steps numpy repeats
(``DerivedWeight``); none where a pass read a weight or made one from several."""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx_ir as ir

from exporter.weights.lazy_steps import CastWeight, ReshapedWeight, TransposedWeight
from exporter.weights.placeholders import WeightReader
from exporter.weights.stores import IR_SAFETENSORS_DTYPES, FileRange, StoredTensor


@dataclass(frozen=True)
class DerivedWeight:
    """An initializer whose bytes are made from one stored checkpoint tensor by steps numpy repeats
    bit for bit: its cut ``index`` (a ``[start, stop)`` per leading axis, or None), its values in
    ``dtype`` (a safetensors dtype name: an exact widening, or a rounding to nearest even), then
    ``steps`` in order, each ``("reshape", dims)``, ``("transpose", perm)`` or ``("cast", dtype)``
    (``weights.lazy_steps``, numpy's cast in the export too)."""

    stored: StoredTensor
    index: tuple[tuple[int, int], ...] | None
    dtype: str
    steps: tuple[tuple[str, tuple[int, ...]], ...]


# Conversions a replay makes with numpy (``exporter.weights.derived_weights``) as torch does: between
# floating types, where a widening is exact and a narrowing rounds to nearest even in both.
_DERIVABLE_DTYPES = frozenset({"F32", "F16", "BF16"})


WeightOrigin = FileRange | DerivedWeight


@dataclass(frozen=True)
class WeightOrigins:
    """Each weight initializer of a model -> where its bytes come from: a checkpoint range copied as
    it is (``FileRange``), or one checkpoint tensor cut, converted and laid out by steps numpy
    repeats (``DerivedWeight``). ``origins`` is None where a weight's bytes depend on more than
    that (``why_not``)."""

    origins: dict[str, WeightOrigin] | None
    why_not: str | None = None


def weight_origins(model: ir.Model, readers: list[WeightReader]) -> WeightOrigins:
    """Where each weight initializer of ``model`` comes from, where no weight was read by a pass
    (which may have decided the graph or made another tensor from it) and every initializer made
    when written is one stored tensor, cut, converted, reshaped or transposed (a folded transpose:
    ``onnx_passes.fold_weight_transposes``). Called after the passes, before writing."""
    for reader in readers:
        if reader.reads:
            return WeightOrigins(None, f"weight {reader.name} was read by a pass before the package was written")
    origins: dict[str, WeightOrigin] = {}
    for name, value in model.graph.initializers.items():
        if not isinstance(value.const_value, ir.LazyTensor):
            continue
        chain = made_from(value.const_value)
        if chain is None:
            return WeightOrigins(None, f"initializer {name} is made from weights when written in a way a replay "
                                       "does not repeat (such as int4 blocks)")
        reader, steps = chain
        if reader is None:
            continue  # a constant, transposed: no weight decides its bytes
        origin = _origin(reader, steps)
        if origin is None:
            return WeightOrigins(None, f"weight {reader.name} is made from the checkpoint in a way a replay does "
                                       "not repeat (a non-float conversion, several stored tensors, or empty)")
        origins[name] = origin
    return WeightOrigins(origins)


def made_from(tensor: ir.TensorProtocol) -> tuple[WeightReader | None, tuple] | None:
    """The weight reader a lazy initializer's chain starts from (None for a constant) and the
    folded steps applied to it in order; None for any other lazy tensor."""
    steps = []
    while isinstance(tensor, ir.LazyTensor):
        made = tensor.raw
        if isinstance(made, WeightReader):
            return made, tuple(reversed(steps))
        if isinstance(made, TransposedWeight):
            steps.append(("transpose", tuple(made.perm)))
        elif isinstance(made, ReshapedWeight):
            steps.append(("reshape", tuple(made.dims)))
        elif isinstance(made, CastWeight) and made.dtype in IR_SAFETENSORS_DTYPES:
            steps.append(("cast", IR_SAFETENSORS_DTYPES[made.dtype]))
        else:
            return None
        tensor = made.tensor
    return None, tuple(reversed(steps))


def _origin(reader: WeightReader, steps: tuple) -> WeightOrigin | None:
    if reader.copied_from is not None and not steps:
        return reader.copied_from
    stored, dtype = reader.stored, IR_SAFETENSORS_DTYPES.get(reader.dtype)
    if stored is None or dtype is None or math.prod(reader.shape.numpy()) == 0:
        return None
    if stored.dtype != dtype and not {stored.dtype, dtype} <= _DERIVABLE_DTYPES:
        return None
    index = None
    if reader.index is not None:
        index = tuple(s.indices(n)[:2] for s, n in zip(reader.index, stored.shape, strict=False))
        if any(s.step not in (None, 1) for s in reader.index):
            return None
    return DerivedWeight(stored, index, dtype, steps)
