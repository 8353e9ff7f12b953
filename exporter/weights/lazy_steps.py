"""The steps a lazy initializer applies to the tensor it is made from when the package is written:
a weight's layout (transposed, reshaped), its dtype (a cast) and the residual stream's power-of-two
scale. ONNX passes put them on weights without reading them (``onnx_passes.fold_weight_transposes``,
``weight_folds``, ``scale_residual_stream``); a replay (``exporter.cache.replay``) and the
quantizer's checkpoint names follow them back to the stored tensor (``exporter.weights.origins.made_from``).
Each is equal only to itself: it never compares tensors."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import onnx_ir as ir
import torch


@dataclasses.dataclass(frozen=True, eq=False)  # equal only to itself: never compares tensors
class TransposedWeight:
    """What a folded ``Transpose(weight)``'s lazy initializer calls when written: ``tensor`` (the
    weight's own lazy tensor, or a constant) in the ``perm`` layout. A replay repeats it
    (``exporter.cache.replay``), so it says what it does."""

    tensor: ir.TensorProtocol
    perm: tuple[int, ...]
    name: str

    def __call__(self) -> ir.TensorProtocol:
        return ir.Tensor(_transposed(self.tensor.numpy(), list(self.perm)), name=self.name)


@dataclasses.dataclass(frozen=True, eq=False)  # equal only to itself: never compares tensors
class ReshapedWeight:
    """What a folded ``Reshape(weight)``'s lazy initializer calls when written: ``tensor`` in
    ``dims``."""

    tensor: ir.TensorProtocol
    dims: tuple[int, ...]
    name: str

    def __call__(self) -> ir.TensorProtocol:
        return ir.Tensor(np.ascontiguousarray(self.tensor.numpy().reshape(self.dims)), name=self.name)


def _transposed(array: np.ndarray, perm: list[int]) -> np.ndarray:
    """A contiguous copy in the ``perm`` layout. torch copies it blocked and on every intra-op
    thread, about 3x numpy's single-threaded strided copy (42 vs 127 ms per 64 MiB on 2 cores). It
    moves the elements as unsigned integers of their size, so every dtype (ml_dtypes' bfloat16,
    float8) takes that path and its bits stay exact."""
    if array.dtype.itemsize in (1, 2, 4, 8) and array.dtype.isnative and all(s >= 0 for s in array.strides):
        with warnings.catch_warnings():  # a memory-mapped weight is read-only; it is only read here
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
            source = torch.from_numpy(array.view(f"u{array.dtype.itemsize}"))
        return source.permute(perm).contiguous().numpy().view(array.dtype)
    return np.ascontiguousarray(np.transpose(array, perm))


@dataclasses.dataclass(frozen=True, eq=False)  # equal only to itself: never compares tensors
class CastWeight:
    """What a folded ``Cast(weight)``'s lazy initializer calls when written: ``tensor`` (a weight's
    lazy tensor) in ``dtype``, rounded to nearest even where it narrows."""

    tensor: ir.TensorProtocol
    dtype: ir.DataType
    name: str

    def __call__(self) -> ir.TensorProtocol:
        with np.errstate(over="ignore"):  # past fp16's range: infinities, as a cast at run time gives
            return ir.Tensor(self.tensor.numpy().astype(self.dtype.numpy()), name=self.name)


@dataclasses.dataclass(frozen=True, eq=False)
class ScaledWeight:
    """What a scaled initializer's lazy tensor calls when written: ``tensor`` times ``2**exponent``
    in its own dtype (exact but where a value leaves the dtype's normal range)."""

    tensor: ir.TensorProtocol
    exponent: int
    name: str

    def __call__(self) -> ir.TensorProtocol:
        values = self.tensor.numpy()
        with np.errstate(over="ignore", under="ignore"):  # in its dtype: no float32 copy of a large table
            scaled = values * values.dtype.type(2.0 ** self.exponent)
        return ir.Tensor(scaled, name=self.name)
