"""Store linear weights pre-transposed: ``Transpose(weight)`` becomes one transposed initializer,
computed lazily when the package is written (a streamed weight is read once)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


class FoldWeightTransposes:
    """``Transpose(weight)`` whose weight feeds nothing else -> one transposed initializer, lazy
    (computed when written), so a MatMul reads its weight as stored instead of transposing it at
    every step. torch.onnx lowers linear layers that way, and constant folding leaves the
    Transpose of any weight over its size limit (every weight of a full-size model).
    A weight that has other readers (a tied LM head) is folded too, stored twice, except in an
    int4 export, whose quantizer stores a tied table once and reads it through the Transpose."""

    name = "fold_weight_transposes"

    def applies(self, facts, session) -> str | None:
        return "MatMuls read their weights as stored instead of transposing them at every step"

    def __call__(self, model: ir.Model, facts) -> dict[str, int]:
        fold_shared = facts.precision != "int4"
        graph, folded = model.graph, 0
        for node in list(graph):
            if node.op_type != "Transpose" or node.domain != "":
                continue
            source = node.inputs[0]
            if source is None or not source.is_initializer() or source.const_value is None or source in graph.outputs:
                continue
            shared = len(source.uses()) > 1
            if shared and not fold_shared:
                continue
            tensor, out = source.const_value, node.outputs[0]
            rank = len(tensor.shape)
            perm = list(node.attributes.get_ints("perm", list(reversed(range(rank)))))
            shape = ir.Shape([tensor.shape[p] for p in perm])
            name = out.name

            def transposed(tensor=tensor, perm=perm, name=name) -> ir.TensorProtocol:
                return ir.Tensor(np.ascontiguousarray(np.transpose(tensor.numpy(), perm)), name=name)

            lazy = ir.LazyTensor(transposed, dtype=tensor.dtype, shape=shape, name=name)
            replacement = ir.Value(name=name, shape=shape, type=ir.TensorType(tensor.dtype), const_value=lazy)
            out.name = None
            ir.convenience.replace_all_uses_with(out, replacement)
            graph.remove(node, safe=True)
            if not shared:
                graph.initializers.pop(source.name)
            graph.register_initializer(replacement)
            folded += 1
        return {"weights_transposed": folded}
