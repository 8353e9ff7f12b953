"""ONNX fusions: RMSNorm (incl. Gemma's pow(-0.5) form, and without a scale) and skip-RMSNorm, with
the rank guard."""

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
from exporter.sessions import SESSIONS

pytestmark = [pytest.mark.l3, pytest.mark.unit]

D = 8
# What the norm-fusion passes read of the plan: the profile's norm fusions.
FACTS = type("Facts", (), {"profile": get_profile("cpu"), "precision": "fp32"})()
FUSION_PASSES = ("fuse_rms_norms", "fuse_skip_rms_norms", "fold_fusion_constants")


def run_fusions(model: ir.Model) -> dict[str, int]:
    """The CPU profile's norm-fusion passes; op type -> nodes made."""
    records = run_onnx_passes(model, [ONNX_PASSES[name] for name in FUSION_PASSES], FACTS, SESSIONS["decoder"])
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
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5, equal_nan=False)
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


def _unscaled_rms_norm_nodes(x: str, out: str, cast_inside: bool = False) -> list:
    """``x / sqrt(mean(x**2) + eps)`` with no scale (Gemma 4's value norm); ``cast_inside``: in
    float32 between a Cast from x's dtype and a Cast back."""
    computed = f"{x}_float" if cast_inside else x
    nodes = [helper.make_node("Cast", [x], [computed], to=TensorProto.FLOAT)] if cast_inside else []
    return [
        *nodes,
        helper.make_node("Pow", [computed, "two"], [f"{x}_sq"]),
        helper.make_node("ReduceMean", [f"{x}_sq", "axes"], [f"{x}_ms"], keepdims=1, noop_with_empty_axes=0),
        helper.make_node("Add", [f"{x}_ms", "eps"], [f"{x}_ms_eps"]),
        helper.make_node("Pow", [f"{x}_ms_eps", "minus_half"], [f"{x}_inv_rms"]),
        helper.make_node("Mul", [computed, f"{x}_inv_rms"], [f"{x}_normed" if cast_inside else out]),
        *([helper.make_node("Cast", [f"{x}_normed"], [out], to=TensorProto.FLOAT16)] if cast_inside else []),
    ]


def test_unscaled_rms_norm_fuses_with_a_scale_of_ones_beside_a_scaled_one():
    """The unscaled norm becomes one SimplifiedLayerNormalization whose scale is ones; the scaled
    norm, which holds the same pattern, keeps its own scale (no ones-then-scale split)."""
    nodes = [
        *_rms_norm_nodes("x", "scaled"),
        *_unscaled_rms_norm_nodes("x2", "unscaled"),
        helper.make_node("Add", ["scaled", "unscaled"], ["y"]),
    ]
    proto = _model(nodes, [_x(), _x("x2")])
    made = _fuse_and_compare(proto, _feeds("x", "x2"))
    assert made == {"SimplifiedLayerNormalization": 2, "SkipSimplifiedLayerNormalization": 0}
    model = ir.from_proto(proto)
    run_fusions(model)
    scales = {node.inputs[0].name: node.inputs[1] for node in model.graph if node.op_type == "SimplifiedLayerNormalization"}
    assert scales["x"].name == "scale"
    np.testing.assert_array_equal(scales["x2"].const_value.numpy(), np.ones(D, np.float32))
    assert [node.op_type for node in model.graph] == ["SimplifiedLayerNormalization"] * 2 + ["Add"]


def test_half_precision_unscaled_rms_norm_in_float32_fuses_to_one_node():
    """Cast to float32, the norm, Cast back (eight nodes) -> one norm in float16 with float32
    statistics. Tolerance: one float16 ulp of the largest outputs (2**-9 below 4; |y| <= sqrt(8)),
    the two results being rounded to float16 once each."""
    nodes = _unscaled_rms_norm_nodes("x", "y", cast_inside=True)
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", "seq", D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
        [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
         numpy_helper.from_array(np.array(-0.5, np.float32), "minus_half"),
         numpy_helper.from_array(np.array([-1], np.int64), "axes"),
         numpy_helper.from_array(np.array(1e-6, np.float32), "eps")],
    )
    proto = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    feeds = {"x": (np.random.default_rng(3).standard_normal((2, 3, D)) * 4).astype(np.float16)}
    expected = ort.InferenceSession(proto.SerializeToString()).run(None, feeds)[0]
    model = ir.from_proto(proto)
    assert run_fusions(model)["SimplifiedLayerNormalization"] == 1
    assert [node.op_type for node in model.graph] == ["SimplifiedLayerNormalization"]
    norm = next(iter(model.graph))
    assert norm.inputs[0].name == "x" and norm.inputs[1].const_value.dtype == ir.DataType.FLOAT16
    assert norm.attributes.get_int("stash_type") == TensorProto.FLOAT
    actual = ort.InferenceSession(ir.to_proto(model).SerializeToString()).run(None, feeds)[0]
    assert actual.dtype == np.float16
    np.testing.assert_allclose(actual.astype(np.float32), expected.astype(np.float32), rtol=0, atol=2**-9, equal_nan=False)


def test_unscaled_rms_norms_of_one_size_share_one_scale_of_ones():
    nodes = [
        *_unscaled_rms_norm_nodes("x", "a"),
        *_unscaled_rms_norm_nodes("x2", "b"),
        helper.make_node("Add", ["a", "b"], ["y"]),
    ]
    model = ir.from_proto(_model(nodes, [_x(), _x("x2")]))
    assert run_fusions(model)["SimplifiedLayerNormalization"] == 2
    scales = {node.inputs[1] for node in model.graph if node.op_type == "SimplifiedLayerNormalization"}
    assert [scale.name for scale in scales] == [f"unit_scale_float_{D}"]


@pytest.mark.parametrize("change", ["statistics over another axis", "normalizes another tensor"])
def test_what_only_looks_like_an_unscaled_rms_norm_does_not_fuse(change):
    """Not an RMSNorm of x over its last axis: no fusion, and the pass says so rather than
    leaving it silently unfused."""
    nodes = _unscaled_rms_norm_nodes("x", "y")
    extra, inputs = [], [_x()]
    if change == "statistics over another axis":
        nodes[1] = helper.make_node("ReduceMean", ["x_sq", "axis_1"], ["x_ms"], keepdims=1)
        extra = [numpy_helper.from_array(np.array([1], np.int64), "axis_1")]
    else:
        nodes[-1] = helper.make_node("Mul", ["other", "x_inv_rms"], ["y"])
        inputs.append(_x("other"))
    model = ir.from_proto(_model(nodes, inputs, extra))
    with pytest.raises(FusionDidNotApply, match="matched nothing"):
        run_fusions(model)
    assert not any(node.op_type == "SimplifiedLayerNormalization" for node in model.graph)
