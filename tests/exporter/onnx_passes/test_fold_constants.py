"""L1/L3: ``fold_constants`` on a tiny graph: constant subgraphs folded everywhere; casts and
identities of a weight made the weight (or a lazy cast of it) without reading it; a node computing
from a weight (Gemma 2's ``1 + weight`` norm scale) folded in the decoder, kept for run time in a
tower; the run after the fusions also drops the nodes folding left unused.

Weights are lazy tensors here, as an export attaches them, with a callable that counts its reads,
so "not read" is checked rather than assumed. ONNX Runtime runs the graph before and after: the
folds are exact (the same fp32 ops, or the same fp16 rounding numpy and ONNX Runtime both do), so
outputs must be equal bit for bit.
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
from exporter.onnx_passes.fold_constants import FoldConstants
from exporter.plan import export_settings
from exporter.sessions import SESSIONS
from tests.helpers.counting_reader import CountingReader

pytestmark = pytest.mark.unit

IN, OUT, ROWS = 8, 4, 2
_RNG = np.random.default_rng(0)
WEIGHT = (_RNG.standard_normal((IN, OUT)) * 3).astype(np.float32)  # x @ W
NORM_SCALE = _RNG.standard_normal(OUT).astype(np.float32)  # Gemma 2 stores weight; the norm scales by 1 + weight


def _model() -> tuple[ir.Model, dict[str, CountingReader]]:
    """y = ((x + 2 * arange(8)) @ Identity(Cast32(Cast16(W)))) * (1 + norm_scale).

    ``2 * arange(8)`` is a constant subgraph (a Constant node and a Mul); the weight's round trip
    through fp16 is what an fp16 export's casts of a weight look like; ``1 + norm_scale`` reads a
    weight's values."""
    nodes = [
        h.make_node("Constant", [], ["steps"], value=nh.from_array(np.arange(IN, dtype=np.float32), "steps")),
        h.make_node("Mul", ["steps", "two"], ["offsets"]),
        h.make_node("Add", ["x", "offsets"], ["shifted"]),
        h.make_node("Cast", ["weight"], ["weight_fp16"], to=TensorProto.FLOAT16),
        h.make_node("Cast", ["weight_fp16"], ["weight_fp32"], to=TensorProto.FLOAT),
        h.make_node("Identity", ["weight_fp32"], ["weight_id"]),
        h.make_node("MatMul", ["shifted", "weight_id"], ["projected"]),
        h.make_node("Add", ["norm_scale", "one"], ["norm_factor"]),
        h.make_node("Mul", ["projected", "norm_factor"], ["y"]),
    ]
    graph = h.make_graph(
        nodes, "fold", [h.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, IN])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, OUT])],
        [nh.from_array(np.float32([2]), "two"), nh.from_array(np.float32([1]), "one"),
         nh.from_array(np.zeros_like(WEIGHT), "weight"), nh.from_array(np.zeros_like(NORM_SCALE), "norm_scale")],
    )
    model = ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 21)]))
    readers = {}
    for name, array in (("weight", WEIGHT), ("norm_scale", NORM_SCALE)):
        readers[name] = CountingReader(array)
        model.graph.initializers[name].const_value = ir.LazyTensor(readers[name], dtype=ir.DataType.FLOAT,
                                                                   shape=ir.Shape(array.shape))
    return model, readers


def _settings(profile=None):
    return export_settings(profile or get_profile("cpu"), None, "fp32")


def _ops(model: ir.Model) -> list[str]:
    return [node.op_type for node in model.graph]


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    proto = ir.to_proto(model)  # reads the lazy weights
    onnx.checker.check_model(proto)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": x})
    assert np.isfinite(y).all()
    return y


X = (_RNG.standard_normal((ROWS, IN)) * 10).astype(np.float32)
WANT = _run(_model()[0], X)


