"""L1/L3: ``fold_weight_transposes`` on tiny graphs: what each session of a package gets, and the
same numbers either way.

An int4 package quantizes its decoder and embedding; its vision and speech towers stay float
unless ``--int4-encoders``. The pass asks the plan about its session, so a float tower of an int4
package is read transposed (``FusedMatMul``) exactly as a float package's is, and only a
quantized session keeps ``MatMul`` for the quantizer (which stores a tied table once).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as h

from ep_profiles import get_profile
from exporter.onnx_passes.fold_weight_transposes import FoldWeightTransposes
from exporter.plan import export_settings
from exporter.precisions import int4_options
from exporter.sessions import SESSIONS

pytestmark = pytest.mark.unit

IN, OUT, ROWS = 8, 16, 3
WEIGHT = np.random.default_rng(0).standard_normal((OUT, IN)).astype(np.float32) * 1.7  # [out, in], as nn.Linear


def _linear_model(tied: bool) -> ir.Model:
    """y = x @ W.T as torch.onnx lowers a linear layer; ``tied``: W is also gathered (an embedding
    table that is the LM head)."""
    nodes = [h.make_node("Transpose", ["weight"], ["weight_t"], perm=[1, 0]),
             h.make_node("MatMul", ["x", "weight_t"], ["y"])]
    inputs = [h.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, IN])]
    outputs = [h.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, OUT])]
    if tied:
        nodes.append(h.make_node("Gather", ["weight", "ids"], ["rows"]))
        inputs.append(h.make_tensor_value_info("ids", TensorProto.INT64, [2]))
        outputs.append(h.make_tensor_value_info("rows", TensorProto.FLOAT, [2, IN]))
    graph = h.make_graph(nodes, "linear", inputs, outputs, [onnx.numpy_helper.from_array(WEIGHT, "weight")])
    return ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("com.microsoft", 1)]))


def _settings(precision: str, int4_encoders: bool = False):
    profile = get_profile("cpu")  # runs a transposed MatMul (FusedMatMul with transB)
    return export_settings(profile, None, precision, int4=int4_options(profile, precision, None),
                           int4_encoders=int4_encoders)


def _ops(model: ir.Model) -> list[str]:
    return sorted(node.op_type for node in model.graph)


def _run(model: ir.Model, feeds: dict) -> list[np.ndarray]:
    proto = ir.to_proto(model)  # writes the lazy transposed initializers
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


CASES = {
    # (precision, session, int4_encoders) -> (ops after, counts)
    "fp32 decoder": (("fp32", "decoder", False), ["FusedMatMul"], {"weights_read_transposed": 1}),
    "int4 decoder": (("int4", "decoder", False), ["MatMul"], {"weights_transposed": 1}),
    "int4 vision, float tower": (("int4", "vision", False), ["FusedMatMul"], {"weights_read_transposed": 1}),
    "int4 speech, float tower": (("int4", "speech", False), ["FusedMatMul"], {"weights_read_transposed": 1}),
    "int4 vision, --int4-encoders": (("int4", "vision", True), ["MatMul"], {"weights_transposed": 1}),
}


@pytest.mark.l3
@pytest.mark.parametrize("case", list(CASES))
def test_each_session_is_folded_as_its_own_weights_are_stored(case):
    (precision, session, encoders), ops, counts = CASES[case]
    settings = _settings(precision, encoders)
    assert settings.quantized(SESSIONS[session]) == (ops == ["MatMul"])
    model = _linear_model(tied=False)
    x = np.random.default_rng(1).standard_normal((ROWS, IN)).astype(np.float32) * 40  # past 1, as real activations are
    (want,) = _run(_linear_model(tied=False), {"x": x})
    changes = FoldWeightTransposes()(model, settings, SESSIONS[session])
    assert _ops(model) == ops
    assert {k: v for k, v in changes.items() if v} == counts
    (got,) = _run(model, {"x": x})
    assert np.isfinite(got).all() and np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-4)  # fp32 sums of 8 products, reordered at most


@pytest.mark.l3
@pytest.mark.parametrize("session, ops, counts", [
    ("vision", ["FusedMatMul", "Gather"], {"weights_read_transposed": 1, "tied_weights_read_transposed": 1}),
    ("decoder", ["Gather", "MatMul", "Transpose"], {}),  # the quantizer stores the shared table once
], ids=["float tower", "quantized decoder"])
def test_a_tied_weight_in_an_int4_package(session, ops, counts):
    model = _linear_model(tied=True)
    feeds = {"x": np.random.default_rng(2).standard_normal((ROWS, IN)).astype(np.float32),
             "ids": np.array([3, 0], dtype=np.int64)}
    want = _run(_linear_model(tied=True), feeds)
    changes = FoldWeightTransposes()(model, _settings("int4"), SESSIONS[session])
    assert _ops(model) == ops
    assert {k: v for k, v in changes.items() if v} == counts
    assert len(model.graph.initializers) == 1  # stored once either way
    for got, expected in zip(_run(model, feeds), want, strict=True):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-5)
