"""What onnxscript's constant folder would do to a weight, done without reading its values:
``Identity`` and same-type ``CastLike`` of a weight become the weight itself, and ``Cast`` /
``CastLike`` of a weight between float types (where the folder would fold it: inputs of at most its
size limit, such as norm scales cast to fp32 in an fp16 export) becomes one lazy initializer of the
cast values, computed when the package is written with the same numpy cast the folder evaluates.
So each weight's bytes stay a function of its checkpoint tensor that a replay repeats
(``exporter.weights.derived_weights``). Other folds of weights are the folder's (``fold_constants``: in the
decoder it reads them, as for Gemma 2's ``1 + weight`` norm scales, and such a package is not
recorded as a replay; in a tower those nodes stay for run time)."""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.optimizer import _constant_folding

from exporter.weights.lazy_steps import CastWeight

# The folder's own limit: larger weights stay cast at run time, as it leaves them.
_FOLDED_SIZE_LIMIT = _constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT
_FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def fold_weight_nodes(graph: ir.Graph) -> int:
    """Every ``Identity``, ``Cast`` and ``CastLike`` of a lazy weight made the weight or a lazy cast
    of it; returns how many."""
    folded = 0
    for node in list(graph):
        if node.domain != "" or node.op_type not in ("Identity", "Cast", "CastLike"):
            continue
        source, out = node.inputs[0], node.outputs[0]
        if source is None or not source.is_initializer() or source in graph.outputs or out in graph.outputs:
            continue
        tensor = source.const_value
        if not is_made_from_weight(tensor):
            continue  # a constant: the folder's
        replacement = _cast(node, tensor, source)
        if replacement is None:
            continue
        if replacement is not source:
            graph.register_initializer(replacement)
        ir.convenience.replace_all_uses_with(out, replacement)
        graph.remove(node, safe=True)
        if not source.uses() and source is not replacement:
            graph.initializers.pop(source.name)
        folded += 1
    return folded


def _cast(node: ir.Node, tensor, source: ir.Value) -> ir.Value | None:
    """The weight itself, a lazy cast of it, or None where the folder would not fold the cast."""
    if node.op_type == "Cast":
        dtype = ir.DataType(node.attributes.get_int("to"))
    elif node.op_type == "CastLike":
        dtype = node.inputs[1].dtype if node.inputs[1] is not None else None
    else:
        dtype = tensor.dtype
    if dtype == tensor.dtype:
        return source
    if tensor.dtype not in _FLOAT_TYPES or dtype not in _FLOAT_TYPES or tensor.size > _FOLDED_SIZE_LIMIT:
        return None
    out = node.outputs[0]
    name, out.name = out.name, None
    lazy = ir.LazyTensor(CastWeight(tensor, dtype, name), dtype=dtype, shape=tensor.shape, name=name)
    return ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(dtype), const_value=lazy)


def is_made_from_weight(tensor) -> bool:
    """Whether a lazy tensor is a weight or made from one (an unknown lazy tensor may be)."""
    from exporter.weights.origins import made_from

    if not isinstance(tensor, ir.LazyTensor):
        return False
    chain = made_from(tensor)
    return chain is None or chain[0] is not None  # an unknown lazy tensor may be a weight's too
