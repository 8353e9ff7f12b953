"""Find the attention cores of a traced decoder: where scores are computed from a query, the
repeated cached keys and values, and a mask.

Two forms occur in transformers' graphs: ``aten.scaled_dot_product_attention`` (the SDPA
implementation) and the eager chain ``matmul(q, k^T) -> scale -> [soft-cap] -> + mask -> [sink]
-> softmax -> [drop sink] -> matmul(., v)`` (gemma2, whose soft-capping SDPA cannot express; gpt-oss,
whose learned per-head sink logit joins the softmax as one more column that is then dropped, the
softmax's input shifted by its row maximum first). Both are read into one record;
anything else between the two matmuls is refused, so a core is only substituted when its math is
fully understood. Which cache a core reads is found by walking back from its key and value
through the layout ops of ``repeat_kv`` to the ``cat`` that appends new tokens to the past.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from fx_passes.analyses.graph_facts import PassDidNotApply, layer_index, same_shape

_aten = torch.ops.aten
_SDPA = _aten.scaled_dot_product_attention.default
# Ops that only move or repeat elements (repeat_kv's slices, unsqueeze, expand and reshape; copies).
_LAYOUT_OPS = {
    _aten.slice.Tensor, _aten.unsqueeze.default, _aten.expand.default, _aten.reshape.default,
    _aten.view.default, _aten.clone.default, _aten.contiguous.default, _aten._unsafe_view.default,
    _aten.repeat_interleave.self_int, _aten.alias.default,
}
# Between the softmax and the value matmul: no-ops in inference.
_PASS_THROUGH = {_aten.to.dtype, _aten.dropout.default, _aten.clone.default, _aten.contiguous.default,
                 _aten.alias.default, _aten.type_as.default}


@dataclass
class AttentionCore:
    """One attention computation: query [batch, heads, seq, head]; key/value the repeated cache
    [batch, heads, total, head]; output [batch, heads, seq, head]; mask the tensor added to (or
    selecting) the scores; ``nodes`` the core's own nodes, erased once it is replaced."""

    layer: int | None
    query: Node
    key: Node
    value: Node
    mask: Node | None
    is_causal: bool
    scale: float
    softcap: float
    output: Node
    nodes: list[Node]
    # The per-head logit that joins each softmax's denominator and reaches no value (gpt-oss's
    # ``sinks``), as the node it is broadcast from (``heads`` elements); None: no sink.
    sink: Node | None = None


def find_attention_cores(program: ExportedProgram) -> list[AttentionCore]:
    cores = []
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is _SDPA:
            cores.append(_sdpa_core(node))
        elif node.target is _aten.matmul.default and _is_scores_matmul(node):
            cores.append(_eager_core(node))
    return cores


def _head_dim(node: Node) -> int:
    return int(node.meta["val"].shape[-1])


def _sdpa_core(node: Node) -> AttentionCore:
    args = list(node.args) + [None] * (6 - len(node.args))
    query, key, value, mask, dropout, is_causal = args[:6]
    is_causal = bool(node.kwargs.get("is_causal", is_causal or False))
    dropout = node.kwargs.get("dropout_p", dropout or 0.0)
    if dropout:
        raise PassDidNotApply(f"{node.name}: attention with dropout {dropout} in an inference graph")
    if node.kwargs.get("enable_gqa"):
        raise PassDidNotApply(f"{node.name}: SDPA with enable_gqa (un-repeated KV heads) is not handled")
    scale = node.kwargs.get("scale")
    if scale is None:
        scale = _head_dim(query) ** -0.5
    return AttentionCore(layer_index(node), query, key, value, node.kwargs.get("attn_mask", mask), is_causal,
                         float(scale), 0.0, node, [node])


def _is_scores_matmul(node: Node) -> bool:
    """matmul(query, transpose(key, -2, -1)) whose chain of users reaches a softmax."""
    key_t = node.args[1]
    if not (isinstance(key_t, Node) and key_t.target is _aten.transpose.int):
        return False
    current = node
    for _ in range(8):
        follows = _next_in_chain(current)
        if follows is None:
            return False
        current = follows[0]
        if current.target in (_aten.softmax.int, _aten._softmax.default):
            return True
    return False


