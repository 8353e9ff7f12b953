"""L1: bf16 ops that ONNX's schemas lack at opset 21 compute in float32 between Casts, and the
export refuses any graph whose ops' types their schemas do not allow.

The graph is Gemma 4's audio-tower pattern in small: a bf16 Conv whose bias is computed (untyped
until the folder runs) and a Softplus whose values are untyped, as an inlined function leaves them. The reference
is PyTorch's bf16 conv and softplus; ONNX Runtime's CPU EP runs the widened graph (its bf16 kernels
are Casts only). Tolerance: one bf16 step (2**-8 relative): both round a float32 result once, and
the two float32 sums may differ in their last bits.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper

from exporter.errors import ExporterBug
from exporter.onnx_passes.schema_types import dtype_refusals
from exporter.onnx_passes.widen_unsupported_dtypes import WidenUnsupportedDtypes
from exporter.verify.postconditions import require

pytestmark = pytest.mark.unit

BF16_STEP = 2.0**-8


def _conv_softplus(weight: torch.Tensor, bias: torch.Tensor) -> ir.Model:
    """x (fp32) -> bf16 -> Conv(weight, bias reshaped) -> Softplus -> fp32; the reshaped bias,
    ``conv_out`` and ``softplus_out`` carry no type, as torch.onnx leaves an inlined function's
    values."""
    weight_bytes = numpy_helper.from_array(weight.view(torch.int16).numpy(), "weight")
    weight_bytes.data_type = TensorProto.BFLOAT16
    bias_bytes = numpy_helper.from_array(bias.view(torch.int16).numpy(), "bias")
    bias_bytes.data_type = TensorProto.BFLOAT16
    shape = numpy_helper.from_array(np.array([-1], dtype=np.int64), "shape")
    nodes = [
        h.make_node("Cast", ["x"], ["x_bf16"], to=TensorProto.BFLOAT16),
        h.make_node("Reshape", ["bias", "shape"], ["bias_1d"]),
        h.make_node("Conv", ["x_bf16", "weight", "bias_1d"], ["conv_out"], pads=[1, 1], name="conv"),
        h.make_node("Softplus", ["conv_out"], ["softplus_out"], name="softplus"),
        h.make_node("Cast", ["softplus_out"], ["y"], to=TensorProto.FLOAT),
    ]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16])],
                         [h.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                         [weight_bytes, bias_bytes, shape],
                         value_info=[h.make_tensor_value_info("x_bf16", TensorProto.BFLOAT16, [1, 3, 16])])
    return ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 21)]))


def _session(model: ir.Model) -> ort.InferenceSession:
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])


class _Facts:
    compute_dtype = torch.bfloat16


@pytest.mark.l1
def test_bf16_conv_and_softplus_compute_in_float32_as_torch_does():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 3, 3, generator=generator).to(torch.bfloat16)
    bias = torch.randn(4, generator=generator).to(torch.bfloat16)
    x = torch.randn(1, 3, 16, generator=generator)
    model = _conv_softplus(weight, bias)
    assert {(str(r.node.op_type), r.dtype) for r in dtype_refusals(model)} == {
        ("Conv", ir.DataType.BFLOAT16), ("Softplus", ir.DataType.BFLOAT16)}
    with pytest.raises(Exception, match="INVALID_GRAPH|invalid"):  # what ONNX Runtime said before
        _session(model)

    assert WidenUnsupportedDtypes()(model, _Facts(), session=None) == {"nodes_widened": 2}

    assert dtype_refusals(model) == []
    for name in ("conv", "softplus"):
        node = next(n for n in model.graph if n.name == name)
        assert all(v.dtype == ir.DataType.FLOAT for v in node.inputs) and node.outputs[0].dtype == ir.DataType.FLOAT
    got = torch.from_numpy(_session(model).run(None, {"x": x.numpy()})[0])
    want = torch.nn.functional.softplus(torch.nn.functional.conv1d(x.to(torch.bfloat16), weight, bias, padding=1))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want.float(), rtol=BF16_STEP, atol=BF16_STEP)


@pytest.mark.l1
def test_the_export_refuses_a_graph_its_schemas_do_not_allow():
    model = _conv_softplus(torch.zeros(4, 3, 3, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16))

    class Session:
        name, is_decoder = "speech", False

    with pytest.raises(ExporterBug, match=r"speech session .* \(Conv conv on tensor\(bfloat16\), "
                                          r"Softplus softplus on tensor\(bfloat16\)\)"):
        require(model, None, Session())


@pytest.mark.l1
def test_an_fp32_graph_is_left_as_it_was():
    model = _conv_softplus(torch.zeros(4, 3, 3, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16))
    for node in list(model.graph):
        if node.op_type == "Cast" and node.attributes["to"].value == ir.DataType.BFLOAT16:
            node.attributes["to"] = ir.AttrInt64("to", ir.DataType.FLOAT)
    for name in ("weight", "bias"):
        initializer = model.graph.initializers[name]
        initializer.const_value = ir.tensor(initializer.const_value.numpy().astype(np.float32), name=name)
        initializer.dtype = ir.DataType.FLOAT
    model.graph.node(0).outputs[0].dtype = ir.DataType.FLOAT
    assert dtype_refusals(model) == []
    assert WidenUnsupportedDtypes()(model, _Facts(), session=None) == {}


def _model(nodes, inputs, outputs, initializers=(), value_info=()) -> ir.Model:
    graph = h.make_graph(nodes, "g", inputs, outputs, list(initializers), value_info=list(value_info))
    return ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 21)]))


def _bf16(name: str, shape) -> object:
    return h.make_tensor_value_info(name, TensorProto.BFLOAT16, shape)


@pytest.mark.l1
def test_nodes_whose_other_outputs_follow_the_input_stay_for_the_postconditions():
    """``RandomNormalLike`` without a dtype gives its input's type (no bf16 input at opset 21):
    widening its input would change its output, so it is left, and the export refuses it (as ONNX
    Runtime would)."""
    model = _model([h.make_node("RandomNormalLike", ["x"], ["noise"], name="noise"),
                    h.make_node("Add", ["noise", "x"], ["y"])],
                   [_bf16("x", [2])], [_bf16("y", [2])])
    refused = dtype_refusals(model)
    assert [str(r) for r in refused] == ["RandomNormalLike noise on tensor(bfloat16)"]
    assert WidenUnsupportedDtypes()(model, _Facts(), session=None) == {}
    assert dtype_refusals(model) == refused


@pytest.mark.l1
def test_one_type_parameter_bound_to_two_dtypes_is_refused():
    """What a wrong widening would leave (a Split reading float32 and giving bf16): refused."""
    model = _model([h.make_node("Split", ["x"], ["a", "b"], axis=0, num_outputs=2, name="split")],
                   [h.make_tensor_value_info("x", TensorProto.FLOAT, [4])], [_bf16("a", [2]), _bf16("b", [2])])
    (refused,) = dtype_refusals(model)
    assert str(refused) == "Split split with T bound to tensor(float) and tensor(bfloat16)"
    assert WidenUnsupportedDtypes()(model, _Facts(), session=None) == {}


@pytest.mark.l1
def test_sequences_are_not_read_as_their_elements():
    """An fp16 sequence is valid where its ops take ``seq(tensor(float16))``; its element dtype is
    not the sequence's type."""
    parts = h.make_value_info("parts", h.make_sequence_type_proto(h.make_tensor_type_proto(TensorProto.FLOAT16, None)))
    model = _model([h.make_node("SplitToSequence", ["x"], ["parts"], axis=0),
                    h.make_node("SequenceAt", ["parts", "zero"], ["y"])],
                   [h.make_tensor_value_info("x", TensorProto.FLOAT16, [4])],
                   [h.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
                   [numpy_helper.from_array(np.array(0, dtype=np.int64), "zero")], [parts])
    assert dtype_refusals(model) == []
    _session(model)


@pytest.mark.l1
def test_subgraph_nodes_are_checked_and_widened_with_names_of_their_own():
    """A bf16 ``Softplus`` in each branch of an ``If`` reading the outer ``x``: each branch gets its
    own cast of it, under its own name, and the model loads."""
    def branch(name: str):
        return h.make_graph([h.make_node("Softplus", ["x"], [f"{name}_out"], name=f"{name}_softplus")], name, [],
                            [_bf16(f"{name}_out", [2])])

    model = _model([h.make_node("If", ["flag"], ["picked"], then_branch=branch("then"), else_branch=branch("else")),
                    h.make_node("Cast", ["picked"], ["y"], to=TensorProto.FLOAT)],
                   [_bf16("x", [2]), h.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                   [h.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    assert sorted(str(r) for r in dtype_refusals(model)) == ["Softplus else_softplus on tensor(bfloat16)",
                                                             "Softplus then_softplus on tensor(bfloat16)"]
    assert WidenUnsupportedDtypes()(model, _Facts(), session=None) == {"nodes_widened": 2}
    assert dtype_refusals(model) == []
    casts = [n.outputs[0].name for n in model.graph.all_nodes() if n.op_type == "Cast" and n.name.endswith("to_float32")]
    assert sorted(casts) == ["x.as_float32", "x.as_float32.2"]
    _session(model)  # loads: ONNX Runtime's CPU EP has bf16 Cast and float32 Softplus


@pytest.mark.l1
def test_outputs_typed_by_an_attribute_are_left_for_the_postconditions():
    """``RandomNormal(dtype=bf16)``: its output's type is its attribute, which a widening would not
    change; left, and refused."""
    model = _model([h.make_node("RandomNormal", [], ["noise"], dtype=TensorProto.BFLOAT16, shape=[2], name="noise")],
                   [], [_bf16("noise", [2])])
    assert [str(r) for r in dtype_refusals(model)] == ["RandomNormal noise on tensor(bfloat16)"]
    assert WidenUnsupportedDtypes()(model, _Facts(), session=None) == {}


@pytest.mark.l1
def test_heterogeneous_outputs_may_differ_in_type():
    """An ``If`` giving a float and an int64: its outputs' formal is heterogeneous, so that is valid."""
    def branch(name: str):
        return h.make_graph([h.make_node("Identity", ["x"], [f"{name}_x"]), h.make_node("Identity", ["n"], [f"{name}_n"])],
                            name, [], [h.make_tensor_value_info(f"{name}_x", TensorProto.FLOAT, [2]),
                                       h.make_tensor_value_info(f"{name}_n", TensorProto.INT64, [])])

    model = _model([h.make_node("If", ["flag"], ["y", "m"], then_branch=branch("then"), else_branch=branch("else"))],
                   [h.make_tensor_value_info("x", TensorProto.FLOAT, [2]), h.make_tensor_value_info("n", TensorProto.INT64, []),
                    h.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                   [h.make_tensor_value_info("y", TensorProto.FLOAT, [2]), h.make_tensor_value_info("m", TensorProto.INT64, [])])
    assert dtype_refusals(model) == []
    _session(model)
