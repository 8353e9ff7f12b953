"""L1/L3: ``fold_awq_divisions`` after ``quantize_weights`` under AWQ, on a tiny decoder-layer
graph: an RMS norm before a query and key projection sharing one s, another before an MLP's gate
and up projections sharing one s, and the MLP's ``silu(gate) * up`` before its down projection.

The fold must leave no Div and compute what the unfolded package computes. Both run at accuracy
level 0 (fp32 sums), so the two differ only in where x / s is rounded (inside the norm, or by the
Div; the up projection's block scales divided by s in float32): a few float32 ulps of each output's
terms. The bound is 1e-5 of the output's largest magnitude. Weights are scaled by 50 with
outliers, the norm weights far from 1, s spread over 16x, as real checkpoints have them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

from exporter.int4_options import Int4Options
from exporter.onnx_passes.fold_awq_divisions import FoldAwqDivisions
from exporter.onnx_passes.quantize_weights import AWQ_DIVISION, QuantizeWeights, _Quantizer
from exporter.sessions import SESSIONS
from tests.exporter.onnx_passes.test_quantize_weights import ONNX_OPSETS, _settings

pytestmark = pytest.mark.unit

K, HIDDEN, ROWS = 64, 96, 5
_RNG = np.random.default_rng(3)


def _weight(rows: int, columns: int) -> np.ndarray:
    weight = (_RNG.standard_normal((rows, columns)) * 50).astype(np.float32)
    weight[_RNG.integers(rows), _RNG.integers(columns)] = 900.0
    return weight


WEIGHTS = {"wq": _weight(K, K), "wk": _weight(K, 32), "wg": _weight(K, HIDDEN), "wu": _weight(K, HIDDEN),
           "wd": _weight(HIDDEN, K)}
NORM_WEIGHTS = {"attention_norm": (_RNG.standard_normal(K) * 4).astype(np.float32),
                "mlp_norm": (1 + np.abs(_RNG.standard_normal(K)) * 20).astype(np.float32)}
X = (_RNG.standard_normal((ROWS, K)) * 3).astype(np.float32)
X[1, 7] = 400.0  # a residual-stream outlier


def _spread(size: int) -> np.ndarray:
    return _RNG.permutation(np.geomspace(0.25, 4.0, size)).astype(np.float32)


QK_SCALE, MLP_SCALE, DOWN_SCALE = _spread(K), _spread(K), _spread(HIDDEN)
SCALES = {"wq": QK_SCALE, "wk": QK_SCALE, "wg": MLP_SCALE, "wu": MLP_SCALE, "wd": DOWN_SCALE}


def _model(norm_output_read_elsewhere: bool = False, dtype=np.float32, up_read_elsewhere: bool = False) -> ir.Model:
    nodes = [
        h.make_node("SimplifiedLayerNormalization", ["x", "attention_norm"], ["attention_in"], axis=-1,
                    epsilon=1e-6, name="attention_norm"),
        h.make_node("MatMul", ["attention_in", "wq"], ["q"], name="q_proj"),
        h.make_node("MatMul", ["attention_in", "wk"], ["k"], name="k_proj"),
        h.make_node("SimplifiedLayerNormalization", ["x", "mlp_norm"], ["mlp_in"], axis=-1, epsilon=1e-6,
                    name="mlp_norm"),
        h.make_node("MatMul", ["mlp_in", "wg"], ["gate"], name="gate_proj"),
        h.make_node("MatMul", ["mlp_in", "wu"], ["up"], name="up_proj"),
        h.make_node("Sigmoid", ["gate"], ["gate_sigmoid"], name="sigmoid"),
        h.make_node("Mul", ["gate", "gate_sigmoid"], ["gate_silu"], name="silu"),
        h.make_node("Mul", ["gate_silu", "up"], ["product"], name="product"),
        h.make_node("MatMul", ["product", "wd"], ["down"], name="down_proj"),
    ]
    element = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    outputs = [h.make_tensor_value_info("q", element, [ROWS, K]),
               h.make_tensor_value_info("k", element, [ROWS, 32]),
               h.make_tensor_value_info("down", element, [ROWS, K])]
    if norm_output_read_elsewhere:
        outputs.append(h.make_tensor_value_info("attention_in", element, [ROWS, K]))
    if up_read_elsewhere:
        outputs.append(h.make_tensor_value_info("up", element, [ROWS, HIDDEN]))
    initializers = [nh.from_array(v.astype(dtype), n) for n, v in {**WEIGHTS, **NORM_WEIGHTS}.items()]
    typed = [h.make_tensor_value_info(name, element, [ROWS, width])
             for name, width in (("attention_in", K), ("mlp_in", K), ("product", HIDDEN))]
    graph = h.make_graph(nodes, "layer", [h.make_tensor_value_info("x", element, [ROWS, K])], outputs,
                         initializers, value_info=[] if norm_output_read_elsewhere else typed[:1])
    graph.value_info.extend(typed[1:])
    return ir.from_proto(h.make_model(graph, opset_imports=ONNX_OPSETS))


def _awq_settings():
    return dataclasses.replace(_settings("int4", Int4Options(method="awq", accuracy_level=0)),
                               activation_aware_scales=SCALES)


def _run(model: ir.Model) -> dict[str, np.ndarray]:
    proto = ir.to_proto(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": X}), strict=True))
    for name, output in outputs.items():
        assert np.isfinite(output).all(), name
    return outputs


@pytest.mark.l3
def test_every_division_folds_into_the_norm_or_up_projection_before_it_and_the_outputs_hold():
    settings = _awq_settings()
    unfolded = _model()
    changes = QuantizeWeights()(unfolded, settings, SESSIONS["decoder"])
    # One Div per input and shared s: the query and key projections' and the gate and up's.
    assert changes["awq_scaled"] == 5 and changes["awq_divisions"] == 3
    folded = ir.from_proto(ir.to_proto(unfolded))
    counts = FoldAwqDivisions()(folded, settings, SESSIONS["decoder"])
    assert counts == {"into_norms": 2, "into_up_projections": 1, "divisions_left": 0}
    assert not any(node.op_type == "Div" for node in folded.graph)
    expected, got = _run(unfolded), _run(folded)
    for name in ("q", "k", "down"):
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-5 * np.abs(expected[name]).max(),
                                   err_msg=name)
    # The folded norm weights are the float ones divided by s: another norm reading the same
    # initializer would keep its own.
    norms = {node.name: node for node in folded.graph if node.op_type == "SimplifiedLayerNormalization"}
    np.testing.assert_allclose(norms["attention_norm"].inputs[1].const_value.numpy(),
                               NORM_WEIGHTS["attention_norm"] / QK_SCALE, rtol=1e-7)
    assert "attention_norm" not in folded.graph.initializers  # the unfolded copy, read by nothing


@pytest.mark.l1
def test_a_norm_output_something_else_reads_keeps_its_division():
    """The attention norm's output is also a graph output: dividing the norm's weight would change
    it, so that Div stays; the MLP's fold as before."""
    settings = _awq_settings()
    model = _model(norm_output_read_elsewhere=True)
    QuantizeWeights()(model, settings, SESSIONS["decoder"])
    counts = FoldAwqDivisions()(model, settings, SESSIONS["decoder"])
    assert counts == {"into_norms": 1, "into_up_projections": 1, "divisions_left": 1}
    divisions = [node for node in model.graph if node.op_type == "Div"]
    assert len(divisions) == 1 and divisions[0].inputs[0].name == "attention_in"
    assert AWQ_DIVISION not in divisions[0].metadata_props  # the package carries no marker
    np.testing.assert_array_equal(_run(model)["attention_in"], _run(_model(True))["attention_in"])


