"""Weights out of the lowered graph and back: ``detach`` makes every weight initializer a placeholder (the
graph then serves any weights of its architecture, ``exporter.cache.graph_cache``), ``attach`` gives each
placeholder an ``onnx_ir.LazyTensor`` that reads its values from a weight store when the package is
written (``WeightReader``, counting its reads)."""

from __future__ import annotations

import onnx_ir as ir
import torch
from onnx_ir.tensor_adapters import to_torch_dtype

from exporter.weights.recipes import Recipes, recipes_of
from exporter.weights.stores import Index, WeightStore

# Where a weight initializer's placeholder points until ``attach`` gives it its values: a lowered
# graph holds no weight, so it serializes small and serves any checkpoint of its architecture.
WEIGHT_PLACEHOLDER = "genai-exporter:weight"


def detach(model: ir.Model, shapes: dict[str, tuple[int, ...]], names: dict[str, str] | None = None,
           real_weights: bool = False) -> Recipes:
    """Replace every weight initializer's values with a placeholder (an external tensor at
    ``WEIGHT_PLACEHOLDER``) and say where ``attach`` will read them. Weights are the fake
    initializers, and with ``real_weights`` (a model traced with its values in memory) every
    initializer that is a saved tensor of the model or a piece of one; other initializers
    (constants, non-persistent buffers) keep their values. ``shapes``: the source model's saved
    tensors; ``names``: the traced module's tensor names -> the source model's (``tensor_names``)."""
    recipes = recipes_of(model, shapes, names or {}, real_weights)
    for name in recipes:
        value = model.graph.initializers[name]
        tensor = value.const_value
        value.const_value = ir.ExternalTensor(WEIGHT_PLACEHOLDER, offset=None, length=None, dtype=tensor.dtype,
                                              shape=ir.Shape(tensor.shape.numpy()), name=name)
    return recipes


class WeightReader:
    """What an attached weight's ``LazyTensor`` calls to get its values: its recipe's tensor from
    the store, in the initializer's own dtype, read anew at each call (a pass that reads a weight,
    a transpose or int4 blocks, maps or holds it only while it reads it). ``copied_from``: the
    checkpoint range the writer copies file to file, where there is one. ``reads`` counts the
    calls, so that the export knows whether anything but the writer read the values."""

    def __init__(self, store: WeightStore, tensor_name: str, index: Index, name: str, dtype: ir.DataType,
                 shape: ir.Shape):
        self.store, self.tensor_name, self.index, self.name = store, tensor_name, index, name
        self.dtype, self.shape = dtype, shape
        self.copied_from = store.verbatim_range(tensor_name, index, dtype)
        self.stored = store.stored_tensor(tensor_name)
        self.reads = 0

    def __call__(self) -> ir.TensorProtocol:
        self.reads += 1
        if stored := self.copied_from:
            # An absolute path and no base_dir: onnx_ir's containment checks are for files a
            # model names; this one is the checkpoint's own, which may be a symlink into the
            # Hugging Face cache's blobs.
            return ir.ExternalTensor(str(stored.path), stored.offset, stored.length, self.dtype, shape=self.shape,
                                     name=self.name)
        return _to_ir(self.store.tensor(self.tensor_name, self.index, to_torch_dtype(self.dtype)), self.name)


def attach(model: ir.Model, store: WeightStore, recipes: Recipes) -> list[WeightReader]:
    """Give every placeholder initializer a lazy tensor that reads its recipe's tensor from
    ``store`` when the package is written, in the initializer's own dtype (a parameter's is the
    export's compute dtype; an integer buffer stays integer). Returns the readers, one per
    initializer (``reader.tensor_name``: the saved tensor it reads)."""
    readers = []
    for name, (tensor_name, index) in recipes.items():
        value = model.graph.initializers[name]
        placeholder = value.const_value
        if not (isinstance(placeholder, ir.ExternalTensor) and str(placeholder.location) == WEIGHT_PLACEHOLDER):
            raise RuntimeError(f"initializer {name} is not a weight placeholder")
        reader = WeightReader(store, tensor_name, index, name, placeholder.dtype, placeholder.shape)
        value.const_value = ir.LazyTensor(reader, dtype=reader.dtype, shape=reader.shape, name=name)
        readers.append(reader)
    return readers


def _to_ir(tensor: torch.Tensor, name: str) -> ir.TensorProtocol:
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits, typed
        return ir.Tensor(tensor.view(torch.uint16).numpy(), dtype=ir.DataType.BFLOAT16, name=name)
    return ir.Tensor(tensor.numpy(), name=name)
