"""Marker ops: torch.library custom ops that FX passes insert into the program.

Each has a reference kernel (so the rewritten program still runs in PyTorch and passes are tested
by running it), a fake kernel (so torch.export and torch.onnx can trace through it), and an ONNX
lowering written with onnxscript, collected in ``ONNX_TRANSLATIONS`` for ``torch.onnx.export``.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import torch
from onnxscript import FLOAT, INT32, INT64
from onnxscript import opset18 as op
from onnxscript.values import Op, Opset

# The device-side forms (sliding_window_slots, last_token by position ids) count tokens and compare
# position ids in float32 (the WebGPU EP does no int64 arithmetic), exact up to here: the export
# refuses a longer context where it writes them.
FLOAT32_COUNT_LIMIT = 2**24


@torch.library.custom_op("genai_exporter::last_token", mutates_args=())
def last_token(x: torch.Tensor, attention_mask: torch.Tensor, dim: int,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's last real token along ``dim`` (the sequence axis; dim 0 is the batch).

    The last real token is the last position of the current chunk whose attention-mask entry is 1:
    the final position for unpadded or left-padded rows, and the last prompt token for the
    right-padded rows of ONNX Runtime GenAI's batched prefill. A chunk with no real token gives
    position 0.

    ``position_ids``: a graph-captured decoder's form, whose attention mask is a zero-padded
    buffer of max_length columns and whose ONNX form may do no shape arithmetic (it would run on
    the CPU). The last real token is then the first position holding the row's largest position
    id: ONNX Runtime GenAI numbers a row's real tokens by the count of real tokens before them and
    gives right-padding tokens (the only padding its tokenizer makes) position 0. A left-padded row
    with one real token is misread (its padding looks like that token: all 0); the ONNX form
    compares float32 ids, exact below 2**24 (the export caps a captured max_length there).
    """
    if position_ids is not None:
        at_top = position_ids == position_ids.amax(dim=1, keepdim=True)
        index = at_top.to(torch.int64).argmax(dim=1)  # the first of equal maxima
    else:
        seq = x.shape[dim]
        chunk = attention_mask[:, attention_mask.shape[1] - seq :].to(torch.int64)
        index = (chunk * torch.arange(seq, device=x.device)).amax(dim=1)  # [batch]
    index_shape = [1] * x.dim()
    index_shape[0] = x.shape[0]
    out_shape = list(x.shape)
    out_shape[dim] = 1
    return torch.gather(x, dim, index.view(index_shape).expand(out_shape))


@last_token.register_fake
def _(x: torch.Tensor, attention_mask: torch.Tensor, dim: int,
      position_ids: torch.Tensor | None = None) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = 1
    return x.new_empty(shape)


def _last_token_onnx(x, attention_mask, dim: int, position_ids=None):
    rank = len(x.shape) if x.shape is not None else None
    if rank is None:
        raise ValueError("last_token needs a tensor of known rank")
    if position_ids is not None:
        return _last_token_by_position_onnx(x, position_ids, dim, rank)
    seq = op.Shape(x, start=dim, end=dim + 1)
    total = op.Shape(attention_mask, start=1, end=2)
    chunk = op.Cast(op.Slice(attention_mask, op.Sub(total, seq), total, [1]), to=INT64.dtype)
    positions = op.Range(op.Constant(value_int=0), op.Squeeze(seq), op.Constant(value_int=1))
    index = op.ReduceMax(op.Mul(chunk, positions), [1], keepdims=0)  # [batch]
    batch = op.Shape(x, start=0, end=1)
    ones = op.Constant(value_ints=[1] * (rank - 1))
    index = op.Reshape(index, op.Concat(batch, ones, axis=0))
    out_shape = op.ScatterElements(op.Shape(x), op.Constant(value_ints=[dim]), op.Constant(value_ints=[1]))
    return op.GatherElements(x, op.Expand(index, out_shape), axis=dim)


