"""L1/L3: ``quantize_weights`` on tiny graphs: a MatMul with a constant weight becomes MatMulNBits
and an embedding Gather becomes GatherBlockQuantized, at int4 (asymmetric round-to-nearest by
default; symmetric; K-quant) and int8; a table tied to the LM head is stored once; a quantized export
with nothing to quantize is an error.

Weights are scaled by 50 with one outlier (900), as real weights are far from 1 and have outliers;
activations are past 1 too. Each check is bounded by the stored blocks themselves (read back from
the written model and dequantized with numpy, ``_dequantize``), per element, with its block's step
``s = |scale|``:

- stored weight vs float weight: round-to-nearest with zero points is off by at most s/2;
  symmetric blocks (int4 symmetric, int8) map the block's largest magnitude to the end of the
  signed range (-8 or -128), so values of the other sign reach only 7 (127) steps: off by up to s;
  K-quant fits scale and minimum by least squares and may clip a block's extremes (up to 1.09 s
  measured on such weights): 1.5 s. HQQ keeps the range's scale and moves a float zero point to
  cut the l_0.7 error, which may clip the extremes too; nothing bounds that drift (0.55 s on these
  weights, up to 1.05 s measured on heavy-tailed ones): 1.5 s, as for K-quant. Under
  HQQ the table is round-to-nearest with integer zero points (GatherBlockQuantized takes no float
  ones): s/2.
- ONNX Runtime vs numpy on the stored blocks: at accuracy level 0 fp32 sums of K products,
  reordered at most (K float32 ulps of sum |x| |w|); at level 4 (the CPU profile's) the activations
  are also quantized to int8 per block of 32 (scale max|x| / 127): off by at most half that step
  times the sum of |w| over the block, summed over blocks.
- ONNX Runtime vs the float graph: the two above added, the weights' error taken at its bound.
- GatherBlockQuantized's rows vs numpy's dequantized rows: one float32 rounding (2**-23 relative).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

from ep_profiles import get_profile
from exporter.errors import ExporterError
from exporter.int4_options import Int4Options
from exporter.load.layout import DecoderLayout, KvLayer
from exporter.onnx_passes.quantize_weights import QuantizeWeights
from exporter.plan import export_settings
from exporter.precisions import int4_options
from exporter.sessions import SESSIONS
from exporter.weights.block_rounding import round_trip

pytestmark = pytest.mark.unit

K, N, VOCAB, ROWS, SMALL_K, BLOCK = 64, 48, 40, 3, 16, 32
EPS32 = 2.0**-24
_RNG = np.random.default_rng(0)
WEIGHT = (_RNG.standard_normal((K, N)) * 50).astype(np.float32)  # x @ W: [k, n]
WEIGHT[5, 7] = 900.0  # an outlier: its block steps several times wider than the others
TABLE = (_RNG.standard_normal((VOCAB, K)) * 50).astype(np.float32)
TABLE[3, 40] = -900.0
SMALL = _RNG.standard_normal((SMALL_K, 8)).astype(np.float32)  # K under one block: stays float
X = (_RNG.standard_normal((ROWS, K)) * 3).astype(np.float32)
X[0, 3] = 40.0  # an activation outlier, as residual streams have
X_SMALL = _RNG.standard_normal((ROWS, SMALL_K)).astype(np.float32)
IDS = np.array([0, 3, 39, 3, 17], dtype=np.int64)

ONNX_OPSETS = [h.make_opsetid("", 21), h.make_opsetid("com.microsoft", 1)]
LAYOUT = DecoderLayout(model_type="llama", num_layers=1, num_attention_heads=2, hidden_size=K, vocab_size=VOCAB,
                       context_length=128, kv_layers=(KvLayer(0, 1, 32),), sliding_window=None, num_kv_shared_layers=0)


def _settings(precision: str, options: Int4Options | None = None, accuracy_level: int | None = None,
              int4_encoders: bool = False):
    profile = get_profile("cpu")
    settings = export_settings(profile, LAYOUT, precision, int4=int4_options(profile, precision, options),
                               int4_encoders=int4_encoders)
    if accuracy_level is not None:  # int8 takes no options: its accuracy level set here
        settings = dataclasses.replace(settings, int4=dataclasses.replace(settings.int4, accuracy_level=accuracy_level))
    return settings


def _model(transposed: bool) -> ir.Model:
    """y = x @ W (W stored [k, n], or [n, k] read through a Transpose, as torch.onnx leaves large
    weights); rows = table[ids]; small = x_small @ SMALL (K = 16, under one block)."""
    nodes, initializers = [], [nh.from_array(TABLE, "table"), nh.from_array(SMALL, "small")]
    if transposed:
        nodes.append(h.make_node("Transpose", ["w_t"], ["w"], perm=[1, 0], name="w_transpose"))
        initializers.append(nh.from_array(np.ascontiguousarray(WEIGHT.T), "w_t"))
    else:
        initializers.append(nh.from_array(WEIGHT, "w"))
    nodes += [h.make_node("MatMul", ["x", "w"], ["y"], name="proj"),
              h.make_node("Gather", ["table", "ids"], ["rows"], name="embed"),
              h.make_node("MatMul", ["x_small", "small"], ["y_small"], name="small_proj")]
    graph = h.make_graph(
        nodes, "q",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, K]),
         h.make_tensor_value_info("ids", TensorProto.INT64, [len(IDS)]),
         h.make_tensor_value_info("x_small", TensorProto.FLOAT, [ROWS, SMALL_K])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, N]),
         h.make_tensor_value_info("rows", TensorProto.FLOAT, [len(IDS), K]),
         h.make_tensor_value_info("y_small", TensorProto.FLOAT, [ROWS, 8])],
        initializers)
    return ir.from_proto(h.make_model(graph, opset_imports=ONNX_OPSETS))


def _run(proto: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    onnx.checker.check_model(proto)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    for name, output in outputs.items():
        assert np.isfinite(output).all(), name
    return outputs


def _dequantize(blob: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, bits: int,
                k: int) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' parts -> (the weight [n, k] they hold, each element's block step |scale|), in
    float64: blob uint8 [n, blocks, block * bits / 8], 4-bit values low nibble first; zero points
    uint8 [n, ceil(blocks * bits / 8)], packed likewise at 4 bits, or HQQ's floats [n, blocks],
    else the middle of the range."""
    n, blocks, _ = blob.shape
    assert blob.dtype == np.uint8 and scales.shape == (n, blocks)
    if bits == 4:
        q = np.stack([blob & 0xF, blob >> 4], axis=-1).reshape(n, blocks, -1)
        if zero_points is not None and zero_points.dtype != np.uint8:  # HQQ's: a float per block
            assert zero_points.shape == (n, blocks) and zero_points.dtype == scales.dtype
            zeros = zero_points
        else:
            zeros = (np.full((n, blocks), 8) if zero_points is None
                     else np.stack([zero_points & 0xF, zero_points >> 4], axis=-1).reshape(n, -1)[:, :blocks])
    else:
        q = blob
        zeros = np.full((n, blocks), 128) if zero_points is None else zero_points
    block = q.shape[-1]
    values = (q.astype(np.float64) - zeros[..., None]) * scales[..., None].astype(np.float64)
    steps = np.repeat(np.abs(scales.astype(np.float64)), block, axis=1)
    return values.reshape(n, blocks * block)[:, :k], steps[:, :k]


