"""L1/L3: ``inline_functions`` flattens the model-local functions torch.onnx emits (one per module
call, some calling others) into one graph, as the later passes match nodes of one flat graph. Only
functions that were called are removed (an unused one is tidy's to drop); a model without calls is
left as it was. ONNX Runtime runs the model before and after: the same nodes in the same order,
so outputs must be equal bit for bit.
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

from ep_profiles import get_profile
from exporter.onnx_passes.inline_functions import InlineFunctions
from exporter.plan import export_settings
from exporter.precisions import int4_options
from exporter.sessions import SESSIONS

pytestmark = pytest.mark.unit

LOCAL = "pkg.torch.local"  # torch.onnx's domain for module functions is of this form
WIDTH = 4
_RNG = np.random.default_rng(0)
WEIGHTS = [(_RNG.standard_normal((WIDTH, WIDTH)) * 0.7).astype(np.float32) for _ in range(2)]
X = _RNG.standard_normal((3, WIDTH)).astype(np.float32)

_ONNX = h.make_opsetid("", 21)
# Act(t) = Relu(t)^2; Block(x, w) = Act(x @ w): a function calling another.
ACT = h.make_function(LOCAL, "Act", ["t"], ["u"],
                      [h.make_node("Relu", ["t"], ["r"]), h.make_node("Mul", ["r", "r"], ["u"])], [_ONNX])
BLOCK = h.make_function(LOCAL, "Block", ["x", "w"], ["y"],
                        [h.make_node("MatMul", ["x", "w"], ["m"]), h.make_node("Act", ["m"], ["y"], domain=LOCAL)],
                        [_ONNX, h.make_opsetid(LOCAL, 1)])
UNUSED = h.make_function(LOCAL, "Unused", ["x"], ["y"], [h.make_node("Neg", ["x"], ["y"])], [_ONNX])


def _model(calls: bool) -> ir.Model:
    """Two calls of Block (``calls``), or the same computation written flat, with only a function
    nothing calls."""
    if calls:
        nodes = [h.make_node("Block", ["x", "w0"], ["h"], domain=LOCAL, name="block0"),
                 h.make_node("Block", ["h", "w1"], ["y"], domain=LOCAL, name="block1")]
    else:
        nodes = []
        for i, (a, out) in enumerate((("x", "h"), ("h", "y"))):
            nodes += [h.make_node("MatMul", [a, f"w{i}"], [f"m{i}"], name=f"matmul{i}"),
                      h.make_node("Relu", [f"m{i}"], [f"r{i}"], name=f"relu{i}"),
                      h.make_node("Mul", [f"r{i}", f"r{i}"], [out], name=f"square{i}")]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", TensorProto.FLOAT, [3, WIDTH])],
                         [h.make_tensor_value_info("y", TensorProto.FLOAT, [3, WIDTH])],
                         [nh.from_array(w, f"w{i}") for i, w in enumerate(WEIGHTS)])
    functions = [ACT, BLOCK, UNUSED] if calls else [UNUSED]
    return ir.from_proto(h.make_model(graph, opset_imports=[_ONNX, h.make_opsetid(LOCAL, 1)], functions=functions))


def _run(model: ir.Model) -> np.ndarray:
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    (y,) = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": X})
    assert np.isfinite(y).all()
    return y


@pytest.mark.l1
def test_applies_to_every_session():
    settings = export_settings(get_profile("cpu"), None, "int4", int4=int4_options(get_profile("cpu"), "int4", None))
    assert all(InlineFunctions().applies(settings, session) for session in SESSIONS.values())


@pytest.mark.l3
def test_nested_calls_become_one_flat_graph_with_the_same_outputs():
    model = _model(calls=True)
    want = _run(_model(calls=True))
    assert InlineFunctions()(model, None, None) == {"functions_inlined": 2}  # Block and Act
    assert [node.op_type for node in model.graph] == ["MatMul", "Relu", "Mul"] * 2
    assert all(node.domain == "" for node in model.graph)
    assert [f.name for f in model.functions.values()] == ["Unused"]  # never called: left for tidy
    names = [node.name for node in model.graph]
    assert len(set(names)) == len(names)  # each call's nodes got their own names
    # The first call's output feeds the second call's MatMul.
    second = [node for node in model.graph if node.op_type == "MatMul"][1]
    assert second.inputs[0].producer() is list(model.graph)[2]
    np.testing.assert_array_equal(_run(model), want)


@pytest.mark.l1
def test_a_model_without_calls_is_left_as_it_was():
    model = _model(calls=False)
    before = ir.to_proto(model).SerializeToString()
    assert InlineFunctions()(model, None, None) == {"functions_inlined": 0}
    assert ir.to_proto(model).SerializeToString() == before
    assert [f.name for f in model.functions.values()] == ["Unused"]  # dropping it is tidy's job


@pytest.mark.l3
def test_inlined_matches_the_flat_graph_written_by_hand():
    model = _model(calls=True)
    InlineFunctions()(model, None, None)
    np.testing.assert_array_equal(_run(model), _run(_model(calls=False)))