def _last_token_by_position_onnx(x, position_ids, dim: int, rank: int):
    """In the form the WebGPU EP runs entirely on the device and captures (as
    ``sliding_window_slots``'s): float32 position ids (exact below 2**24) through int32, the first
    maximum found with CumSum, the token picked by Where and a ReduceSum over the sequence axis.
    Integers (position ids) and booleans are picked as float32 (exact below 2**24 too): ReduceSum
    takes no booleans, and WebGPU sums no int64."""
    f32 = FLOAT.dtype
    positions = op.Cast(op.Cast(position_ids, to=INT32.dtype), to=f32)  # WebGPU casts no int64 to float
    at_top = op.Equal(positions, op.ReduceMax(positions, [1], keepdims=1))
    first = op.And(at_top, op.Equal(op.CumSum(op.Cast(at_top, to=f32), op.Constant(value_int=1)),
                                    op.Constant(value_float=1.0)))  # [batch, seq]
    if other_axes := [axis for axis in range(1, rank) if axis != dim]:
        first = op.Unsqueeze(first, other_axes)
    dtype = getattr(x, "dtype", None)
    if dtype in _FLOATS:
        return op.ReduceSum(op.Where(first, x, op.CastLike(0, x)), [dim], keepdims=1)
    if dtype not in (ir.DataType.BOOL, ir.DataType.INT64, ir.DataType.INT32):
        raise ValueError(f"last_token by position ids takes float, integer or bool tensors, not {dtype}")
    values = op.Cast(op.Cast(x, to=INT32.dtype) if dtype == ir.DataType.INT64 else x, to=f32)
    picked = op.ReduceSum(op.Where(first, values, op.Constant(value_float=0.0)), [dim], keepdims=1)
    if dtype == ir.DataType.INT64:
        picked = op.Cast(picked, to=INT32.dtype)
    return op.Cast(picked, to=dtype)


_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)


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
    head_sink: torch.Tensor | None = None,
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
    ``head_sink`` [num_heads]: a logit per head that joins each softmax's denominator (a column of
    scores whose weight reaches no value; gpt-oss's learned sinks). ONNX Runtime rejects batch > 1 with several new tokens after a past (GenAI never sends it);
    this kernel computes it anyway, for tests. Returns the attention output
    [batch, seq, num_heads * head] and the present key/value
    [batch, kv_num_heads, past + new, head]. (Where nobody reads the present, a KV-shared layer's,
    the ONNX node can be written without it: ``exporter.onnx_passes.omit_unread_presents``; on one
    query per row, as MatMul/Softmax: ``exporter.onnx_passes.matmul_kv_shared_attention``.)
    """
    batch, seq, _ = query.shape
    new, past, head = key.shape[1], past_key.shape[2], past_key.shape[3]
    real = attention_mask.to(torch.int64).sum(-1)  # [batch]
    # ONNX Runtime's rule: a call whose queries span total_sequence_length (the longest row's
    # real tokens, see the lowering) is a first prompt.
    first_prompt = seq == int(real.max())
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
    output = _attend(query, present_key, present_value, visible, num_heads, scale, softcap, head_sink)
    return output, present_key, present_value


def _attend(query, keys, values, visible, num_heads: int, scale: float, softcap: float,
            head_sink: torch.Tensor | None = None) -> torch.Tensor:
    """query [batch, seq, num_heads * head] over keys/values [batch, kv_heads, slots, head] where
    ``visible`` [batch, seq, slots]; query head h reads KV head h // (num_heads / kv_heads), and
    ``head_sink[h]`` joins its softmax's denominator."""
    batch, seq, _ = query.shape
    head = keys.shape[3]
    groups = num_heads // keys.shape[1]
    q = query.view(batch, seq, num_heads, head).transpose(1, 2)
    k = keys.repeat_interleave(groups, dim=1)
    v = values.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    if head_sink is not None:
        sink = head_sink.to(scores.dtype).view(1, num_heads, 1, 1).expand(*scores.shape[:3], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query that sees no key gets 0
    return (weights @ v).transpose(1, 2).reshape(batch, seq, num_heads * head)


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
      local_window_size, cos_cache=None, sin_cache=None, head_sink=None):
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
            ("P", ["tensor(int64)"], ""),
        ],
        attributes=[onnx.defs.OpSchema.Attribute(a, t, required=False) for a, t in attributes.items()],
    )
    return Op(Opset("com.microsoft", 1), name, schema)


