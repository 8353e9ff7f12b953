"""ONNX fusions: RMSNorm (incl. Gemma's pow(-0.5) form) and skip-RMSNorm, with the rank guard."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ep_profiles import get_profile
from exporter.onnx_passes import ONNX_PASSES, run_onnx_passes
from exporter.onnx_passes.norm_fusions import FusionDidNotApply

pytestmark = pytest.mark.l3

D = 8
# What the norm-fusion passes read of the plan: the profile's norm fusions.
FACTS = type("Facts", (), {"profile": get_profile("cpu"), "precision": "fp32"})()
FUSION_PASSES = ("fuse_rms_norms", "fuse_skip_rms_norms", "fold_fusion_constants")


def run_fusions(model: ir.Model) -> dict[str, int]:
    """The CPU profile's norm-fusion passes; op type -> nodes made."""
    records = run_onnx_passes(model, [ONNX_PASSES[name] for name in FUSION_PASSES], FACTS)
    made = {r.name: r.changes.get("fused") for r in records}
    return {"SimplifiedLayerNormalization": made["fuse_rms_norms"],
            "SkipSimplifiedLayerNormalization": made["fuse_skip_rms_norms"]}


def _rms_norm_nodes(x: str, out: str, epsilon: str = "eps") -> list:
    return [
        helper.make_node("Pow", [x, "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1, noop_with_empty_axes=0),
        helper.make_node("Add", ["ms", epsilon], ["ms_eps"]),
        helper.make_node("Pow", ["ms_eps", "minus_half"], ["inv_rms"]),  # Gemma's form
        helper.make_node("Mul", [x, "inv_rms"], ["normed"]),
        helper.make_node("Mul", ["normed", "scale"], [out]),
    ]


def _model(nodes, inputs, extra_initializers=()) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    initializers = [
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        numpy_helper.from_array(np.array(-0.5, np.float32), "minus_half"),
        numpy_helper.from_array(np.array([-1], np.int64), "axes"),
        numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
        numpy_helper.from_array(rng.standard_normal(D).astype(np.float32), "scale"),
        *extra_initializers,
    ]
    graph = helper.make_graph(
        nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializers
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return onnx.shape_inference.infer_shapes(model)


def _fuse_and_compare(proto: onnx.ModelProto, feeds: dict) -> dict[str, int]:
    expected = ort.InferenceSession(proto.SerializeToString()).run(None, feeds)[0]
    model = ir.from_proto(proto)
    made = run_fusions(model)
    fused = ir.to_proto(model)
    actual = ort.InferenceSession(fused.SerializeToString()).run(None, feeds)[0]
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)
    assert not any(n.op_type in ("Pow", "ReduceMean") for n in fused.graph.node)
    return made


def _x(name="x"):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "seq", D])


def _feeds(*names):
    rng = np.random.default_rng(1)
    return {n: rng.standard_normal((2, 3, D)).astype(np.float32) for n in names}


def test_residual_add_and_rms_norm_fuse_to_skip_norm():
    nodes = [helper.make_node("Add", ["x", "residual"], ["sum"]), *_rms_norm_nodes("sum", "y")]
    fused = _fuse_and_compare(_model(nodes, [_x(), _x("residual")]), _feeds("x", "residual"))
    # the norm fuses first, then the Add folds into it
    assert fused == {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 1}


def test_rank_guard_keeps_bias_add_out_of_skip_norm():
    """Add(MatMul output, 1-D bias) + RMSNorm: ONNX Runtime rejects it as SkipSimplifiedLayerNormalization
    ("skip is expected to have 3 or 2 dimensions, got 1"), so only the norm itself may fuse."""
    rng = np.random.default_rng(2)
    weights = [
        numpy_helper.from_array(rng.standard_normal((D, D)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal(D).astype(np.float32), "bias"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["proj"]),
        helper.make_node("Add", ["proj", "bias"], ["biased"]),
        *_rms_norm_nodes("biased", "y"),
    ]
    fused = _fuse_and_compare(_model(nodes, [_x()], weights), _feeds("x"))
    assert fused == {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 0}


def test_rms_norm_that_cannot_fuse_is_an_error():
    """An epsilon that is not a constant defeats the fusion; asked for and not done is an error."""
    epsilon = helper.make_tensor_value_info("runtime_eps", TensorProto.FLOAT, [])
    model = ir.from_proto(_model(_rms_norm_nodes("x", "y", epsilon="runtime_eps"), [_x(), epsilon]))
    with pytest.raises(FusionDidNotApply, match="matched nothing.*1 mean-of-squares"):
        run_fusions(model)
