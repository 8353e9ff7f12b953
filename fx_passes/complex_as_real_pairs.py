"""Rewrite complex-valued tensors as real tensors with a trailing (real, imaginary) axis.

Llama 4 applies its rotary embedding in complex numbers: ``view_as_complex`` of the query and key
pairs, times ``freqs_cis = polar(1, angle)``, then ``view_as_real``. torch.onnx has no complex
type ("No decompositions registered for the complex-valued input") and neither has ONNX Runtime.
Each complex node becomes the real node that holds its pairs: ``view_as_complex`` and
``view_as_real`` vanish, ``polar`` becomes ``stack(r cos a, r sin a)``, a product becomes
``(ac - bd, ad + bc)``; slices and unsqueezes keep their meaning on the extra axis. Any other op on
a complex tensor stops the export with its name.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from fx_passes.analyses.graph_facts import PassDidNotApply, set_fake_value
from fx_passes.base import Settings

_aten = torch.ops.aten
_SAME_DTYPE = (_aten.to.dtype_layout, _aten.to.dtype, _aten.clone.default, _aten.contiguous.default)


class ComplexAsRealPairs:
    name = "complex_as_real_pairs"

    def applies(self, settings, session) -> str | None:
        return "ONNX has no complex type: complex tensors (Llama 4's rotary) become real (re, im) pairs"

    def __call__(self, program: ExportedProgram, settings: Settings, session) -> tuple[ExportedProgram, dict[str, int]]:
        graph = program.graph
        pairs: dict[Node, Node] = {}  # complex node -> the real node of its pairs
        rewritten = 0
        for node in list(graph.nodes):
            inputs = [a for a in node.all_input_nodes if a in pairs]
            if not _is_complex(node) and not inputs:
                continue
            with graph.inserting_before(node.next):  # new nodes in creation order, right after ``node``
                replacement = _rewrite(graph, node, pairs)
            if _is_complex(node):
                pairs[node] = replacement
            else:  # view_as_real: the pairs are its value
                node.replace_all_uses_with(replacement)
            rewritten += 1
        if rewritten:
            graph.eliminate_dead_code()
            graph.lint()
            program.graph_module.recompile()
        return program, {"complex_nodes_rewritten": rewritten}


def _is_complex(node: Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.is_complex()


def _call(graph, target, *args) -> Node:
    node = graph.call_function(target, args)
    set_fake_value(node)
    return node


def _rewrite(graph, node: Node, pairs: dict[Node, Node]) -> Node:
    target, args = node.target, node.args
    if target is _aten.view_as_complex.default:
        return args[0]
    if target is _aten.view_as_real.default:
        return pairs[args[0]]
    if target is _aten.polar.default:
        magnitude, angle = args
        real = _call(graph, _aten.mul.Tensor, magnitude, _call(graph, _aten.cos.default, angle))
        imaginary = _call(graph, _aten.mul.Tensor, magnitude, _call(graph, _aten.sin.default, angle))
        return _call(graph, _aten.stack.default, [real, imaginary], -1)
    if target in _SAME_DTYPE and args and args[0] in pairs:
        if node.meta["val"].dtype != args[0].meta["val"].dtype:
            raise PassDidNotApply(f"complex_as_real_pairs: {node.name} changes a complex dtype")
        return pairs[args[0]]
    rank = node.meta["val"].dim() if _is_complex(node) else None
    if target is _aten.slice.Tensor and args[0] in pairs:
        dim = args[1] if len(args) > 1 else 0
        return _call(graph, target, pairs[args[0]], dim % rank, *args[2:])
    if target is _aten.unsqueeze.default and args[0] in pairs:
        return _call(graph, target, pairs[args[0]], args[1] % rank)
    if target is _aten.mul.Tensor:
        left, right = args
        if left in pairs and right in pairs:
            return _complex_product(graph, pairs[left], pairs[right])
        if left in pairs and not _is_tensor(right):
            return _call(graph, target, pairs[left], right)
        if right in pairs and not _is_tensor(left):
            return _call(graph, target, pairs[right], left)
    raise PassDidNotApply(f"complex_as_real_pairs: no real form for {target} on complex tensors ({node.name})")


def _is_tensor(value) -> bool:
    return isinstance(value, Node) and isinstance(value.meta.get("val"), torch.Tensor)


def _complex_product(graph, left: Node, right: Node) -> Node:
    a, b = (_call(graph, _aten.select.int, left, -1, i) for i in (0, 1))
    c, d = (_call(graph, _aten.select.int, right, -1, i) for i in (0, 1))
    real = _call(graph, _aten.sub.Tensor, _call(graph, _aten.mul.Tensor, a, c), _call(graph, _aten.mul.Tensor, b, d))
    imaginary = _call(graph, _aten.add.Tensor, _call(graph, _aten.mul.Tensor, a, d), _call(graph, _aten.mul.Tensor, b, c))
    return _call(graph, _aten.stack.default, [real, imaginary], -1)