@pytest.mark.l1
def test_an_up_projection_output_something_else_reads_keeps_the_down_projections_division():
    """The up projection's output is also a graph output: dividing its block scales would change
    it, so the down projection's Div stays and ``up`` is what the unfolded graph gives."""
    settings = _awq_settings()
    model = _model(up_read_elsewhere=True)
    QuantizeWeights()(model, settings, SESSIONS["decoder"])
    unfolded = _run(model)
    counts = FoldAwqDivisions()(model, settings, SESSIONS["decoder"])
    assert counts == {"into_norms": 2, "into_up_projections": 0, "divisions_left": 1}
    assert [node.inputs[0].name for node in model.graph if node.op_type == "Div"] == ["product"]
    got = _run(model)
    for name in ("up", "down", "q", "k"):
        np.testing.assert_allclose(got[name], unfolded[name], rtol=0, atol=1e-5 * np.abs(unfolded[name]).max(),
                                   err_msg=name)


@pytest.mark.l1
def test_it_runs_only_on_awq_int4_sessions():
    assert FoldAwqDivisions().applies(_awq_settings(), SESSIONS["decoder"])
    assert FoldAwqDivisions().applies(_settings("int4"), SESSIONS["decoder"]) is None
    assert FoldAwqDivisions().applies(_settings("int8"), SESSIONS["decoder"]) is None
    assert FoldAwqDivisions().applies(_settings("fp32"), SESSIONS["decoder"]) is None


@pytest.mark.l1
def test_fp16_folds_only_what_stays_in_fp16s_normal_range():
    """At fp16 activations the up projection's block scales are fp16, and divided by s they could
    fall under fp16's normal range (the values are only known when the package is written): the
    down projection's Div stays. A norm weight whose division by s leaves fp16's normal range keeps
    its Div too."""
    settings = _awq_settings()
    model = _model(dtype=np.float16)
    loudest = int(np.argmax(QK_SCALE))  # s = 4 there: 1e-4 / 4 is under fp16's 6.1e-5
    attention_norm = model.graph.initializers["attention_norm"]
    weight = attention_norm.const_value.numpy().copy()
    weight[loudest] = 1e-4
    attention_norm.const_value = ir.tensor(weight)
    QuantizeWeights()(model, settings, SESSIONS["decoder"])
    counts = FoldAwqDivisions()(model, settings, SESSIONS["decoder"])
    assert counts == {"into_norms": 1, "into_up_projections": 0, "divisions_left": 2}
    left = {node.inputs[0].name for node in model.graph if node.op_type == "Div"}
    assert left == {"attention_in", "product"}
    mlp_norm = next(node for node in model.graph if node.name == "mlp_norm").inputs[1]
    assert mlp_norm.dtype == ir.DataType.FLOAT16
    np.testing.assert_allclose(mlp_norm.const_value.numpy().astype(np.float32),
                               NORM_WEIGHTS["mlp_norm"] / MLP_SCALE, rtol=2.0**-10)


