"""AWQ's divisions folded into the weights before them, so that an ``--int4-method awq`` package
runs no op a round-to-nearest one does not.

``quantize_weights`` feeds each AWQ-scaled ``MatMulNBits`` ``x / s`` through a Div (one per input
and s: the layers reading one input share their s). Where ``x`` is made by a weight that scales
each of its channels, and nothing else reads ``x``, dividing that weight by ``s`` makes ``x / s``
itself, and the Div goes:
- ``x`` is a norm's output (a decoder layer's norm before its query/key/value or gate/up
  projections): its scale (and a LayerNorm's bias) divided by s;
- ``x`` is ``a * u``, ``u`` the output of a ``MatMulNBits`` read by nothing else (an MLP's
  ``act(gate) * up`` before its down projection): that MatMulNBits' block scales, one per output
  row and block, divided by s of the row. Its integers and zero points are unchanged, so the up
  projection stores exactly the same numbers up to the scales' own rounding. Only float32
  scales: fp16 ones could fall under fp16's normal range.

A folded norm weight must stay finite and normal in its dtype, or the Div stays.

Any other Div stays (the report counts both).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import common

from exporter.onnx_passes.base import run_in_place
from exporter.onnx_passes.quantize_weights import AWQ_DIVISION, MICROSOFT, unique_initializer_name
from exporter.onnx_passes.scale_residual_stream import NORMS


class FoldAwqDivisions:
    name = "fold_awq_divisions"

    def applies(self, settings, session) -> str | None:
        if not settings.quantized(session) or settings.weight_bits != 4 or settings.int4.method != "awq":
            return None
        return "AWQ's x / s folded into the norm weight or up projection scales that make x"

    def __call__(self, model: ir.Model, settings, session) -> dict[str, int]:
        counts = {"into_norms": 0, "into_up_projections": 0, "divisions_left": 0}
        graph = model.graph
        for node in list(graph):
            if node.op_type != "Div" or node.metadata_props.get(AWQ_DIVISION) != "true":
                continue
            x, divisor = node.inputs
            s = divisor.const_value.numpy().astype(np.float32)
            made_by = x.producer()
            alone = made_by is not None and not x.is_graph_output() and len(x.uses()) == 1 and _positive(s)
            if alone and _fold_into_norm(graph, made_by, x, s):
                counts["into_norms"] += 1
            elif alone and _fold_into_up_projection(graph, made_by, s):
                counts["into_up_projections"] += 1
            else:
                counts["divisions_left"] += 1
                del node.metadata_props[AWQ_DIVISION]  # the package carries no marker
                continue
            # x now holds x / s: what read the Div reads x.
            ir.convenience.replace_all_uses_with(node.outputs[0], x)
            graph.remove(node, safe=True)
        run_in_place(common.RemoveUnusedNodesPass(), model)  # the divisors no Div reads any more
        return counts


def _fold_into_norm(graph: ir.Graph, norm: ir.Node, x: ir.Value, s: np.ndarray) -> bool:
    """x is ``norm``'s output and its scale (and bias) are constants over x's channels: each
    replaced by a copy divided by s (a copy: another norm may read the same initializer)."""
    if norm.op_type not in NORMS or norm.domain not in ("", MICROSOFT) or norm.outputs[0] is not x:
        return False
    slots = [i for i in NORMS[norm.op_type].weights if i < len(norm.inputs) and norm.inputs[i] is not None]
    weights = [norm.inputs[i] for i in slots]
    if not slots or not all(w.const_value is not None and w.const_value.shape == s.shape for w in weights):
        return False
    divided = [_divided(weight, s) for weight in weights]
    if not all(_representable(tensor.numpy()) for tensor in divided):
        return False
    for slot, weight, tensor in zip(slots, weights, divided):
        norm.replace_input_with(slot, _initializer(graph, f"{weight.name}.awq", tensor))
    return True


def _fold_into_up_projection(graph: ir.Graph, product: ir.Node, s: np.ndarray) -> bool:
    """x is ``a * u`` with u a MatMulNBits' [.., N] output that only this Mul reads: its scales
    [N, blocks] divided by s row by row (a * (u / s) is x / s whatever a broadcasts)."""
    if product.op_type != "Mul" or product.domain != "":
        return False
    for u in product.inputs:
        matmul = u.producer() if u is not None else None
        if (matmul is None or matmul.op_type != "MatMulNBits" or matmul.domain != MICROSOFT
                or len(u.uses()) != 1 or u.is_graph_output() or matmul.attributes["N"].value != s.shape[0]):
            continue
        scales = matmul.inputs[2]
        if scales.const_value is None or len(scales.uses()) != 1 or scales.shape[0] != s.shape[0]:
            continue
        if scales.dtype != ir.DataType.FLOAT:
            # fp16 scales divided by s up to ~80 could fall below fp16's normal range (6.1e-5) and
            # lose bits; they are only known when the package is written, so the Div stays.
            return False
        tensor, dtype = scales.const_value, scales.dtype
        rows = ir.LazyTensor(lambda: ir.tensor((tensor.numpy().astype(np.float32) / s[:, None]).astype(dtype.numpy())),
                             dtype=dtype, shape=scales.shape)
        matmul.replace_input_with(2, _initializer(graph, f"{scales.name}.awq", rows))
        return True
    return False


def _positive(s: np.ndarray) -> bool:
    return bool(np.isfinite(s).all() and (s > 0).all())


def _representable(values: np.ndarray) -> bool:
    """Finite, and no nonzero value under the dtype's normal range (where it would lose bits)."""
    tiny = np.finfo(values.dtype).tiny
    magnitude = np.abs(values.astype(np.float32))
    return bool(np.isfinite(magnitude).all() and not ((magnitude > 0) & (magnitude < tiny)).any())


def _divided(weight: ir.Value, s: np.ndarray) -> ir.Tensor:
    return ir.tensor((weight.const_value.numpy().astype(np.float32) / s).astype(weight.dtype.numpy()))


def _initializer(graph: ir.Graph, name: str, tensor: ir.TensorProtocol) -> ir.Value:
    value = ir.Value(name=unique_initializer_name(graph, name), const_value=tensor, type=ir.TensorType(tensor.dtype),
                     shape=ir.Shape(tensor.shape))
    graph.register_initializer(value)
    return value
