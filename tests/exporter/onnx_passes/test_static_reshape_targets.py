"""L1: constant Reshape targets for graph capture, and the check that finds CPU-side shape work."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as h
from onnx_ir.passes.common import RemoveUnusedNodesPass

from exporter.onnx_passes.static_reshape_targets import StaticReshapeTargets
from exporter.verify.postconditions import cpu_placed_nodes

pytestmark = pytest.mark.unit


def _model(target_dims: list, output_dims: list) -> ir.Model:
    """x [B, S, 32] reshaped to a target built from x's own dims (ints are constants, "B"/"S" read
    x's shape), the way torch.onnx writes a view with symbolic sizes."""
    nodes = [h.make_node("Shape", ["x"], ["shape"])]
    parts = []
    for index, dim in enumerate(target_dims):
        name = f"part{index}"
        if isinstance(dim, int):
            nodes.append(h.make_node("Constant", [], [name], value=h.make_tensor(name, TensorProto.INT64, [1], [dim])))
        else:
            axis = {"B": 0, "S": 1}[dim]
            nodes.append(h.make_node("Slice", ["shape", f"start{axis}", f"end{axis}"], [name]))
        parts.append(name)
    nodes += [h.make_node("Concat", parts, ["target"], axis=0), h.make_node("Reshape", ["x", "target"], ["reshaped"], allowzero=1),
              h.make_node("Neg", ["reshaped"], ["y"])]
    constants = [h.make_tensor(f"start{a}", TensorProto.INT64, [1], [a]) for a in (0, 1)]
    constants += [h.make_tensor(f"end{a}", TensorProto.INT64, [1], [a + 1]) for a in (0, 1)]
    graph = h.make_graph(
        nodes, "g", [h.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 32])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, output_dims)], constants,
        value_info=[h.make_tensor_value_info("reshaped", TensorProto.FLOAT, output_dims)],
    )
    return ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 21)]))


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.l1
@pytest.mark.parametrize(("target", "output", "constant"), [
    (["B", "S", 4, 8], ["B", "S", 4, 8], [0, 0, 4, 8]),  # split the last axis into heads
    (["B", 4, "S", 8], ["B", 4, "S", 8], [0, 4, -1, 8]),  # a dim that moves is inferred
    ([4, "S", "B", 8], [4, "S", "B", 8], [4, 0, -1, 8]),  # a dim in place is copied, even if others move
])
def test_targets_become_constants_with_the_same_results(target, output, constant):
    x = np.random.default_rng(0).standard_normal((2, 3, 32)).astype(np.float32)
    model = _model(target, output)
    want = _run(model, x)
    assert cpu_placed_nodes(model)  # Shape, Slice, Concat compute the target
    StaticReshapeTargets()(model, settings=None, session=None)
    reshape = next(n for n in model.graph if n.op_type == "Reshape")
    assert ir.convenience.get_const_tensor(reshape.inputs[1]).numpy().tolist() == constant
    onnx.checker.check_model(ir.to_proto(model))
    RemoveUnusedNodesPass()(model)
    assert cpu_placed_nodes(model) == []
    np.testing.assert_array_equal(_run(model, x), want)


@pytest.mark.l1
def test_a_target_with_two_unknown_entries_is_left_and_reported():
    model = _model(["S", "B", 32], ["S", "B", 32])  # both dynamic dims move: two entries to infer
    StaticReshapeTargets()(model, settings=None, session=None)
    reshape = next(n for n in model.graph if n.op_type == "Reshape")
    assert ir.convenience.get_const_tensor(reshape.inputs[1]) is None
    assert {n.op_type for n in cpu_placed_nodes(model)} == {"Shape", "Slice", "Concat"}
