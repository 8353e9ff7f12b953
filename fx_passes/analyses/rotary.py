"""Find transformers' rotary embedding on a query or key, and turn its cos/sin tables into the
position-indexed caches GroupQueryAttention rotates with (``do_rotary``).

transformers applies ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``
(halves of the last axis) and cos/sin of shape [batch, seq, head] computed from ``position_ids``.
GroupQueryAttention's non-interleaved rotary is the same formula with ``cos_cache[position]`` of
shape [max_positions, head / 2], the position being the token's slot in its row's compact cache,
which equals GenAI's position ids. The caches are built by running the program's own cos/sin
nodes on positions 0..context-1 (so scaled and partial rotary forms, such as Gemma 4's
"proportional" rotary on full-attention layers, whose unrotated dims have cos 1 and sin 0, come out
right), and are accepted only if both halves of every row agree, the condition for
``rotate_half`` form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from fx_passes.analyses.graph_facts import ancestors, evaluate_nodes, probe_inputs

_aten = torch.ops.aten


@dataclass(frozen=True)
class Rotary:
    unrotated: Node  # the tensor before the rotation, same layout as the rotated one
    cos: Node  # [batch, seq, head] table
    sin: Node


def match_rotary(node: Node) -> Rotary | None:
    """``node`` as add(mul(x, cos), mul(rotate_half(x), sin)), or None. Also accepts the
    partial-rotary code path at full width (Phi-3): cat([that over x[..., :head], x[..., head:]]),
    whose second part is empty."""
    whole = _whole_width_partial_rotary(node)
    if whole is not None:
        return whole
    if node.op != "call_function" or node.target is not _aten.add.Tensor:
        return None
    products = node.args
    if not all(isinstance(p, Node) and p.target is _aten.mul.Tensor for p in products):
        return None
    for straight, rotated in (products, reversed(products)):
        for half_turn, sin in (rotated.args, reversed(rotated.args)):
            x = _rotate_half_source(half_turn)
            if x is None or x not in straight.args:
                continue
            cos = straight.args[1] if straight.args[0] is x else straight.args[0]
            cos_table, sin_table = _table(cos), _table(sin)
            if cos_table is not None and sin_table is not None:
                return Rotary(x, cos_table, sin_table)
    return None


def _whole_width_partial_rotary(node: Node) -> Rotary | None:
    if node.op != "call_function" or node.target is not _aten.cat.default or len(node.args[0]) != 2:
        return None
    rotated, rest = node.args[0]
    inner = match_rotary(rotated) if isinstance(rotated, Node) else None
    if inner is None or not isinstance(rest, Node) or rest.meta["val"].shape[-1] != 0:
        return None
    source = inner.unrotated.args[0] if inner.unrotated.target in (_aten.alias.default, _aten.slice.Tensor) else None
    if source is None or rest.target is not _aten.slice.Tensor or rest.args[0] is not source:
        return None
    if inner.unrotated.target is _aten.slice.Tensor and tuple(inner.unrotated.args[1:3]) not in ((-1, 0), (_rank(source) - 1, 0)):
        return None
    if inner.unrotated.meta["val"].shape[-1] != source.meta["val"].shape[-1]:
        return None
    return Rotary(source, inner.cos, inner.sin)


def _rotate_half_source(node) -> Node | None:
    """x for ``cat([-x[..., half:], x[..., :half]], -1)``."""
    if not isinstance(node, Node) or node.target is not _aten.cat.default:
        return None
    parts = node.args[0]
    if len(parts) != 2 or (node.args[1] if len(node.args) > 1 else 0) not in (-1, _rank(node) - 1):
        return None
    negated, first = parts
    if negated.target is not _aten.neg.default:
        return None
    second = negated.args[0]
    if not all(p.target is _aten.slice.Tensor for p in (first, second)) or first.args[0] is not second.args[0]:
        return None
    x = first.args[0]
    head = int(x.meta["val"].shape[-1])
    half = head // 2
    last = (-1, _rank(x) - 1)
    if first.args[1] in last and tuple(first.args[2:4]) == (0, half) and second.args[1] in last \
            and second.args[2] == half and second.args[3] >= head:
        return x
    return None


def _rank(node: Node) -> int:
    return node.meta["val"].dim()


def _table(node) -> Node | None:
    """The [batch, seq, head] table a cos/sin operand broadcasts from (an unsqueeze of it)."""
    if isinstance(node, Node) and node.target is _aten.unsqueeze.default and _rank(node.args[0]) == 3:
        return node.args[0]
    return None


def rotary_caches(program: ExportedProgram, rotary: Rotary, max_positions: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos/sin caches [max_positions, head / 2], or None when the tables are not a function of
    ``position_ids`` alone or not in ``rotate_half`` form."""
    needed = ancestors([rotary.cos, rotary.sin])
    user_inputs = {s.arg.name for s in program.graph_signature.input_specs
                   if s.kind == torch.export.graph_signature.InputKind.USER_INPUT}
    for node in needed:
        if node.op != "placeholder" or node.name not in user_inputs:
            continue
        read_values = any(user in needed and user.target is not _aten.sym_size.int for user in node.users)
        if read_values and node.name != "position_ids":
            return None  # the tables depend on more than the positions
    cos, sin = evaluate_nodes(program, [rotary.cos, rotary.sin], probe_inputs(program, max_positions))
    half = cos.shape[-1] // 2
    cos, sin = cos[0].float(), sin[0].float()
    if not (torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])):
        return None
    return cos[:, :half].contiguous(), sin[:, :half].contiguous()