_ATTR = onnx.defs.OpSchema.AttrType
_GROUP_QUERY_ATTENTION = _contrib_op(
    "GroupQueryAttention",
    ["query", "key", "value", "past_key", "past_value", "seqlens_k:M", "total_sequence_length:M", "cos_cache?",
     "sin_cache?", "position_ids?:P", "attention_bias?", "head_sink?"],
    ["output", "present_key", "present_value"],
    {"num_heads": _ATTR.INT, "kv_num_heads": _ATTR.INT, "scale": _ATTR.FLOAT, "softcap": _ATTR.FLOAT,
     "local_window_size": _ATTR.INT, "do_rotary": _ATTR.INT, "rotary_interleaved": _ATTR.INT},
)


def _group_query_attention_onnx(query, key, value, past_key, past_value, attention_mask, num_heads: int,
                                kv_num_heads: int, scale: float, softcap: float, local_window_size: int,
                                cos_cache=None, sin_cache=None, head_sink=None):
    # Identical in every layer: the ONNX common-subexpression pass keeps one copy. In int32 and
    # without Shape, so the EP runs it on the device (graph capture needs that): the total length
    # is the longest row's real tokens, which is the mask's width for ONNX Runtime GenAI's batches
    # (their longest row is unpadded) and the right length for its zero-padded mask buffer under
    # graph capture.
    real = op.ReduceSum(op.Cast(attention_mask, to=INT32.dtype), op.Constant(value_ints=[1]), keepdims=0)
    seqlens_k = op.Sub(real, op.Constant(value=onnx.helper.make_tensor("one", onnx.TensorProto.INT32, [], [1])))
    total = op.ReduceMax(real, keepdims=0)
    rotary = {} if cos_cache is None else {"do_rotary": 1, "rotary_interleaved": 0}
    sink = () if head_sink is None else (None, None, head_sink)
    return _GROUP_QUERY_ATTENTION(
        query, key, value, past_key, past_value, seqlens_k, total, cos_cache, sin_cache, *sink,
        num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale, softcap=softcap,
        local_window_size=local_window_size if local_window_size > 0 else -1,  # ORT: -1 = no window
        _outputs=3, **rotary,
    )


@torch.library.custom_op("genai_exporter::rotary_embedding", mutates_args=())
def rotary_embedding(x: torch.Tensor, position_ids: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                     num_heads: int) -> torch.Tensor:
    """ONNX Runtime's ``com.microsoft.RotaryEmbedding``, non-interleaved (transformers'
    ``rotate_half`` form): x [batch, seq, num_heads * head] rotated at position_ids [batch, seq]
    with the caches GroupQueryAttention takes ([max_positions, head / 2])."""
    return _rotate(x, position_ids, num_heads, cos_cache, sin_cache)


@rotary_embedding.register_fake
def _(x, position_ids, cos_cache, sin_cache, num_heads):
    return x.new_empty(x.shape)


