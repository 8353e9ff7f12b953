"""Marker ops: torch.library custom ops that FX passes insert into the program.

Each has a reference kernel (so the rewritten program still runs in PyTorch and passes are tested
by running it), a fake kernel (so torch.export and torch.onnx can trace through it), and an ONNX
lowering written with onnxscript, collected in ``ONNX_TRANSLATIONS`` for ``torch.onnx.export``.
"""

from __future__ import annotations

import onnx
import torch
from onnxscript import INT32, INT64
from onnxscript import opset18 as op
from onnxscript.values import Op, Opset


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


@torch.library.custom_op("genai_exporter::group_query_attention", mutates_args=())
def group_query_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    attention_mask: torch.Tensor,
    num_heads: int,
    kv_num_heads: int,
    scale: float,
    softcap: float,
    local_window_size: int,
    cos_cache: torch.Tensor | None = None,
    sin_cache: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ONNX Runtime's ``com.microsoft.GroupQueryAttention`` (separate past and present buffers),
    with ``seqlens_k`` and ``total_sequence_length`` taken from the attention mask.

    query [batch, seq, num_heads * head], key/value [batch, new, kv_num_heads * head] (new = seq,
    or 0 for a layer that reads another layer's cache), past [batch, kv_num_heads, past, head].
    Each row's cache is compact: row b holds ``sum(attention_mask[b])`` real tokens, its past ones
    first and the new ones right after (ONNX Runtime GenAI's right padding leaves no hole). The
    queries' positions end at the row's last real token, except in a first prompt (queries as
    many as mask columns), where they start at 0 and a right-padded row's trailing queries are
    padding. A query sees the
    real keys at or before its position, the last ``local_window_size`` of them when that is > 0;
    ``softcap`` > 0 caps scores as ``softcap * tanh(scores / softcap)``. With ``cos_cache`` and
    ``sin_cache`` [max_positions, head / 2], query and new key are first rotated (transformers'
    ``rotate_half`` form) at their positions, a new key's being its slot in the row's cache.
    ONNX Runtime rejects batch > 1 with several new tokens after a past (GenAI never sends it);
    this kernel computes it anyway, for tests. Returns the attention output
    [batch, seq, num_heads * head] and the present key/value
    [batch, kv_num_heads, past + new, head].
    """
    batch, seq, _ = query.shape
    new, past, head = key.shape[1], past_key.shape[2], past_key.shape[3]
    real = attention_mask.to(torch.int64).sum(-1)  # [batch]
    # ONNX Runtime's rule: a call whose queries span the whole mask is a first prompt.
    first_prompt = seq == attention_mask.shape[1]
    start = torch.zeros_like(real) if first_prompt else (real - new).clamp(min=0)

    def present(past_tensor, new_tensor):
        out = torch.zeros(batch, kv_num_heads, past + new, head, dtype=past_tensor.dtype)
        out[:, :, :past] = past_tensor
        new_heads = new_tensor.view(batch, new, kv_num_heads, head).transpose(1, 2)
        for row in range(batch):
            out[row, :, int(start[row]) : int(start[row]) + new] = new_heads[row]
        return out

    slots = torch.arange(past + new)
    if first_prompt:
        positions = torch.arange(seq).expand(batch, seq)
    else:
        positions = real[:, None] - seq + torch.arange(seq)
    if cos_cache is not None:
        query = _rotate(query, positions, num_heads, cos_cache, sin_cache)
        key = _rotate(key, start[:, None] + torch.arange(new), kv_num_heads, cos_cache, sin_cache)
    present_key, present_value = present(past_key, key), present(past_value, value)
    visible = (slots[None, None, :] <= positions[:, :, None]) & (slots[None, None, :] < real[:, None, None])
    if local_window_size > 0:
        visible &= slots[None, None, :] > positions[:, :, None] - local_window_size
    groups = num_heads // kv_num_heads
    q = query.view(batch, seq, num_heads, head).transpose(1, 2)
    k = present_key.repeat_interleave(groups, dim=1)
    v = present_value.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query that sees no key gets 0
    output = (weights @ v).transpose(1, 2).reshape(batch, seq, num_heads * head)
    return output, present_key, present_value


def _rotate(x: torch.Tensor, positions: torch.Tensor, heads: int, cos_cache, sin_cache) -> torch.Tensor:
    """x [batch, seq, heads * head] rotated at positions [batch, seq]."""
    batch, seq, _ = x.shape
    width = x.shape[-1]
    x = x.view(batch, seq, heads, width // heads)
    cos = cos_cache[positions.clamp(0, len(cos_cache) - 1)].repeat(1, 1, 2)[:, :, None]  # [batch, seq, 1, head]
    sin = sin_cache[positions.clamp(0, len(sin_cache) - 1)].repeat(1, 1, 2)[:, :, None]
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + turned * sin).reshape(batch, seq, width)


@group_query_attention.register_fake
def _(query, key, value, past_key, past_value, attention_mask, num_heads, kv_num_heads, scale, softcap,
      local_window_size, cos_cache=None, sin_cache=None):
    shape = list(past_key.shape)
    shape[2] = past_key.shape[2] + key.shape[1]
    return query.new_empty(query.shape), past_key.new_empty(shape), past_value.new_empty(shape)


def _contrib_op(name: str, inputs: list[str], outputs: list[str], attributes: dict[str, int]) -> Op:
    """An onnxscript handle for a com.microsoft op: onnxscript has no schemas for ONNX Runtime's
    contrib ops, so the schema (inputs, outputs, attributes) is declared here."""

    def parameter(spec: str):
        name, _, type_str = spec.partition(":")
        optional = name.endswith("?")
        return onnx.defs.OpSchema.FormalParameter(
            name.rstrip("?"), type_str or "T",
            param_option=onnx.defs.OpSchema.FormalParameterOption.Optional if optional
            else onnx.defs.OpSchema.FormalParameterOption.Single,
        )

    schema = onnx.defs.OpSchema(
        name,
        "com.microsoft",
        1,
        inputs=[parameter(i) for i in inputs],
        outputs=[parameter(o) for o in outputs],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
            ("M", ["tensor(int32)"], ""),
        ],
        attributes=[onnx.defs.OpSchema.Attribute(a, t, required=False) for a, t in attributes.items()],
    )
    return Op(Opset("com.microsoft", 1), name, schema)


_ATTR = onnx.defs.OpSchema.AttrType
_GROUP_QUERY_ATTENTION = _contrib_op(
    "GroupQueryAttention",
    ["query", "key", "value", "past_key", "past_value", "seqlens_k:M", "total_sequence_length:M", "cos_cache?",
     "sin_cache?"],
    ["output", "present_key", "present_value"],
    {"num_heads": _ATTR.INT, "kv_num_heads": _ATTR.INT, "scale": _ATTR.FLOAT, "softcap": _ATTR.FLOAT,
     "local_window_size": _ATTR.INT, "do_rotary": _ATTR.INT, "rotary_interleaved": _ATTR.INT},
)


def _group_query_attention_onnx(query, key, value, past_key, past_value, attention_mask, num_heads: int,
                                kv_num_heads: int, scale: float, softcap: float, local_window_size: int,
                                cos_cache=None, sin_cache=None):
    # Identical in every layer: the ONNX common-subexpression pass keeps one copy.
    real = op.ReduceSum(op.Cast(attention_mask, to=INT64.dtype), op.Constant(value_ints=[1]), keepdims=0)
    seqlens_k = op.Cast(op.Sub(real, op.Constant(value_int=1)), to=INT32.dtype)
    total = op.Cast(op.Squeeze(op.Shape(attention_mask, start=1, end=2)), to=INT32.dtype)
    rotary = {} if cos_cache is None else {"do_rotary": 1, "rotary_interleaved": 0}
    return _GROUP_QUERY_ATTENTION(
        query, key, value, past_key, past_value, seqlens_k, total, cos_cache, sin_cache,
        num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale, softcap=softcap,
        local_window_size=local_window_size if local_window_size > 0 else -1,  # ORT: -1 = no window
        _outputs=3, **rotary,
    )


ONNX_TRANSLATIONS = {
    torch.ops.genai_exporter.last_token.default: _last_token_onnx,
    torch.ops.genai_exporter.group_query_attention.default: _group_query_attention_onnx,
}