@pytest.mark.l1
@pytest.mark.parametrize(("variant", "runs_on"), [
    (FoldConstants(), {"decoder", "embedding"}),
    (FoldConstants(towers=True), {"vision", "speech"}),
    (FoldConstants(after_fusions=True), {"decoder", "embedding"}),
    (FoldConstants(after_fusions=True, towers=True), {"vision", "speech"}),
], ids=lambda v: getattr(v, "name", None))
def test_each_variant_applies_to_its_sessions(variant, runs_on):
    settings = _settings()
    assert {name for name, session in SESSIONS.items() if variant.applies(settings, session)} == runs_on
    without_fusions = _settings(dataclasses.replace(get_profile("cpu"), norm_fusions=()))
    expected = set() if variant.after_fusions else runs_on  # nothing fused: nothing cast to fold
    assert {name for name, session in SESSIONS.items() if variant.applies(without_fusions, session)} == expected


@pytest.mark.l3
def test_the_decoder_folds_everything_constant_and_reads_only_the_weight_it_must():
    model, readers = _model()
    changes = FoldConstants()(model, _settings(), SESSIONS["decoder"])
    assert changes == {"weight_nodes_folded": 3}  # two Casts and the Identity
    # The constant subgraph and 1 + norm_scale are initializers now; the Constant node the folder
    # left unused stays for tidy (the first run does not remove dead nodes).
    assert _ops(model) == ["Constant", "Add", "MatMul", "Mul"]
    matmul = next(node for node in model.graph if node.op_type == "MatMul")
    weight = matmul.inputs[1]
    assert weight.is_initializer() and isinstance(weight.const_value, ir.LazyTensor)
    assert weight.dtype == ir.DataType.FLOAT
    assert "two" not in model.graph.initializers and "one" not in model.graph.initializers
    assert readers["weight"].reads == 0  # the casts were folded lazily
    assert readers["norm_scale"].reads == 1  # the decoder folds 1 + weight (read by the folder)
    np.testing.assert_array_equal(_run(model, X), WANT)


@pytest.mark.l3
def test_a_tower_keeps_nodes_that_read_weights_and_reads_none():
    model, readers = _model()
    changes = FoldConstants(towers=True)(model, _settings(), SESSIONS["vision"])
    assert changes == {"weight_nodes_folded": 3}
    assert _ops(model) == ["Constant", "Add", "MatMul", "Add", "Mul"]
    norm = [node for node in model.graph if node.op_type == "Add"][1]
    assert [value.name for value in norm.inputs] == ["norm_scale", "one"]  # computed at run time
    assert {name: reader.reads for name, reader in readers.items()} == {"weight": 0, "norm_scale": 0}
    np.testing.assert_array_equal(_run(model, X), WANT)


@pytest.mark.l1
def test_the_run_after_the_fusions_also_drops_unused_nodes():
    model, _ = _model()
    FoldConstants(after_fusions=True)(model, _settings(), SESSIONS["decoder"])
    assert _ops(model) == ["Add", "MatMul", "Mul"]


@pytest.mark.l3
@pytest.mark.parametrize("variant", [FoldConstants(), FoldConstants(after_fusions=True, towers=True)],
                         ids=lambda v: v.name)
def test_a_graph_with_nothing_to_fold_is_left_as_it_was(variant):
    """x @ W + b with plain initializers: nothing constant to compute, no weight node to fold."""
    graph = h.make_graph(
        [h.make_node("MatMul", ["x", "weight"], ["projected"], name="matmul"),
         h.make_node("Add", ["projected", "bias"], ["y"], name="add")],
        "plain", [h.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, IN])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, OUT])],
        [nh.from_array(WEIGHT, "weight"), nh.from_array(NORM_SCALE, "bias")],
    )
    model = ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 21)]))
    before = ir.to_proto(model).SerializeToString()
    want = _run(model, X)
    session = SESSIONS["vision" if variant.towers else "decoder"]
    assert variant(model, _settings(), session) == {"weight_nodes_folded": 0}
    assert ir.to_proto(model).SerializeToString() == before
    np.testing.assert_array_equal(_run(model, X), want)