def _stored(proto: onnx.ModelProto, name: str) -> np.ndarray | None:
    found = [nh.to_array(t) for t in proto.graph.initializer if t.name == name]
    return found[0] if found else None


def _activation_bound(x: np.ndarray, weight_kn: np.ndarray, accuracy_level: int) -> np.ndarray:
    """What accuracy level 4's int8 activations may add to x @ w: half an activation step per
    element of each block of 32 along K, times |w|; nothing at level 0."""
    if not accuracy_level:
        return np.zeros((x.shape[0], weight_kn.shape[1]))
    blocks = np.abs(x.astype(np.float64)).reshape(x.shape[0], -1, BLOCK).max(axis=-1) / 127
    return (np.repeat(blocks, BLOCK, axis=1) / 2) @ np.abs(weight_kn)


def _check_matmul(y: np.ndarray, x: np.ndarray, float_kn: np.ndarray, stored_kn: np.ndarray, steps_kn: np.ndarray,
                  step_factor: float, accuracy_level: int) -> None:
    """y (ONNX Runtime's MatMulNBits) against numpy on the stored blocks and against the float
    weight, each within its bound (module docstring)."""
    x64 = x.astype(np.float64)
    rounding = K * EPS32 * (np.abs(x64) @ np.abs(stored_kn))  # float32 sums, reordered
    activations = _activation_bound(x, stored_kn, accuracy_level)
    assert (np.abs(y - x64 @ stored_kn) <= activations + rounding).all()
    weights = np.abs(x64) @ (step_factor * steps_kn)
    assert (np.abs(y - x64 @ float_kn.astype(np.float64)) <= weights + activations + rounding).all()


