"""Ops whose ONNX schema at the graph's opset has no type for the export's bfloat16 compute in
float32 between Casts.

ONNX added bfloat16 to ``Conv``, ``Softplus`` and others at opset 22, ``TopK`` at 24; at the
exporter's opset a bf16 speech tower (Gemma 4's subsampling and depthwise convolutions, its
``per_dim_scale`` softplus) or Llama 4's router is a graph ONNX Runtime refuses to load on every
EP. Each such node reads its inputs cast to float32 and its outputs are cast back, so the rest of
the graph keeps its dtype and the op computes as PyTorch's bf16 kernels do (in float32, rounded
once). Which nodes is read off the ONNX schemas (``schema_types.dtype_refusals``), which the
export checks again before writing. It runs after the folds, which rewrite ops (onnxscript makes
``SplitToSequence`` a ``Split``, which has bf16), and widens only where nothing but the refused
type changes; anything else is left for the post-conditions to refuse.
"""

from __future__ import annotations

import onnx_ir as ir
import torch

from exporter.onnx_passes.schema_types import DtypeRefusal, dtype_refusals

_FLOAT32 = "tensor(float)"
_WIDENED = frozenset({ir.DataType.BFLOAT16})


class WidenUnsupportedDtypes:
    name = "widen_unsupported_dtypes"

    def applies(self, settings, session) -> str | None:
        # fp16 exports meet no such gap today; the post-conditions refuse any graph that does.
        if settings.compute_dtype == torch.bfloat16:
            return ("ONNX schemas at opset 21 lack bfloat16 for some ops (Conv, Softplus, TopK): "
                    "those compute in float32")
        return None

    def __call__(self, model: ir.Model, settings, session) -> dict[str, int]:
        widened = [r for r in dtype_refusals(model) if _widens(r)]
        casts: dict[tuple[int, ir.Value], ir.Value] = {}  # (graph, value): cast once per graph that reads it
        names = {v.name for g in model.graphs() for v in (*g.inputs, *g.initializers.values())}
        names |= {v.name for n in model.graph.all_nodes() for v in n.outputs}
        for refusal in widened:
            _widen(refusal, casts, names)
        return {"nodes_widened": len({id(r.node) for r in widened})} if widened else {}


def _widens(refusal: DtypeRefusal) -> bool:
    """Only where casting the type parameter's tensors changes nothing else: bf16 alone, float32
    allowed, outputs that follow the inputs (not typed by a ``dtype`` or ``to`` attribute), the
    node's other outputs of fixed types (not ``RandomNormalLike``'s), no subgraph, tensors only (a
    sequence's type is not its elements'). Anything else stays for the post-conditions to refuse."""
    node = refusal.node
    values = [node.inputs[i] for i in refusal.inputs] + [node.outputs[i] for i in refusal.outputs]
    return (refusal.dtype in _WIDENED and _FLOAT32 in refusal.allowed and refusal.others_fixed
            and refusal.inputs  # an output typed by an attribute (RandomNormal's dtype) would not follow
            and not {"dtype", "to"} & set(node.attributes)
            and not any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())
            and all(v.type is None or isinstance(v.type, ir.TensorType) for v in values))


def _widen(refusal: DtypeRefusal, casts: dict[tuple[int, ir.Value], ir.Value], names: set[str]) -> None:
    """Casts around ``refusal.node``; ``names``: every value name in the model, kept unique."""
    node = refusal.node
    graph = node.graph
    for index in refusal.inputs:
        value = node.inputs[index]
        if value.dtype == ir.DataType.FLOAT:
            continue
        key = (id(graph), value)
        if key not in casts:  # also where the graph does not know its type: the type parameter's is refused
            cast = ir.node("Cast", [value], attributes={"to": ir.DataType.FLOAT}, name=f"{value.name}.to_float32")
            wide = cast.outputs[0]
            wide.name, wide.dtype, wide.shape = _unique(f"{value.name}.as_float32", names), ir.DataType.FLOAT, value.shape
            graph.insert_before(node, cast)
            casts[key] = wide
        node.replace_input_with(index, casts[key])
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
        value.name, narrow.name = _unique(f"{name}.in_float32", names), name
        value.dtype = ir.DataType.FLOAT


def _unique(name: str, names: set[str]) -> str:
    unique, count = name, 1
    while unique in names:
        count += 1
        unique = f"{name}.{count}"
    names.add(unique)
    return unique