def _next_in_chain(node: Node) -> tuple[Node, Node, list[Node]] | None:
    """The one node that reads ``node`` in a chain of scores, what it reads, and the nodes skipped
    on the way: a shift by the row maximum, ``x - max(x, -1, keepdim).values`` (what a softmax
    computes anyway: gpt-oss writes it out) is looked through where the softmax reads it. None where
    ``node`` has other readers."""
    if len(node.users) == 1:
        return next(iter(node.users)), node, []
    if len(node.users) != 2:
        return None
    maximum = next((u for u in node.users if u.target is _aten.max.dim), None)
    shift = next((u for u in node.users if u.target is _aten.sub.Tensor), None)
    if maximum is None or shift is None or tuple(maximum.args[1:]) not in ((-1, True), (3, True)):
        return None
    values = [u for u in maximum.users if u.target is operator.getitem and u.args[1] == 0]
    indices = [u for u in maximum.users if u.target is operator.getitem and u.args[1] == 1]
    if (len(values) != 1 or any(u.users for u in indices) or len(maximum.users) != len(values) + len(indices)
            or tuple(shift.args) != (node, values[0]) or len(values[0].users) != 1 or len(shift.users) != 1):
        return None
    reader = next(iter(shift.users))
    if reader.target not in (_aten.softmax.int, _aten._softmax.default):
        return None  # a shift a later step sees (a sink column, a soft-cap) changes the result
    return reader, shift, [maximum, *values, *indices, shift]


def _scalar(node: Node) -> float | None:
    other = node.args[1]
    return float(other) if isinstance(other, (int, float)) else None


def _eager_core(scores: Node) -> AttentionCore:
    """Read scale, soft-cap, mask and sink off the chain between the two matmuls. The chain must read
    ``[* or / constant]... [/ c -> tanh -> * c] [+ mask] [cat sink] [- row max] -> softmax [-> drop
    the sink's column]``; any other op is refused."""
    query, key_t = scores.args
    if sorted(d % 4 for d in key_t.args[1:]) != [2, 3]:
        raise PassDidNotApply(f"{key_t.name}: keys transposed over axes {key_t.args[1:]}")
    nodes, steps = [scores, key_t], []
    current, previous = _follow(scores, nodes)
    while current.target not in (_aten.softmax.int, _aten._softmax.default):
        if _first_operand(current) is not previous:
            raise PassDidNotApply(f"{current.name}: attention scores enter {current.target} as a later operand")
        constant = _scalar(current) if current.target in (_aten.mul.Tensor, _aten.div.Tensor) else None
        if constant is not None:
            steps.append(("*" if current.target is _aten.mul.Tensor else "/", constant))
        elif current.target is _aten.tanh.default:
            steps.append(("tanh", None))
        elif current.target is _aten.add.Tensor and isinstance(current.args[1], Node):
            steps.append(("mask", current.args[1]))
        elif current.target is _aten.cat.default:
            steps.append(("sink", _sink_logits(current, previous)))
        else:
            raise PassDidNotApply(f"{scores.name}: attention scores pass through {current.target}, "
                                  "which GroupQueryAttention cannot express")
        nodes.append(current)
        current, previous = _follow(current, nodes)
    if current.args[0] is not previous:
        raise PassDidNotApply(f"{current.name}: the softmax does not read the attention scores")
    softmax = current
    if softmax.args[1] not in (-1, 3):
        raise PassDidNotApply(f"{softmax.name}: softmax over axis {softmax.args[1]}, not the keys")
    nodes.append(softmax)

    sink = steps.pop()[1] if steps and steps[-1][0] == "sink" else None
    if sink is not None:
        softmax = _sink_dropped(softmax)
        nodes.append(softmax)
    mask = steps.pop()[1] if steps and steps[-1][0] == "mask" else None
    softcap = 0.0
    if len(steps) >= 3 and steps[-2][0] == "tanh" and steps[-3][0] == "/" and steps[-1] == ("*", steps[-3][1]):
        softcap = steps[-3][1]
        steps = steps[:-3]
    scale = 1.0
    for kind, constant in steps:
        if kind not in ("*", "/"):
            raise PassDidNotApply(f"{scores.name}: attention scores read {kind} in an unexpected place")
        scale = scale * constant if kind == "*" else scale / constant

    current = softmax
    while True:
        if len(current.users) != 1:
            raise PassDidNotApply(f"{current.name}: attention weights have {len(current.users)} users")
        previous, current = current, next(iter(current.users))
        if current.target is _aten.matmul.default:
            if current.args[0] is not previous:
                raise PassDidNotApply(f"{current.name}: the value matmul does not take the attention weights first")
            break
        inert = current.target in _PASS_THROUGH and not (
            current.target is _aten.dropout.default and current.args[1] and current.args[2])
        if not inert:
            raise PassDidNotApply(f"{current.name}: attention weights pass through {current.target}")
        nodes.append(current)
    nodes.append(current)
    return AttentionCore(layer_index(scores), query, key_t.args[0], current.args[1], mask, False, scale, softcap,
                         current, nodes, sink)