# name: (precision, options, accuracy level override, bits, zero points, step factor)
CASES = {
    "int4 hqq": ("int4", Int4Options(method="hqq"), None, 4, True, 1.5),
    "int4 default": ("int4", None, None, 4, True, 0.5),
    "int4 accuracy level 0": ("int4", Int4Options(accuracy_level=0), None, 4, True, 0.5),
    "int4 symmetric": ("int4", Int4Options(symmetric=True), None, 4, False, 1.0),
    "int4 k_quant": ("int4", Int4Options(method="k_quant", accuracy_level=0), None, 4, True, 1.5),
    "int8": ("int8", None, None, 8, False, 1.0),
    "int8 accuracy level 0": ("int8", None, 0, 8, False, 1.0),
}


@pytest.mark.l3
@pytest.mark.parametrize("transposed", [False, True], ids=["weight [k, n]", "weight [n, k] transposed"])
@pytest.mark.parametrize("case", list(CASES))
def test_matmul_and_embedding_become_block_quantized_within_their_steps(case, transposed):
    precision, options, level_override, bits, zero_points, step_factor = CASES[case]
    settings = _settings(precision, options, level_override)
    level = settings.int4.accuracy_level
    assert level == (0 if "level 0" in case or "k_quant" in case else 4)  # the CPU profile's default is 4
    model = _model(transposed)
    changes = QuantizeWeights()(model, settings, SESSIONS["decoder"])
    hqq = settings.int4.method == "hqq"
    assert {k: v for k, v in changes.items() if v} == {"matmuls": 1, "gathers": 1} | ({"tables_round_to_nearest": 1} if hqq else {})

    assert sorted(node.op_type for node in model.graph) == ["GatherBlockQuantized", "MatMul", "MatMulNBits", "Reshape"]
    small = next(node for node in model.graph if node.op_type == "MatMul")
    assert small.inputs[1].name == "small"  # K under one block: left float
    for gone in ("w", "w_t", "table"):
        assert gone not in model.graph.initializers  # the float weights are not stored
    matmul = next(node for node in model.graph if node.op_type == "MatMulNBits")
    gather = next(node for node in model.graph if node.op_type == "GatherBlockQuantized")
    expected = {"K": K, "N": N, "bits": bits, "block_size": BLOCK} | ({"accuracy_level": level} if level else {})
    assert {name: attr.value for name, attr in matmul.attributes.items()} == expected
    assert {name: attr.value for name, attr in gather.attributes.items()} == {
        "bits": bits, "block_size": BLOCK, "gather_axis": 0, "quantize_axis": 1}
    assert len(matmul.inputs) == len(gather.inputs) == (4 if zero_points else 3)

    proto = ir.to_proto(model)  # quantizes the blocks
    blocks = K // BLOCK
    parts = {}
    for weight, rows in (("w_t" if transposed else "w", N), ("table", VOCAB)):
        blob = _stored(proto, f"{weight}.int{bits}")
        scales, zeros = _stored(proto, f"{weight}.scales"), _stored(proto, f"{weight}.zero_points")
        assert blob.shape == (rows, blocks, BLOCK * bits // 8) and scales.shape == (rows, blocks)
        assert scales.dtype == np.float32 and np.isfinite(scales).all() and (scales != 0).all()
        assert (zeros is not None) == zero_points
        if zero_points and hqq and weight != "table":
            assert zeros.dtype == np.float32 and zeros.shape == (rows, blocks) and np.isfinite(zeros).all()
            assert (zeros != np.round(zeros)).any()  # fitted, not the range's rounded minimum
        elif zero_points:
            assert zeros.dtype == np.uint8 and zeros.shape == (rows, -(-blocks * bits // 8))
        parts[weight] = _dequantize(blob, scales, zeros, bits, K)
    stored_w, steps_w = (m.T for m in parts["w_t" if transposed else "w"])  # [k, n]
    stored_table, steps_table = parts["table"]

    # Each block has its own scale: the outlier's block steps far wider than the rest.
    assert steps_w[5, 7] > 3 * np.median(steps_w)
    assert (np.abs(stored_w - WEIGHT) <= step_factor * steps_w * (1 + 1e-6)).all()
    table_factor = 0.5 if hqq else step_factor
    assert (np.abs(stored_table - TABLE) <= table_factor * steps_table * (1 + 1e-6)).all()

    got = _run(proto, {"x": X, "ids": IDS, "x_small": X_SMALL})
    _check_matmul(got["y"], X, WEIGHT, stored_w, steps_w, step_factor, level)
    np.testing.assert_allclose(got["rows"], stored_table[IDS], rtol=2.0**-23, atol=0)
    np.testing.assert_array_equal(got["y_small"], _run(ir.to_proto(_model(transposed)),
                                                       {"x": X, "ids": IDS, "x_small": X_SMALL})["y_small"])


def _tied_model(hidden: int, head: str) -> ir.Model:
    """rows = table[ids]; logits = h @ table.T, the head read through a Transpose of the table, or
    a folded copy of that transpose (constant folding copies a small tied head out of its table)."""
    table = TABLE[:, :hidden]
    nodes = [h.make_node("Gather", ["table", "ids"], ["rows"], name="embed")]
    initializers = [nh.from_array(np.ascontiguousarray(table), "table")]
    if head == "Transpose":
        nodes.append(h.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0], name="head_transpose"))
    else:
        initializers.append(nh.from_array(np.ascontiguousarray(table.T), "table_t"))
    nodes.append(h.make_node("MatMul", ["h", "table_t"], ["logits"], name="lm_head"))
    graph = h.make_graph(
        nodes, "tied",
        [h.make_tensor_value_info("h", TensorProto.FLOAT, [ROWS, hidden]),
         h.make_tensor_value_info("ids", TensorProto.INT64, [len(IDS)])],
        [h.make_tensor_value_info("logits", TensorProto.FLOAT, [ROWS, VOCAB]),
         h.make_tensor_value_info("rows", TensorProto.FLOAT, [len(IDS), hidden])],
        initializers)
    return ir.from_proto(h.make_model(graph, opset_imports=ONNX_OPSETS))


@pytest.mark.l3
@pytest.mark.parametrize("head", ["Transpose", "folded copy"])
@pytest.mark.parametrize(("hidden", "options", "bits", "zero_points"), [
    (64, None, 4, True),  # two blocks a row: asymmetric, as the defaults say
    (32, None, 4, False),  # one block a row: GatherBlockQuantized takes no packed zero points there
    (64, Int4Options(eight_bit=("lm_head",)), 8, True),  # the head at 8 bits: the table with it
    (64, Int4Options(method="hqq"), 4, True),  # HQQ's float zero points cannot feed the Gather: round-to-nearest
], ids=["int4 2 blocks", "int4 1 block", "int4 8-bit head", "int4 hqq"])
def test_a_table_tied_to_the_lm_head_is_stored_once(head, hidden, options, bits, zero_points):
    settings = _settings("int4", options)
    model = _tied_model(hidden, head)
    changes = QuantizeWeights()(model, settings, SESSIONS["decoder"])
    expected = {"matmuls": 1, "gathers": 1, "tables_shared_with_lm_head": 1}
    if not zero_points:
        expected["tables_without_zero_points"] = 1
    if bits == 8:
        expected["eight_bit_lm_head"] = 1
    if settings.int4.method == "hqq":
        expected["tables_round_to_nearest"] = 1
    assert {k: v for k, v in changes.items() if v} == expected
    assert sorted(node.op_type for node in model.graph) == ["GatherBlockQuantized", "MatMulNBits", "Reshape"]
    blobs = [value for value in model.graph.initializers.values() if value.dtype == ir.DataType.UINT8
             and len(value.shape) == 3]
    assert len(blobs) == 1  # one copy of the table's blocks
    (blob,) = blobs
    matmul = next(node for node in model.graph if node.op_type == "MatMulNBits")
    reshape = next(node for node in model.graph if node.op_type == "Reshape")
    assert matmul.inputs[1] is blob and reshape.inputs[0] is blob
    gather = next(node for node in model.graph if node.op_type == "GatherBlockQuantized")
    assert matmul.inputs[2] is gather.inputs[2]  # and of its scales
    assert (len(matmul.inputs) == 4) == zero_points and (len(gather.inputs) == 4) == zero_points
    assert "table" not in model.graph.initializers and "table_t" not in model.graph.initializers

    proto = ir.to_proto(model)
    table = TABLE[:, :hidden]
    name = blob.name.rsplit(".", 1)[0]
    stored, steps = _dequantize(_stored(proto, blob.name), _stored(proto, f"{name}.scales"),
                                _stored(proto, f"{name}.zero_points"), bits, hidden)  # [vocab, hidden]
    assert np.isfinite(stored).all() and (steps > 0).all()
    factor = 0.5 if zero_points else 1.0
    assert (np.abs(stored - table) <= factor * steps * (1 + 1e-6)).all()
    hidden_states = X[:, :hidden]
    got = _run(proto, {"h": hidden_states, "ids": IDS})
    _check_matmul(got["logits"], hidden_states, table.T, stored.T, steps.T, factor, settings.int4.accuracy_level)
    np.testing.assert_allclose(got["rows"], stored[IDS], rtol=2.0**-23, atol=0)


@pytest.mark.l1
def test_only_quantized_sessions_plan_it():
    def names(settings) -> set[str]:
        return {name for name, session in SESSIONS.items() if QuantizeWeights().applies(settings, session)}

    assert names(_settings("fp32")) == names(_settings("fp16")) == set()
    assert names(_settings("int4")) == names(_settings("int8")) == {"decoder", "embedding"}
    assert names(_settings("int4", int4_encoders=True)) == set(SESSIONS)
    assert "4-bit weights (rtn): block size 32, asymmetric, accuracy level 4" in QuantizeWeights().applies(
        _settings("int4"), SESSIONS["decoder"])
    assert "8-bit" in QuantizeWeights().applies(_settings("int8"), SESSIONS["decoder"])
    assert "on a slow kernel" in QuantizeWeights().applies(_settings("int4", Int4Options(method="hqq")),
                                                                SESSIONS["decoder"])


@pytest.mark.l1
@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_a_quantized_export_with_nothing_to_quantize_is_an_error(precision):
    """A MatMul of two activations, a weight under one block along K, a Gather along axis 1:
    nothing the quantizer takes. The graph is left as it was."""
    graph = h.make_graph(
        [h.make_node("MatMul", ["x", "x_t"], ["gram"], name="gram"),
         h.make_node("MatMul", ["x_small", "small"], ["y_small"], name="small_proj"),
         h.make_node("Gather", ["table", "ids"], ["columns"], axis=1, name="columns")],
        "nothing",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, K]),
         h.make_tensor_value_info("x_t", TensorProto.FLOAT, [K, ROWS]),
         h.make_tensor_value_info("x_small", TensorProto.FLOAT, [ROWS, SMALL_K]),
         h.make_tensor_value_info("ids", TensorProto.INT64, [len(IDS)])],
        [h.make_tensor_value_info("gram", TensorProto.FLOAT, [ROWS, ROWS]),
         h.make_tensor_value_info("y_small", TensorProto.FLOAT, [ROWS, 8]),
         h.make_tensor_value_info("columns", TensorProto.FLOAT, [VOCAB, len(IDS)])],
        [nh.from_array(SMALL, "small"), nh.from_array(TABLE, "table")])
    model = ir.from_proto(h.make_model(graph, opset_imports=ONNX_OPSETS))
    before = ir.to_proto(model).SerializeToString()
    with pytest.raises(ExporterError, match="found no MatMul with a constant weight"):
        QuantizeWeights()(model, _settings(precision), SESSIONS["decoder"])
    assert ir.to_proto(model).SerializeToString() == before


