"""L1/L3: ``tidy`` on a tiny graph holding one of each thing it cleans: a dead node, an unused
function and opset, a full-range Slice (transformers' ``x[:, :, i]`` lowers to such) and the
Identity it becomes, two equal subexpressions, a Constant node large enough to lift (16 elements
or more; smaller ones stay nodes), two equal constant initializers, and node doc strings and
metadata (torch.onnx's FX provenance). Two weights with equal values (fresh-init norms) stay two
initializers and are never read. What must stay stays: a Slice that cuts, both MatMuls, the outputs.

ONNX Runtime runs the graph before and after: merging equal nodes and dropping identities changes
no arithmetic, so outputs must be equal bit for bit. Tidying a tidy graph changes nothing.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

from exporter.onnx_passes.tidy import Tidy
from tests.helpers.counting_reader import CountingReader

pytestmark = pytest.mark.unit

WIDTH, OUT = 8, 3
I64_MAX = np.iinfo(np.int64).max
LOCAL = "pkg.torch.local"
_RNG = np.random.default_rng(0)
WEIGHT = _RNG.standard_normal((WIDTH, OUT)).astype(np.float32)  # both weights hold these values
X = _RNG.standard_normal((2, WIDTH)).astype(np.float32)


def _i64(name: str, values: list[int]) -> onnx.TensorProto:
    return nh.from_array(np.array(values, dtype=np.int64), name)


def _model() -> tuple[ir.Model, dict[str, CountingReader]]:
    """y = (Relu(x[:, 0:MAX]) + Relu(x) + arange(16)[:8] * k1 * k2) @ Wa + (same) @ Wb;
    z = x[:, 0:6] @ Constant(6 x 3); a dead Neg(x)."""
    nodes = [
        h.make_node("Slice", ["x", "zero", "max", "axis1", "step"], ["full"], name="full_slice",
                    doc_string="x[:, 0:]"),
        h.make_node("Relu", ["full"], ["relu_full"], name="relu_a"),
        h.make_node("Relu", ["x"], ["relu_x"], name="relu_b"),
        h.make_node("Add", ["relu_full", "relu_x"], ["sum"], name="add"),
        h.make_node("Identity", ["sum"], ["sum_id"], name="identity"),
        h.make_node("Constant", [], ["ramp"], name="ramp",
                    value=nh.from_array(np.arange(2 * WIDTH, dtype=np.float32)[:WIDTH], "ramp")),
        h.make_node("Add", ["sum_id", "ramp"], ["ramped"], name="add_ramp"),
        h.make_node("Mul", ["ramped", "k1"], ["scaled1"], name="mul_k1"),
        h.make_node("Mul", ["scaled1", "k2"], ["scaled2"], name="mul_k2"),
        h.make_node("MatMul", ["scaled2", "wa"], ["ya"], name="matmul_a"),
        h.make_node("MatMul", ["scaled2", "wb"], ["yb"], name="matmul_b"),
        h.make_node("Add", ["ya", "yb"], ["y"], name="add_out"),
        h.make_node("Slice", ["x", "zero", "six", "axis1", "step"], ["cut"], name="cut"),
        h.make_node("Constant", [], ["head"], name="head",
                    value=nh.from_array(np.arange(6 * OUT, dtype=np.float32).reshape(6, OUT) / 7, "head")),
        h.make_node("MatMul", ["cut", "head"], ["z"], name="matmul_head"),
        h.make_node("Neg", ["x"], ["dead"], name="dead"),
    ]
    nodes[1].metadata_props.add(key="pkg.torch.onnx.stack_trace", value="relu at model.py:1")
    initializers = [
        _i64("zero", [0]), _i64("max", [I64_MAX]), _i64("axis1", [1]), _i64("step", [1]), _i64("six", [6]),
        nh.from_array(np.full(WIDTH, 0.5, np.float32), "k1"), nh.from_array(np.full(WIDTH, 0.5, np.float32), "k2"),
        nh.from_array(np.zeros_like(WEIGHT), "wa"), nh.from_array(np.zeros_like(WEIGHT), "wb"),
    ]
    graph = h.make_graph(
        nodes, "tidy", [h.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", OUT]),
         h.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", OUT])], initializers)
    unused = h.make_function(LOCAL, "Unused", ["a"], ["b"], [h.make_node("Neg", ["a"], ["b"])], [h.make_opsetid("", 21)])
    model = ir.from_proto(h.make_model(
        graph, opset_imports=[h.make_opsetid("", 21), h.make_opsetid(LOCAL, 1), h.make_opsetid("com.microsoft", 1)],
        functions=[unused]))
    readers = {}
    for name in ("wa", "wb"):  # weights as an export attaches them: lazy, read when written
        readers[name] = CountingReader(WEIGHT)
        model.graph.initializers[name].const_value = ir.LazyTensor(readers[name], dtype=ir.DataType.FLOAT,
                                                                   shape=ir.Shape(WEIGHT.shape))
    return model, readers


def _run(model: ir.Model) -> list[np.ndarray]:
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    outputs = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": X})
    assert all(np.isfinite(output).all() for output in outputs)
    return outputs


@pytest.mark.l3
def test_tidy_cleans_each_kind_of_clutter_and_keeps_the_numbers():
    want = _run(_model()[0])
    model, readers = _model()
    changes = Tidy()(model, None, None)
    assert changes == {"initializers": 7, "full_range_slices_removed": 1}
    graph = model.graph
    ops = [node.op_type for node in graph]
    assert "Neg" not in ops and "Identity" not in ops  # dead node; the identity and the collapsed Slice
    assert ops.count("Relu") == 1  # Relu(x[:, 0:MAX]) and Relu(x) are one node now
    assert ops.count("Slice") == 1 and ops.count("MatMul") == 3
    add = next(node for node in graph if node.op_type == "Add")
    assert add.inputs[0] is add.inputs[1]  # the sum reads the one Relu twice
    # The 18-element head is an initializer now; the 8-element ramp stays a Constant node.
    assert ops.count("Constant") == 1 and "head" in graph.initializers
    assert next(node for node in graph if node.op_type == "Constant").outputs[0].name == "ramp"
    # Equal constants are one initializer (k1 = k2, step = axis1); the equal weights stay two, unread.
    assert sorted(graph.initializers) == ["axis1", "head", "k1", "six", "wa", "wb", "zero"]
    mul_inputs = [node.inputs[1].name for node in graph if node.op_type == "Mul"]
    assert mul_inputs == ["k1", "k1"]
    assert {name: reader.reads for name, reader in readers.items()} == {"wa": 0, "wb": 0}
    # No unused function or opset; no provenance left on any node.
    assert len(model.functions) == 0 and model.opset_imports == {"": 21}
    assert all(not node.doc_string and not node.metadata_props for node in graph)
    assert [value.name for value in graph.outputs] == ["y", "z"]
    got = _run(model)
    for output, expected in zip(got, want, strict=True):
        np.testing.assert_array_equal(output, expected)


@pytest.mark.l1
def test_tidying_a_tidy_graph_changes_nothing():
    model, readers = _model()
    Tidy()(model, None, None)
    before = ir.to_proto(model).SerializeToString()
    for reader in readers.values():
        reader.reads = 0
    assert Tidy()(model, None, None) == {"initializers": 7, "full_range_slices_removed": 0}
    assert ir.to_proto(model).SerializeToString() == before


@pytest.mark.l1
@pytest.mark.parametrize(("ends", "collapsed"), [([I64_MAX], True), ([WIDTH], True), ([WIDTH - 1], False)],
                         ids=["to int64 max", "to the static width", "one short"])
def test_only_a_slice_over_the_whole_axis_is_removed(ends, collapsed):
    """Slices with all five inputs, as torch.onnx writes them (onnxscript's rule matches only
    those: a four-input full-range Slice stays)."""
    graph = h.make_graph(
        [h.make_node("Slice", ["x", "zero", "ends", "axis1", "step"], ["sliced"], name="slice"),
         h.make_node("Relu", ["sliced"], ["y"], name="relu")],
        "slice", [h.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", None])],
        [_i64("zero", [0]), _i64("ends", ends), _i64("axis1", [1]), _i64("step", [1])])
    model = ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 21)]))
    want = _run(model)
    changes = Tidy()(model, None, None)
    assert changes["full_range_slices_removed"] == int(collapsed)
    assert [node.op_type for node in model.graph] == (["Relu"] if collapsed else ["Slice", "Relu"])
    np.testing.assert_array_equal(_run(model)[0], want[0])
