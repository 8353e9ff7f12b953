"""Marker ops: torch.library custom ops that FX passes insert into the program.

Each has a reference kernel (so the rewritten program still runs in PyTorch and passes are tested
by running it), a fake kernel (so torch.export and torch.onnx can trace through it), and an ONNX
lowering written with onnxscript, collected in ``ONNX_TRANSLATIONS`` for ``torch.onnx.export``.
"""

from __future__ import annotations

import torch
from onnxscript import INT64
from onnxscript import opset18 as op


@torch.library.custom_op("genai_exporter::last_token", mutates_args=())
def last_token(x: torch.Tensor, attention_mask: torch.Tensor, dim: int) -> torch.Tensor:
    """Each row's last real token along ``dim`` (the sequence axis; dim 0 is the batch).

    The last real token is the last position of the current chunk whose attention-mask entry is 1:
    the final position for unpadded or left-padded rows, and the last prompt token for the
    right-padded rows of ONNX Runtime GenAI's batched prefill. A chunk with no real token gives
    position 0.
    """
    seq = x.shape[dim]
    chunk = attention_mask[:, attention_mask.shape[1] - seq :].to(torch.int64)
    index = (chunk * torch.arange(seq, device=x.device)).amax(dim=1)  # [batch]
    index_shape = [1] * x.dim()
    index_shape[0] = x.shape[0]
    out_shape = list(x.shape)
    out_shape[dim] = 1
    return torch.gather(x, dim, index.view(index_shape).expand(out_shape))


@last_token.register_fake
def _(x: torch.Tensor, attention_mask: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = 1
    return x.new_empty(shape)


def _last_token_onnx(x, attention_mask, dim: int):
    seq = op.Shape(x, start=dim, end=dim + 1)
    total = op.Shape(attention_mask, start=1, end=2)
    chunk = op.Cast(op.Slice(attention_mask, op.Sub(total, seq), total, [1]), to=INT64.dtype)
    positions = op.Range(op.Constant(value_int=0), op.Squeeze(seq), op.Constant(value_int=1))
    index = op.ReduceMax(op.Mul(chunk, positions), [1], keepdims=0)  # [batch]
    rank = len(x.shape) if x.shape is not None else None
    if rank is None:
        raise ValueError("last_token needs a tensor of known rank")
    batch = op.Shape(x, start=0, end=1)
    ones = op.Constant(value_ints=[1] * (rank - 1))
    index = op.Reshape(index, op.Concat(batch, ones, axis=0))
    out_shape = op.ScatterElements(op.Shape(x), op.Constant(value_ints=[dim]), op.Constant(value_ints=[1]))
    return op.GatherElements(x, op.Expand(index, out_shape), axis=dim)


ONNX_TRANSLATIONS = {torch.ops.genai_exporter.last_token.default: _last_token_onnx}