# AWQ's s for WEIGHT's K input channels: spread over 16x, in no order.
AWQ_SCALE = _RNG.permutation(np.geomspace(0.25, 4.0, K)).astype(np.float32)


@pytest.mark.l3
@pytest.mark.parametrize("transposed", [False, True], ids=["weight [k, n]", "weight [n, k] transposed"])
def test_awq_stores_the_weight_times_its_scale_and_divides_the_input_by_it(transposed):
    """Under AWQ the blocks hold W * s (row k of [k, n] times s[k]) rounded to nearest, within half
    a step, and the MatMulNBits reads x / s through a Div, so ONNX Runtime computes x @ W within
    the same bounds as round-to-nearest on (x / s) @ (W * s). The table is not a linear layer's
    input: round-to-nearest, unscaled."""
    name = "w_t" if transposed else "w"
    settings = dataclasses.replace(_settings("int4", Int4Options(method="awq")),
                                   activation_aware_scales={name: AWQ_SCALE})
    model = _model(transposed)
    changes = QuantizeWeights()(model, settings, SESSIONS["decoder"])
    assert {k: v for k, v in changes.items() if v} == {"matmuls": 1, "gathers": 1, "awq_scaled": 1, "awq_divisions": 1}
    assert "4-bit weights (awq)" in QuantizeWeights().applies(settings, SESSIONS["decoder"])
    matmul = next(node for node in model.graph if node.op_type == "MatMulNBits")
    divide = matmul.inputs[0].producer()
    assert divide.op_type == "Div" and divide.inputs[0].name == "x"
    np.testing.assert_array_equal(divide.inputs[1].const_value.numpy(), AWQ_SCALE)

    proto = ir.to_proto(model)
    stored, steps = (m.T for m in _dequantize(_stored(proto, f"{name}.int4"), _stored(proto, f"{name}.scales"),
                                              _stored(proto, f"{name}.zero_points"), 4, K))  # [k, n]
    scaled = WEIGHT * AWQ_SCALE[:, None]
    assert (np.abs(stored - scaled) <= 0.5 * steps * (1 + 1e-6)).all()
    # What AWQ's search rounds with is what the package stores.
    np.testing.assert_allclose(round_trip(np.ascontiguousarray(scaled.T), 4, BLOCK, False), stored.T, rtol=1e-6,
                               atol=1e-6 * np.abs(scaled).max())
    got = _run(proto, {"x": X, "ids": IDS, "x_small": X_SMALL})
    _check_matmul(got["y"], X / AWQ_SCALE, scaled, stored, steps, 0.5, settings.int4.accuracy_level)
    table, _ = _dequantize(_stored(proto, "table.int4"), _stored(proto, "table.scales"),
                           _stored(proto, "table.zero_points"), 4, K)
    np.testing.assert_allclose(got["rows"], table[IDS], rtol=2.0**-23, atol=0)