@torch.library.custom_op("genai_exporter::sliding_window_slots", mutates_args=())
def sliding_window_slots(
    query: torch.Tensor,
    attention_mask: torch.Tensor,
    window: int,
    kv_num_heads: int,
    head_size: int,
    groups: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KV-buffer slots a chunk of queries can see through a sliding window, for
    ``window_attention``: computed once per step and shared by every sliding layer with this
    window and head layout, so each layer attends over ``span = seq + window - 1`` slots, not the
    whole buffer (under graph capture ONNX Runtime GenAI's buffer has max_length slots).

    query [batch, seq, ...] (only its shape is read); the KV buffers are as GroupQueryAttention
    leaves them: each row compact, real tokens first (``sum(attention_mask[b])`` = real_b of
    them). Query i of row b is at position ``i + max(real_b - seq, 0)``: the row's last ``seq``
    tokens, or from 0 in a right-padded first prompt. It sees slots j with
    ``position - window < j <= position`` and ``j < real_b``, all of which lie in the span of
    slots from ``max(real_b - seq - window + 1, 0)``.

    Returns the span's slots clamped into the row's real tokens, int32, expanded to
    [batch, kv_num_heads, span, head_size] for GatherElements, and a score bias
    [batch, seq, groups, span] in the query's dtype, one row per query head of a KV head
    (``groups`` = num_heads / kv_num_heads): 0 where the query sees the span slot, a large
    negative where it does not (a slot clamped onto another is hidden, so none counts twice).
    The bias is a number, not a boolean, because the WebGPU EP slices no booleans (the
    last-token passes cut its query axis).
    """
    batch, seq = query.shape[:2]
    real = attention_mask.to(torch.int64).sum(-1)  # [batch]
    span = seq + window - 1
    slots = (real - seq - window + 1).clamp(min=0)[:, None] + torch.arange(span)  # [batch, span]
    positions = (real - seq).clamp(min=0)[:, None] + torch.arange(seq)  # [batch, seq]
    distance = positions[:, :, None] - slots[:, None, :]
    visible = (distance >= 0) & (distance < window) & (slots[:, None, :] < real[:, None, None])
    gathered = torch.minimum(slots, (real - 1).clamp(min=0)[:, None]).to(torch.int32)
    index = gathered[:, None, :, None].expand(batch, kv_num_heads, span, head_size).contiguous()
    bias = torch.zeros(visible.shape, dtype=query.dtype).masked_fill(~visible, hidden_score_bias(query.dtype))
    return index, bias[:, :, None].expand(batch, seq, groups, span).contiguous()


def hidden_score_bias(dtype) -> float:
    """Half the dtype's lowest finite value: added to a score, it stays finite, and its weight is
    0 beside any visible score while scores stay far below half the dtype's range (Gemma 4's
    normed queries and keys, soft-capped Gemma 2)."""
    return torch.finfo(dtype).min / 2


@sliding_window_slots.register_fake
def _(query, attention_mask, window, kv_num_heads, head_size, groups):
    batch, seq = query.shape[:2]
    span = seq + window - 1
    return (query.new_empty((batch, kv_num_heads, span, head_size), dtype=torch.int32),
            query.new_empty((batch, seq, groups, span)))


def _sliding_window_slots_onnx(query, attention_mask, window: int, kv_num_heads: int, head_size: int, groups: int):
    """In the form the WebGPU EP runs entirely on the device and captures (measured on
    onnxruntime-ep-webgpu 0.4.0): counts made with CumSum over ones instead of Shape/Range,
    constant Reshape and Expand targets, no int64 arithmetic. Counts are float32, exact far past
    any context (fp16 would stop at 2048)."""
    f32 = FLOAT.dtype
    one = op.Constant(value_float=1.0)
    # The mask through int32 (as GroupQueryAttention's lowering casts it): WebGPU casts no int64 to float.
    mask = op.Cast(op.Cast(attention_mask, to=INT32.dtype), to=f32)
    real = op.Unsqueeze(op.ReduceSum(mask, [1], keepdims=1), [2])  # [batch, 1, 1]
    # Ones over the chunk's queries [batch, seq, 1], made without reading the query's values.
    query_column = op.Slice(query, [0], [1], [2])
    ones = op.Cast(op.Not(op.Greater(query_column, query_column)), to=f32)
    seq = op.ReduceSum(ones, [1], keepdims=1)  # [batch, 1, 1]
    position = op.Add(op.Sub(seq, op.CumSum(ones, op.Constant(value_int=1), reverse=1)), op.Relu(op.Sub(real, seq)))
    # The span's offsets 0 .. seq + window - 2: seq ones (one batch row's) then window - 1 more.
    span_ones = op.Reshape(op.Slice(ones, [0], [1], [0]), [-1])
    if window > 1:
        span_ones = op.Concat(span_ones, op.Constant(value_floats=[1.0] * (window - 1)), axis=0)
    offsets = op.Reshape(op.Sub(op.CumSum(span_ones, op.Constant(value_int=0)), one), [1, 1, -1])
    slots = op.Add(op.Relu(op.Sub(op.Sub(real, seq), op.Constant(value_float=float(window - 1)))), offsets)
    distance = op.Sub(position, slots)  # [batch, seq, span]
    visible = op.And(
        op.And(op.GreaterOrEqual(distance, op.Constant(value_float=0.0)),
               op.Less(distance, op.Constant(value_float=float(window)))),
        op.Less(slots, real),
    )
    gathered = op.Min(slots, op.Relu(op.Sub(real, one)))  # [batch, 1, span]
    index = op.Cast(op.Unsqueeze(gathered, [3]), to=INT32.dtype)  # [batch, 1, span, 1]
    index = op.Expand(index, op.Constant(value_ints=[1, kv_num_heads, 1, head_size]))
    hidden = op.CastLike(hidden_score_bias(_torch_dtype(query)), query)
    bias = op.Unsqueeze(op.Where(visible, op.CastLike(0.0, query), hidden), [2])  # [batch, seq, 1, span]
    if groups > 1:
        bias = op.Expand(bias, op.Constant(value_ints=[1, 1, groups, 1]))
    return index, bias


def _torch_dtype(value) -> torch.dtype:
    dtypes = {ir.DataType.FLOAT: torch.float32, ir.DataType.FLOAT16: torch.float16,
              ir.DataType.BFLOAT16: torch.bfloat16}
    if getattr(value, "dtype", None) not in dtypes:  # a wrong guess would make the bias -inf, and hidden rows NaN
        raise ValueError(f"sliding_window_slots needs a float query of known dtype, not {getattr(value, 'dtype', None)}")
    return dtypes[value.dtype]


@torch.library.custom_op("genai_exporter::window_attention", mutates_args=())
def window_attention(
    query: torch.Tensor,
    key_buffer: torch.Tensor,
    value_buffer: torch.Tensor,
    slot_index: torch.Tensor,
    score_bias: torch.Tensor,
    num_heads: int,
    scale: float,
    softcap: float,
    head_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sliding-window attention of rotated queries over the KV-buffer slots
    ``sliding_window_slots`` picked, for EPs whose GroupQueryAttention ignores
    ``local_window_size`` in some calls (a profile's ``sliding_window = "explicit_mask"``).

    query [batch, seq, num_heads * head] (already rotated); key/value buffers
    [batch, kv_num_heads, slots, head]; slot_index [batch, kv_num_heads, span, head] and
    score_bias [batch, seq, groups, span] from ``sliding_window_slots``; ``head_sink`` as for
    ``group_query_attention``. Returns [batch, seq, num_heads * head].
    """
    index = slot_index.to(torch.int64)
    keys, values = torch.gather(key_buffer, 2, index), torch.gather(value_buffer, 2, index)
    return _attend(query, keys, values, score_bias[:, :, 0] == 0, num_heads, scale, softcap, head_sink)


@window_attention.register_fake
def _(query, key_buffer, value_buffer, slot_index, score_bias, num_heads, scale, softcap, head_sink=None):
    return query.new_empty(query.shape)


_ROTARY_EMBEDDING = _contrib_op(
    "RotaryEmbedding", ["input", "position_ids:P", "cos_cache", "sin_cache"], ["output"],
    {"interleaved": _ATTR.INT, "num_heads": _ATTR.INT},
)


def _rotary_embedding_onnx(x, position_ids, cos_cache, sin_cache, num_heads: int):
    return _ROTARY_EMBEDDING(x, position_ids, cos_cache, sin_cache, interleaved=0, num_heads=num_heads)


def _window_attention_onnx(query, key_buffer, value_buffer, slot_index, score_bias, num_heads: int, scale: float,
                           softcap: float, head_sink=None):
    """GatherElements of the window's slots, then MatMul/Softmax over them with the window's
    score bias added. Each KV head takes its group of query heads as extra query rows, in the
    order the bias already has (token, group), so one KV head (Gemma 4's sliding layers) needs
    no Transpose of the query or the output. Every gathered slot holds a real token (the
    indices are clamped into them), so no unused buffer slot's content reaches a score.

    ONNX Runtime's MultiHeadAttention would be one kernel, but onnxruntime-ep-webgpu 0.4.0's
    gives wrong results from 32 query rows on (measured on lavapipe against its CPU kernel,
    with and without an attention bias), and GroupQueryAttention refuses a batch of several
    tokens after a past, which the span is."""
    shape = key_buffer.shape
    kv_num_heads, head = (shape[1], shape[3]) if shape is not None else (None, None)
    if not isinstance(kv_num_heads, int) or not isinstance(head, int):
        raise ValueError("window_attention needs static KV heads and head size")
    groups = num_heads // kv_num_heads
    keys = op.GatherElements(key_buffer, slot_index, axis=2)  # [batch, kv, span, head]
    values = op.GatherElements(value_buffer, slot_index, axis=2)
    # Query rows (token, group) per KV head: [batch, kv, seq * groups, head].
    if kv_num_heads == 1:
        rows = op.Reshape(query, [0, 1, -1, head])
    else:
        rows = op.Transpose(op.Reshape(query, [0, 0, kv_num_heads, groups, head]), perm=[0, 2, 1, 3, 4])
        rows = op.Reshape(rows, [0, kv_num_heads, -1, head])
    scores = op.MatMul(rows, op.Transpose(keys, perm=[0, 1, 3, 2]))  # [batch, kv, seq * groups, span]
    if scale != 1.0:
        scores = op.Mul(scores, op.CastLike(scale, query))
    if softcap > 0:
        cap = op.CastLike(softcap, query)
        scores = op.Mul(op.Tanh(op.Div(scores, cap)), cap)
    bias = op.Reshape(score_bias, [0, 1, -1, 0])  # [batch, 1, seq * groups, span], one per step after CSE
    scores = op.Add(scores, bias)
    if head_sink is None:
        weights = op.Softmax(scores, axis=-1)
    else:
        # One more column of scores, each row's head's sink logit, whose weight is dropped. Built
        # from a zeroed column of the scores, not from a Shape (graph capture keeps shapes off the
        # CPU): rows are (token, group) per KV head, so the sinks broadcast as [kv, 1, groups].
        zero = op.Mul(op.Slice(scores, [0], [1], [3]), op.CastLike(0.0, query))  # [batch, kv, seq * groups, 1]
        sinks = op.Reshape(head_sink, [1, kv_num_heads, 1, groups])
        column = op.Reshape(op.Add(op.Reshape(zero, [0, 0, -1, groups]), sinks), [0, 0, -1, 1])
        weights = op.Softmax(op.Concat(scores, column, axis=-1), axis=-1)
        weights = op.Slice(weights, [0], [-1], [3])
    out = op.MatMul(weights, values)  # [batch, kv, seq * groups, head]
    if kv_num_heads > 1:
        out = op.Transpose(op.Reshape(out, [0, kv_num_heads, -1, groups, head]), perm=[0, 2, 1, 3, 4])
    return op.Reshape(out, [0, -1, num_heads * head])


@torch.library.custom_op("genai_exporter::mixture_of_experts", mutates_args=())
def mixture_of_experts(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    k: int,
    normalize: bool,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    interleaved: bool = False,
    alpha: float = 1.0,
    beta: float = 0.0,
    limit: float | None = None,
) -> torch.Tensor:
    """A routed-experts block with SwiGLU-gated experts, as ONNX Runtime's ``com.microsoft.MoE``
    computes it: softmax over the experts' logits (in float32), the ``k`` largest, renormalised to
    sum to 1 where ``normalize``; each picked expert e computes ``g, u = gate_up[e] @ x (+
    gate_up_bias[e])`` (gate rows first, or alternating gate and up rows where ``interleaved``),
    then ``down[e] @ (g' * sigmoid(alpha * g') * (u' + beta)) (+ down_bias[e])`` with ``g' = min(g,
    limit)`` and ``u' = clamp(u, -limit, limit)`` (SiLU gating: alpha 1, beta 0, no limit (None); gpt-oss:
    1.702, 1 and its ``swiglu_limit``); the outputs are summed with their routing weights. hidden
    [tokens, hidden], router_logits [tokens, experts], gate_up [experts, 2 * inner, hidden], down
    [experts, hidden, inner], biases [experts, rows]. Returns [tokens, hidden]. hidden may also be
    [batch, seq, hidden] (router_logits still [tokens, experts]); the output then has its shape."""
    if hidden.dim() == 3:
        flat = mixture_of_experts(hidden.reshape(-1, hidden.shape[-1]), router_logits, gate_up, down, k, normalize,
                                  gate_up_bias, down_bias, interleaved, alpha, beta, limit)
        return flat.reshape(hidden.shape)
    probabilities = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probabilities, k, dim=-1)  # [tokens, k]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    projected = torch.einsum("tkoh,th->tko", gate_up[experts].float(), hidden.float())  # [tokens, k, 2 * inner]
    if gate_up_bias is not None:
        projected = projected + gate_up_bias[experts].float()
    gate, up = (projected[..., ::2], projected[..., 1::2]) if interleaved else projected.chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    out = torch.einsum("tkhi,tki->tkh", down[experts].float(), gate * torch.sigmoid(alpha * gate) * (up + beta))
    if down_bias is not None:
        out = out + down_bias[experts].float()
    return (out * weights[..., None]).sum(dim=1).to(hidden.dtype)


