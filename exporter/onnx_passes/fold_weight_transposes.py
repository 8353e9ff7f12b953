"""No MatMul transposes or reshapes a weight at every step: where the EP runs a transposed MatMul
it reads the weight as stored (``FusedMatMul`` with ``transB``); otherwise ``Transpose(weight)`` and
``Reshape(weight)`` become one initializer in its readers' layout, computed lazily when the package
is written (a streamed weight is read once)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from exporter.weights.lazy_steps import ReshapedWeight, TransposedWeight


class FoldWeightTransposes:
    """torch.onnx lowers a linear layer as ``MatMul(x, Transpose(W))``; no MatMul should transpose
    its weight at every step. Where the EP runs a transposed MatMul (the profile's
    ``transposed_matmul``), it becomes ``FusedMatMul(x, W, transB=1)``, reading W as the checkpoint
    stores it: nothing to transpose when the package is written (a weight kept in its checkpoint's
    dtype is copied file to file), and a tied LM head is the embedding's table itself, stored once.
    ONNX Runtime's CPU MatMul packs its weight at load either way (gemma-4-e2b-shape fp32, against
    transposed copies: load 1.07 vs 1.11 s, TTFT 1423 vs 1437 ms, decode 14.2 vs 14.0 tokens/s;
    ``scripts/benchmark.py --transposed-matmul``).
    Elsewhere ``Transpose(weight)`` becomes one transposed initializer, lazy (computed when
    written); a weight with other readers (a tied head) is then stored twice, except in a session
    whose weights are block-quantized (``settings.quantized(session)``), whose quantizer stores a tied
    table once and reads it through the Transpose (and quantizes MatMuls only, so it keeps MatMul).
    An int4 package's vision and speech towers stay float without ``--int4-encoders``: theirs are
    read transposed as a float package's are."""

    name = "fold_weight_transposes"

    def applies(self, settings, session) -> str | None:
        return "MatMuls read their weights as stored instead of transposing them at every step"

    def __call__(self, model: ir.Model, settings, session) -> dict[str, int]:
        quantizing = settings.quantized(session)
        graph, folded, read_transposed, tied = model.graph, 0, 0, 0
        reshaped = 0
        for node in list(graph):  # in topological order: a Reshape/Transpose chain folds link by link
            if node.op_type == "Reshape" and node.domain == "":
                reshaped += _fold_weight_reshape(node, graph)
                continue
            if node.op_type != "Transpose" or node.domain != "":
                continue
            source = node.inputs[0]
            if source is None or not source.is_initializer() or source.const_value is None or source in graph.outputs:
                continue
            shared = len(source.uses()) > 1
            if not quantizing and settings.profile.transposed_matmul and _read_as_transposed(node, graph):
                read_transposed += 1
                tied += shared
                continue
            if shared and quantizing:
                continue
            tensor, out = source.const_value, node.outputs[0]
            rank = len(tensor.shape)
            perm = list(node.attributes.get_ints("perm", list(reversed(range(rank)))))
            shape = ir.Shape([tensor.shape[p] for p in perm])
            name = out.name
            lazy = ir.LazyTensor(TransposedWeight(tensor, tuple(perm), name), dtype=tensor.dtype, shape=shape,
                                 name=name)
            replacement = ir.Value(name=name, shape=shape, type=ir.TensorType(tensor.dtype), const_value=lazy)
            out.name = None
            ir.convenience.replace_all_uses_with(out, replacement)
            graph.remove(node, safe=True)
            if not shared:
                graph.initializers.pop(source.name)
            graph.register_initializer(replacement)
            folded += 1
        return {"weights_transposed": folded, "weights_read_transposed": read_transposed,
                "tied_weights_read_transposed": tied, "weights_reshaped": reshaped}


def _fold_weight_reshape(node: ir.Node, graph: ir.Graph) -> int:
    """``Reshape(weight, constant shape)`` whose weight feeds nothing else -> one lazy initializer
    of that shape (ONNX Runtime's MoE reads its experts' gate and up rows interleaved: a
    Reshape/Transpose/Reshape of the stored weight, folded into one weight stored that way)."""
    source, out = node.inputs[0], node.outputs[0]
    target = ir.convenience.get_const_tensor(node.inputs[1]) if len(node.inputs) > 1 else None
    if (source is None or not source.is_initializer() or source.const_value is None or target is None
            or len(source.uses()) > 1 or source in graph.outputs or node.attributes.get_int("allowzero", 0)):
        return 0
    tensor = source.const_value
    dims = [int(d) for d in target.numpy().reshape(-1)]
    if any(d == 0 and i >= len(tensor.shape) for i, d in enumerate(dims)):
        return 0  # a 0 copies an input dimension the weight does not have: not a reshape to fold
    dims = [tensor.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    shape = ir.Shape(np.empty(tuple(tensor.shape), dtype=np.uint8).reshape(dims).shape)  # resolves a -1
    name = out.name
    lazy = ir.LazyTensor(ReshapedWeight(tensor, tuple(shape), name), dtype=tensor.dtype, shape=shape, name=name)
    replacement = ir.Value(name=name, shape=shape, type=ir.TensorType(tensor.dtype), const_value=lazy)
    out.name = None
    ir.convenience.replace_all_uses_with(out, replacement)
    graph.remove(node, safe=True)
    graph.initializers.pop(source.name)
    graph.register_initializer(replacement)
    return 1


def _read_as_transposed(transpose: ir.Node, graph: ir.Graph) -> bool:
    """Where a 2-D ``Transpose(W)`` feeds only MatMuls as their B: each becomes
    ``FusedMatMul(A, W, transB=1)`` and the Transpose goes; returns whether it did."""
    weight, out = transpose.inputs[0], transpose.outputs[0]
    if len(weight.shape) != 2 or list(transpose.attributes.get_ints("perm", [1, 0])) != [1, 0]:
        return False
    if weight.dtype != ir.DataType.FLOAT:
        return False  # ONNX Runtime's CPU FusedMatMul is registered for float only
    readers = [node for node, index in out.uses()]
    if out in graph.outputs or not readers or any(
            node.op_type != "MatMul" or node.domain != "" or node.inputs[1] is not out for node in readers):
        return False
    for matmul in readers:
        product = matmul.outputs[0]
        fused = ir.node("FusedMatMul", [matmul.inputs[0], weight], domain="com.microsoft",
                        attributes={"transB": 1, "alpha": 1.0}, name=matmul.name)
        result = fused.outputs[0]
        result.shape, result.type = product.shape, product.type
        graph.insert_before(matmul, fused)
        name = product.name
        ir.convenience.replace_all_uses_with(product, result, replace_graph_outputs=True)
        graph.remove(matmul, safe=True)
        product.name, result.name = None, name
    graph.remove(transpose, safe=True)
    return True