@pytest.mark.l1
def test_awq_search_is_never_worse_than_round_to_nearest_on_its_tokens_and_favours_loud_channels():
    """AWQ's grid starts at s = 1 (round-to-nearest), so its pick's output error on the
    calibration tokens is at most round-to-nearest's; channels whose activations are 30x louder
    get larger factors (finer steps); a channel no token reached gets a finite factor."""
    import torch

    from exporter.load.activation_aware_scales import search

    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    x[:, :8] *= 30.0
    x[:, 100] = 0.0
    w = (rng.standard_normal((48, 128)) * 0.05).astype(np.float32)
    def rounded(n_by_k):
        return round_trip(n_by_k, bits=4, block_size=32, symmetric=False)

    s, exponent = search(torch.from_numpy(x), torch.from_numpy(w), rounded)
    assert s.shape == (128,) and s.dtype == np.float32 and np.isfinite(s).all() and (s > 0).all()
    assert exponent > 0 and s[:8].min() > s[8:].max()

    def error(scale):
        stored = rounded(w * scale) / scale
        return float(np.mean((x @ stored.T - x @ w.T) ** 2))

    assert error(s) < error(np.ones(128, np.float32))


@pytest.mark.l1
def test_awq_scales_no_decoder_weight_takes_are_an_exporter_bug():
    """Scales searched under names the decoder's graph does not carry would leave an "awq" export
    plain round-to-nearest: the pass fails instead of writing it."""
    from exporter.errors import ExporterBug

    settings = dataclasses.replace(_settings("int4", Int4Options(method="awq")),
                                   activation_aware_scales={"model.layers.0.mlp.down_proj.weight": AWQ_SCALE})
    with pytest.raises(ExporterBug, match="AWQ searched 1 linear layers"):
        QuantizeWeights()(_model(False), settings, SESSIONS["decoder"])
