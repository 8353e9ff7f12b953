"""Reshape targets as constants: ``Reshape(x, Concat(Shape(x)[0], Shape(x)[1], 4, 32))`` becomes
``Reshape(x, [0, 0, 4, 32])``.

torch.export records a view's target with its symbolic sizes, so torch.onnx builds each target
from Shape, Squeeze and Concat nodes. ONNX Runtime runs that shape arithmetic on the CPU, which
costs a device round trip per step and rules out graph capture (WebGPU refuses a captured
session with any CPU node). ONNX's Reshape copies an input dim for a target entry of 0 and infers
one entry of -1 (with ``allowzero=0``), which covers every view a decoder makes (it splits or merges the trailing axes
and keeps batch and sequence in place). onnxscript's optimizer has no such rule; its constant
folding only folds fully static shapes.

A target is rewritten only when each dynamic entry is either the input's dim at the same index
(by the symbolic shapes torch.onnx recorded) or the single entry left to infer; anything else keeps
its Concat (and the graph-capture check names it).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


def _constant(value: ir.Value) -> np.ndarray | None:
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def _target(node: ir.Node) -> list[int] | None:
    concat = node.inputs[1].producer()
    if concat is None or concat.op_type != "Concat":
        return None
    source, result = node.inputs[0].shape, node.outputs[0].shape
    if source is None or result is None or len(result) != len(concat.inputs):
        return None
    target = []
    for index, part in enumerate(concat.inputs):
        constant = _constant(part)
        if constant is not None:
            if constant.size != 1 or int(constant.reshape(-1)[0]) == 0:
                return None  # a literal 0 would mean "copy" to ONNX, not size 0
            target.append(int(constant.reshape(-1)[0]))
        elif index < len(source) and isinstance(result[index], ir.SymbolicDim) and result[index] == source[index]:
            target.append(0)
        else:
            target.append(-1)
    return target if target.count(-1) <= 1 else None


class StaticReshapeTargets:
    name = "static_reshape_targets"

    def applies(self, settings, session) -> str | None:
        if not session.captured(settings):
            return None
        return "a captured graph runs no shape arithmetic on the CPU"

    def __call__(self, model: ir.Model, settings, session) -> dict[str, int]:
        rewritten = 0
        for node in model.graph.all_nodes():
            if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx") or _constant(node.inputs[1]) is not None:
                continue
            target = _target(node)
            if target is None:
                continue
            name = f"{node.name or 'reshape'}_target_{rewritten}"
            constant = ir.Value(name=name, const_value=ir.tensor(np.array(target, dtype=np.int64), name=name))
            constant.shape, constant.type = ir.Shape([len(target)]), ir.TensorType(ir.DataType.INT64)
            model.graph.register_initializer(constant)
            node.replace_input_with(1, constant)
            # torch.onnx writes allowzero=1 (a 0 is a size); the target's 0s now mean "copy", and
            # it has no literal 0 (``_target`` refuses those).
            node.attributes["allowzero"] = ir.AttrInt64("allowzero", 0)
            rewritten += 1
        return {"targets_made_constant": rewritten}
