"""A weight a replay makes with numpy from one stored checkpoint tensor, bit for bit as the export
made it with torch (``weights.DerivedWeight``): a cut, a conversion between floating types, then
reshapes and transposes.

Why numpy's bytes are torch's: bf16 to fp32 shifts the bits in both; every other conversion
between fp32, fp16 and bf16 (fp16 to fp32 exactly; fp32 to fp16, bf16 to fp16, fp32 to bf16
rounded to nearest even) gives the same bits in both for every value but a NaN, overflow to
infinity, subnormals and signed zeros included; a cut, a reshape and a transpose move bytes. A NaN
converted by any of those may differ: torch's NaN bytes depend on the pair (and for fp16 to fp32
on the path: one canonical NaN on the scalar one, the quiet bit set on the vector one), and
numpy's differ from them. So a weight with one is refused (``NotRepeatable``) and the command
exports instead. A record checks
every derived weight against the package the export wrote before it keeps it
(``exporter.cache.replay``). Imports numpy and ml_dtypes only: a replay imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np

# safetensors' dtype names -> numpy's (bfloat16 is ml_dtypes', as onnx_ir has it).
NUMPY_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
}
# (stored, made) pairs that numpy converts as torch does for every value, NaN included.
_EXACT = frozenset({("BF16", "F32")})
_CHUNK_BYTES = 64 << 20


class NotRepeatable(Exception):
    """A weight whose bytes numpy would not make as torch did (a NaN converted)."""


def derived_length(entry: dict[str, Any], derive: dict[str, Any]) -> int:
    """The bytes of the weight ``derive`` makes from the stored tensor ``entry`` (a safetensors
    header entry); raises where its cut does not fit the tensor."""
    shape = list(entry["shape"])
    if derive["index"] is not None:
        if len(derive["index"]) > len(shape):
            raise ValueError("the cut has more axes than the tensor")
        for axis, (start, stop) in enumerate(derive["index"]):
            if not 0 <= start <= stop <= shape[axis]:
                raise ValueError("the cut does not fit the tensor")
            shape[axis] = stop - start
    return math.prod(shape) * NUMPY_DTYPES[_made_dtype(derive)].itemsize


def _made_dtype(derive: dict[str, Any]) -> str:
    return next((argument for step, argument in reversed(derive["steps"]) if step == "cast"), derive["to"])


def derived_chunks(file: BinaryIO, data_start: int, entry: dict[str, Any], derive: dict[str, Any]) -> Iterator[np.ndarray]:
    """The weight ``derive`` makes from the stored tensor ``entry`` of the open safetensors
    ``file`` (whose data starts at ``data_start``), in order, as flat arrays of its bytes (uint8)
    of about 64 MiB at most (so a table of several GiB is never in memory whole)."""
    begin, _ = entry["data_offsets"]
    stored_dtype = NUMPY_DTYPES[entry["dtype"]]
    count = math.prod(entry["shape"])
    view = np.memmap(file, dtype=stored_dtype, mode="r", offset=data_start + begin, shape=(count,))
    view = view.reshape(entry["shape"])
    if derive["index"] is not None:
        view = view[tuple(slice(start, stop) for start, stop in derive["index"])]
    casts = []  # elementwise, so they commute with the layout steps; in their own order
    for step, argument in derive["steps"]:
        if step == "cast":
            casts.append(NUMPY_DTYPES[argument])
        else:
            view = view.reshape(argument) if step == "reshape" else view.transpose(argument)
    if view.ndim == 0:
        view = view.reshape(1)
    converted = NUMPY_DTYPES[derive["to"]]
    # torch made the first conversion; the casts are numpy's in the export too.
    exact = entry["dtype"] == derive["to"] or (entry["dtype"], derive["to"]) in _EXACT
    widest = max([converted.itemsize, *(cast.itemsize for cast in casts)])
    rows = max(1, _CHUNK_BYTES // max(1, math.prod(view.shape[1:]) * widest))
    for start in range(0, view.shape[0], rows):
        with np.errstate(over="ignore"):  # values past fp16's range become infinities, as in torch
            chunk = view[start:start + rows].astype(converted, order="C")
            if not exact and np.isnan(chunk).any():
                raise NotRepeatable(f"it holds a NaN, which numpy and torch may convert from {entry['dtype']} "
                                    f"to {derive['to']} to different bytes")
            for cast in casts:
                chunk = chunk.astype(cast)
        yield chunk.reshape(-1).view(np.uint8)