@mixture_of_experts.register_fake
def _(hidden, router_logits, gate_up, down, k, normalize, gate_up_bias=None, down_bias=None, interleaved=False,
      alpha=1.0, beta=0.0, limit=None):
    return hidden.new_empty(hidden.shape)


_MIXTURE_OF_EXPERTS = _contrib_op(
    "MoE",
    ["input", "router_probs", "fc1_experts_weights", "fc1_experts_bias?", "fc2_experts_weights", "fc2_experts_bias?"],
    ["output"],
    {"k": _ATTR.INT, "normalize_routing_weights": _ATTR.INT, "activation_type": _ATTR.STRING,
     "swiglu_fusion": _ATTR.INT, "activation_alpha": _ATTR.FLOAT, "activation_beta": _ATTR.FLOAT,
     "swiglu_limit": _ATTR.FLOAT},
)


def _mixture_of_experts_onnx(hidden, router_logits, gate_up, down, k: int, normalize: bool, gate_up_bias=None,
                             down_bias=None, interleaved: bool = False, alpha: float = 1.0, beta: float = 0.0,
                             limit: float | None = None):
    """ONNX Runtime's CPU MoE takes gated experts only as interleaved rows (gate 0, up 0, gate 1,
    up 1, ...: ``swiglu_fusion=1``); its "swiglu" is ``g * sigmoid(alpha * g) * (u + beta)`` with
    g and u clamped to ``swiglu_limit``. Weights whose gate rows come first are interleaved by a
    Reshape/Transpose/Reshape of the stored weight (and their bias), which ``fold_weight_transposes``
    turns into one initializer written in that order."""
    shape = gate_up.shape
    if shape is None or not all(isinstance(d, int) for d in shape):
        raise ValueError("mixture_of_experts needs static expert weight shapes")
    experts, rows, width = shape
    if not interleaved:
        halves = op.Reshape(gate_up, op.Constant(value_ints=[experts, 2, rows // 2, width]))
        gate_up = op.Reshape(op.Transpose(halves, perm=[0, 2, 1, 3]), op.Constant(value_ints=[experts, rows, width]))
        if gate_up_bias is not None:
            halves = op.Reshape(gate_up_bias, op.Constant(value_ints=[experts, 2, rows // 2]))
            gate_up_bias = op.Reshape(op.Transpose(halves, perm=[0, 2, 1]), op.Constant(value_ints=[experts, rows]))
    biases = () if gate_up_bias is None and down_bias is None else (down_bias,)
    return _MIXTURE_OF_EXPERTS(
        hidden, router_logits, gate_up, gate_up_bias, down, *biases, k=k, normalize_routing_weights=int(normalize),
        activation_type="swiglu", swiglu_fusion=1, activation_alpha=float(alpha), activation_beta=float(beta),
        swiglu_limit=float("inf") if limit is None else float(limit),
    )


ONNX_TRANSLATIONS = {
    torch.ops.genai_exporter.mixture_of_experts.default: _mixture_of_experts_onnx,
    torch.ops.genai_exporter.last_token.default: _last_token_onnx,
    torch.ops.genai_exporter.group_query_attention.default: _group_query_attention_onnx,
    torch.ops.genai_exporter.rotary_embedding.default: _rotary_embedding_onnx,
    torch.ops.genai_exporter.sliding_window_slots.default: _sliding_window_slots_onnx,
    torch.ops.genai_exporter.window_attention.default: _window_attention_onnx,
}