@pytest.mark.l3
def test_a_layer_norms_scale_and_bias_and_a_skip_norm_fold_and_the_skip_sum_is_unchanged():
    """A LayerNormalization (scale and bias, both divided by s) before the query and key
    projections; a SkipSimplifiedLayerNormalization before the gate and up projections, whose
    residual sum output (a graph output) the fold must not touch."""
    bias = (_RNG.standard_normal(K) * 2).astype(np.float32)
    nodes = [
        h.make_node("LayerNormalization", ["x", "attention_norm", "attention_bias"], ["attention_in"], axis=-1,
                    epsilon=1e-5, name="attention_norm"),
        h.make_node("MatMul", ["attention_in", "wq"], ["q"], name="q_proj"),
        h.make_node("MatMul", ["attention_in", "wk"], ["k"], name="k_proj"),
        h.make_node("Add", ["q", "q"], ["skip"], name="skip"),
        h.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "mlp_norm"], ["mlp_in", "", "", "residual"],
                    domain="com.microsoft", epsilon=1e-6, name="mlp_norm"),
        h.make_node("MatMul", ["mlp_in", "wg"], ["gate"], name="gate_proj"),
        h.make_node("MatMul", ["mlp_in", "wu"], ["up"], name="up_proj"),
    ]
    initializers = [nh.from_array(v, n) for n, v in {**WEIGHTS, **NORM_WEIGHTS, "attention_bias": bias}.items()
                    if n != "wd"]
    typed = [h.make_tensor_value_info(name, TensorProto.FLOAT, [ROWS, K]) for name in ("attention_in", "mlp_in")]
    graph = h.make_graph(nodes, "norms", [h.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, K])],
                         [h.make_tensor_value_info(name, TensorProto.FLOAT, [ROWS, width])
                          for name, width in (("k", 32), ("residual", K), ("gate", HIDDEN), ("up", HIDDEN))],
                         initializers, value_info=typed)
    model = ir.from_proto(h.make_model(graph, opset_imports=ONNX_OPSETS))
    settings = _awq_settings()
    QuantizeWeights()(model, settings, SESSIONS["decoder"])
    expected = _run(model)
    counts = FoldAwqDivisions()(model, settings, SESSIONS["decoder"])
    assert counts == {"into_norms": 2, "into_up_projections": 0, "divisions_left": 0}
    got = _run(model)
    for name, values in expected.items():
        np.testing.assert_allclose(got[name], values, rtol=0, atol=1e-5 * np.abs(values).max(), err_msg=name)
    norm = next(node for node in model.graph if node.op_type == "LayerNormalization")
    np.testing.assert_allclose(norm.inputs[2].const_value.numpy(), bias / QK_SCALE, rtol=1e-7)


@pytest.mark.l3
def test_8_bit_roles_take_their_scale_and_their_divisions_fold(monkeypatch):
    """With the key and down projections 8-bit roles, each takes its s (stored W * s at 8 bits):
    the key projection shares the query projection's division, and both divisions fold as at 4
    bits, into the norm and the up projection."""
    monkeypatch.setattr(_Quantizer, "_eight_bit_role",
                        lambda self, source, tables, lm_head: "sensitive_layers" if source.name in ("wk", "wd") else None)
    settings = dataclasses.replace(
        _settings("int4", Int4Options(method="awq", accuracy_level=0, eight_bit=("sensitive_layers",))),
        activation_aware_scales=SCALES)
    model = _model()
    changes = QuantizeWeights()(model, settings, SESSIONS["decoder"])
    assert changes["eight_bit_sensitive_layers"] == 2
    assert changes["awq_scaled"] == 5 and changes["awq_divisions"] == 3 and changes["awq_scales_not_applied"] == 0
    unfolded = _run(model)
    counts = FoldAwqDivisions()(model, settings, SESSIONS["decoder"])
    assert counts == {"into_norms": 2, "into_up_projections": 1, "divisions_left": 0}
    matmuls = {node.name: node for node in model.graph if node.op_type == "MatMulNBits"}
    assert matmuls["k_proj.int8"].inputs[0] is matmuls["q_proj.int4"].inputs[0]  # both read the folded norm
    assert matmuls["down_proj.int8"].inputs[0].name == "product"
    got = _run(model)
    for name in ("q", "k", "down"):
        np.testing.assert_allclose(got[name], unfolded[name], rtol=0, atol=1e-5 * np.abs(unfolded[name]).max(),
                                   err_msg=name)
