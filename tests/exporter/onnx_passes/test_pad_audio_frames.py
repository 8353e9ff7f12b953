"""L1/L3: ``pad_audio_frames`` pads the speech session's frames to its traced multiple (4) as
masked frames, before anything reads them.

The tiny graph reads both speech inputs as the tower does (features times their mask, pooled over
frames) and also passes each input through an Identity, so the padded tensors themselves can be
read: 199 frames (2 s of audio) must reach every reader as 200, the extra mask entry False and the
extra feature row zero, the real frames untouched; the pooled output (a masked sum) must not
change but for the order of float32 sums, since a padded frame adds only zeros. A count already a multiple of 4 is
padded by nothing. Only the speech session plans the pass.
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
from exporter.onnx_passes.pad_audio_frames import FRAMES_DIM, PadAudioFrames
from exporter.plan import export_settings
from exporter.sessions import SESSIONS

pytestmark = pytest.mark.unit

MELS, BATCH = 8, 2
SPEECH = SESSIONS["speech"]


def _model(feature_name: str = "input_features") -> ir.Model:
    nodes = [
        h.make_node("Cast", ["input_features_mask"], ["mask_float"], to=TensorProto.FLOAT, name="mask_float"),
        h.make_node("Unsqueeze", ["mask_float", "last_axis"], ["mask_column"], name="mask_column"),
        h.make_node("Mul", [feature_name, "mask_column"], ["masked"], name="masked"),
        h.make_node("ReduceSum", ["masked", "frames_axis"], ["pooled"], keepdims=0, name="pooled"),
        h.make_node("Identity", [feature_name], ["features_seen"], name="features_seen"),
        h.make_node("Identity", ["input_features_mask"], ["mask_seen"], name="mask_seen"),
    ]
    graph = h.make_graph(
        nodes, "speech",
        [h.make_tensor_value_info(feature_name, TensorProto.FLOAT, ["batch", "frames", MELS]),
         h.make_tensor_value_info("input_features_mask", TensorProto.BOOL, ["batch", "frames"])],
        [h.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", MELS]),
         h.make_tensor_value_info("features_seen", TensorProto.FLOAT, ["batch", None, MELS]),
         h.make_tensor_value_info("mask_seen", TensorProto.BOOL, ["batch", None])],
        [nh.from_array(np.array([-1], np.int64), "last_axis"), nh.from_array(np.array([1], np.int64), "frames_axis")],
    )
    return ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 21)]))


def _inputs(frames: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(frames)
    features = (rng.standard_normal((BATCH, frames, MELS)) * 5).astype(np.float32)
    mask = np.ones((BATCH, frames), dtype=bool)
    mask[1, frames - 23:] = False  # the second clip is shorter: its last frames are padding already
    return {"input_features": features, "input_features_mask": mask}


def _run(model: ir.Model, feeds: dict) -> dict[str, np.ndarray]:
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    assert np.isfinite(outputs["pooled"]).all() and np.isfinite(outputs["features_seen"]).all()
    return outputs


@pytest.mark.l1
def test_only_the_speech_session_plans_it():
    settings = export_settings(get_profile("cpu"), None, "fp32")
    assert SPEECH.traced_frame_multiple == 4
    assert "divisible by 4" in PadAudioFrames().applies(settings, SPEECH)
    for name in ("decoder", "embedding", "vision"):
        assert PadAudioFrames().applies(settings, SESSIONS[name]) is None


@pytest.mark.l1
def test_both_inputs_are_padded_before_any_reader():
    model = _model()
    assert PadAudioFrames()(model, None, SPEECH) == {"inputs_padded": 2}
    features, mask = model.graph.inputs
    assert [str(d) for d in features.shape] == ["batch", FRAMES_DIM, str(MELS)]
    assert [str(d) for d in mask.shape] == ["batch", FRAMES_DIM]
    assert features.dtype == ir.DataType.FLOAT and mask.dtype == ir.DataType.BOOL  # the inputs GenAI feeds
    # Each input is read only by the padding (its Shape, Pad and Cast); the graph's own nodes read the padded values.
    assert sorted(user.op_type for user, _ in features.uses()) == ["Pad", "Shape"]
    assert [user.op_type for user, _ in mask.uses()] == ["Cast"]
    pads = [node for node in model.graph if node.op_type == "Pad"]
    for name in ("masked", "features_seen"):
        reader = next(node for node in model.graph if node.name == name)
        assert reader.inputs[0].producer() is pads[0]
    assert next(node for node in model.graph if node.name == "mask_seen").inputs[0].producer().op_type == "Cast"


@pytest.mark.l3
@pytest.mark.parametrize(("frames", "padded"), [(199, 200), (197, 200), (200, 200), (1, 4)])
def test_frames_are_padded_as_masked_zero_frames(frames, padded):
    feeds = _inputs(frames)
    want = _run(_model(), feeds)
    model = _model()
    PadAudioFrames()(model, None, SPEECH)
    got = _run(model, feeds)
    features, mask = got["features_seen"], got["mask_seen"]
    assert features.shape == (BATCH, padded, MELS) and mask.shape == (BATCH, padded)
    assert mask.dtype == np.bool_
    np.testing.assert_array_equal(features[:, :frames], feeds["input_features"])
    np.testing.assert_array_equal(mask[:, :frames], feeds["input_features_mask"])
    assert (features[:, frames:] == 0).all() and not mask[:, frames:].any()
    # A padded frame adds exact zeros, but ONNX Runtime may sum 200 terms in another order than 199:
    # the float32 bound of a reordered sum, n ulps of the sum of magnitudes.
    magnitude = np.abs(feeds["input_features"] * feeds["input_features_mask"][..., None]).sum(axis=1)
    assert (np.abs(got["pooled"] - want["pooled"]) <= padded * 2.0**-24 * magnitude).all()


@pytest.mark.l1
def test_a_graph_without_the_speech_inputs_is_refused_unchanged():
    model = _model(feature_name="pixel_values")
    before = ir.to_proto(model).SerializeToString()
    with pytest.raises(RuntimeError, match="expected the speech inputs"):
        PadAudioFrames()(model, None, SPEECH)
    assert ir.to_proto(model).SerializeToString() == before
