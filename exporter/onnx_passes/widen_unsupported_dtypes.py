"""Ops whose ONNX schema at the graph's opset has no type for the export's bfloat16 compute in
float32 between Casts.

ONNX added bfloat16 to ``Conv``, ``Softplus`` and others only at opset 22; at the exporter's opset a
bf16 speech tower (Gemma 4's subsampling and depthwise convolutions, its ``per_dim_scale``
softplus) is a graph ONNX Runtime refuses to load on every EP. Each such node reads its inputs cast
to float32 and its outputs are cast back, so the rest of the graph keeps its dtype and the op
computes as PyTorch's bf16 kernels do (in float32, rounded once). Which nodes is read off the ONNX
schemas (``postconditions.dtype_refusals``), which the export checks again before writing.
"""

from __future__ import annotations

import onnx_ir as ir
import torch

from exporter.postconditions import DtypeRefusal, dtype_refusals

_FLOAT32 = "tensor(float)"
_WIDENED = frozenset({ir.DataType.BFLOAT16})


class WidenUnsupportedDtypes:
    name = "widen_unsupported_dtypes"

    def applies(self, facts, session) -> str | None:
        # fp16 is in every float op's schema since opset 1; the postconditions refuse any other gap.
        if facts.compute_dtype == torch.bfloat16:
            return "ONNX schemas before opset 22 lack bfloat16 for some ops (Conv, Softplus): those compute in float32"
        return None

    def __call__(self, model: ir.Model, facts) -> dict[str, int]:
        widened = [r for r in dtype_refusals(model) if r.dtype in _WIDENED and _FLOAT32 in r.allowed]
        casts: dict[ir.Value, ir.Value] = {}  # a value read by several widened nodes is cast once
        for refusal in widened:
            _widen(refusal, casts)
        return {"nodes_widened": len({id(r.node) for r in widened})} if widened else {}


def _widen(refusal: DtypeRefusal, casts: dict[ir.Value, ir.Value]) -> None:
    node = refusal.node
    graph = node.graph
    for index in refusal.inputs:
        value = node.inputs[index]
        if value.dtype == ir.DataType.FLOAT:
            continue
        if value not in casts:  # also where the graph does not know its type: the type parameter's is refused
            cast = ir.node("Cast", [value], attributes={"to": ir.DataType.FLOAT}, name=f"{value.name}.to_float32")
            wide = cast.outputs[0]
            wide.name, wide.dtype, wide.shape = f"{value.name}.as_float32", ir.DataType.FLOAT, value.shape
            graph.insert_before(node, cast)
            casts[value] = wide
        node.replace_input_with(index, casts[value])
    for index in refusal.outputs:
        value = node.outputs[index]
        back = ir.node("Cast", [value], attributes={"to": refusal.dtype}, name=f"{value.name}.from_float32")
        graph.insert_after(node, back)
        narrow = back.outputs[0]
        narrow.dtype, narrow.shape = refusal.dtype, value.shape
        for user, position in list(value.uses()):
            if user is not back:
                user.replace_input_with(position, narrow)
        for position, output in enumerate(graph.outputs):
            if output is value:
                graph.outputs[position] = narrow
        # The value keeps its users' name; the float32 one is the node's own.
        name = value.name
        value.name, narrow.name = f"{name}.in_float32", name
        value.dtype = ir.DataType.FLOAT