def _follow(node: Node, nodes: list[Node]) -> tuple[Node, Node]:
    """The next step of a chain of scores and the node it reads (``_next_in_chain``); the nodes
    skipped go to ``nodes``."""
    follows = _next_in_chain(node)
    if follows is None:
        raise PassDidNotApply(f"{node.name}: attention scores have {len(node.users)} readers")
    reader, read, skipped = follows
    nodes.extend(skipped)
    return reader, read


def _first_operand(node: Node):
    """The scores operand of a chain step (``cat`` takes its operands as a list)."""
    if node.target is _aten.cat.default:
        return node.args[0][0] if len(node.args[0]) == 2 else None
    return node.args[0]


def _sink_logits(concat: Node, scores: Node) -> Node:
    """The node a sink column appended to the scores is broadcast from: ``cat([scores, sinks], -1)``
    with ``sinks`` [batch, heads, seq, 1] a broadcast of one logit per head (``heads`` elements)."""
    parts, dim = concat.args[0], concat.args[1] if len(concat.args) > 1 else 0
    heads = int(scores.meta["val"].shape[1])
    sinks = parts[1]
    if dim not in (-1, 3) or not isinstance(sinks, Node) or not same_shape(
            sinks.meta["val"].shape, (*scores.meta["val"].shape[:3], 1)):
        raise PassDidNotApply(f"{concat.name}: attention scores concatenated with something other than one "
                              "column of sink logits")
    source = sinks
    while source.op == "call_function" and source.target in _LAYOUT_OPS and _elements(source) != heads:
        source = source.args[0]
    if _elements(source) != heads:
        raise PassDidNotApply(f"{concat.name}: the appended score column is not one logit per head")
    if source.meta["val"].dtype != scores.meta["val"].dtype:  # GroupQueryAttention takes head_sink in T
        raise PassDidNotApply(f"{concat.name}: sink logits in {source.meta['val'].dtype}, scores in "
                              f"{scores.meta['val'].dtype}")
    return source


def _elements(node: Node) -> int | None:
    """How many elements ``node`` holds, where its shape is static."""
    shape = node.meta["val"].shape
    return math.prod(int(d) for d in shape) if all(isinstance(d, int) for d in shape) else None


def _sink_dropped(softmax: Node) -> Node:
    """The ``slice(softmax, -1, 0, -1)`` that drops the sink's column (its weight reaches no value)."""
    users = list(softmax.users)
    drop = users[0] if len(users) == 1 else None
    if (drop is None or drop.target is not _aten.slice.Tensor or drop.args[1] not in (-1, 3)
            or tuple(drop.args[2:4]) != (0, -1) or (len(drop.args) > 4 and drop.args[4] != 1)):
        raise PassDidNotApply(f"{softmax.name}: a softmax over a sink column whose weight is not dropped")
    return drop


def cache_concat(node: Node) -> Node:
    """The ``cat([past, new], dim=-2)`` that a core's repeated key or value was built from."""
    current = node
    while current.op == "call_function":
        if current.target is _aten.cat.default:
            parts, dim = current.args[0], current.args[1] if len(current.args) > 1 else 0
            if len(parts) == 2 and dim in (-2, 2) and parts[0].op == "placeholder":
                return current
            break
        if current.target not in _LAYOUT_OPS:
            break
        if current.target is _aten.unsqueeze.default and current.args[1] not in (2, -3):
            break  # repeat_kv inserts the repeat axis after the KV heads: head h reads KV head h // groups
        current = current.args[0]
    raise PassDidNotApply(f"{node.name}: walked back to {current.name} ({current.target}) without finding the "
                          "concatenation of a past KV input with new keys/values")


def heads_output(core: AttentionCore) -> tuple[Node, list[Node]]:
    """The node that holds the core's output as [batch, seq, heads * head], found by following
    transformers' ``transpose(1, 2) -> reshape`` after the core, and the layout nodes in between.
    Returns (core.output, []) when the chain has another form."""
    value = core.output.meta["val"]
    batch, heads, seq, head = value.shape
    current, chain, transposed = core.output, [], False
    while len(current.users) == 1:
        user = next(iter(current.users))
        shape = user.meta["val"].shape if isinstance(user.meta.get("val"), torch.Tensor) else None
        reshape = user.target in (_aten.reshape.default, _aten.view.default) and shape is not None
        if user.target is _aten.transpose.int and sorted(user.args[1:]) == [1, 2] and not transposed:
            transposed = True
        elif user.target in (_aten.clone.default, _aten.contiguous.default):
            pass
        elif reshape and same_shape(shape, current.meta["val"].shape):
            pass  # a reshape to the same shape
        elif reshape and transposed and same_shape(shape, (batch, seq, heads * head)):
            return user, chain + [user]
        else:
            break
        chain.append(user)
        current = user
    return core.output, []

