"""Every ONNX pass, in the order they run: the export plan keeps those whose ``applies`` says why
(``exporter.plan``). A new pass is one module plus one line here."""

from exporter.onnx_passes.fold_awq_divisions import FoldAwqDivisions
from exporter.onnx_passes.fold_constants import FoldConstants
from exporter.onnx_passes.fold_weight_transposes import FoldWeightTransposes
from exporter.onnx_passes.inline_functions import InlineFunctions
from exporter.onnx_passes.matmul_kv_shared_attention import MatmulKvSharedAttention
from exporter.onnx_passes.norm_fusions import FuseRmsNorms, FuseSkipRmsNorms
from exporter.onnx_passes.omit_unread_presents import OmitUnreadPresents
from exporter.onnx_passes.pad_audio_frames import PadAudioFrames
from exporter.onnx_passes.quantize_weights import QuantizeWeights
from exporter.onnx_passes.scale_residual_stream import ScaleResidualStream
from exporter.onnx_passes.static_reshape_targets import StaticReshapeTargets
from exporter.onnx_passes.tidy import Tidy
from exporter.onnx_passes.widen_unsupported_dtypes import WidenUnsupportedDtypes

ONNX_PASSES = {p.name: p for p in (
    InlineFunctions(),
    PadAudioFrames(),
    FoldWeightTransposes(),
    FoldConstants(),
    FoldConstants(towers=True),
    StaticReshapeTargets(),
    WidenUnsupportedDtypes(),  # after the folds, which rewrite ops (SplitToSequence to Split)
    Tidy(),
    OmitUnreadPresents(),  # after tidy's dead-code removal, which leaves only the presents really unread
    # After tidy, whose common-subexpression pass leaves one token count for every layer: the pass
    # makes one span and one Slice per owner for all the layers reading that count.
    MatmulKvSharedAttention(),
    FuseRmsNorms(),  # before the skip fusion, which fuses the Add into its norms
    FuseSkipRmsNorms(),
    FoldConstants(after_fusions=True),
    FoldConstants(after_fusions=True, towers=True),
    ScaleResidualStream(),  # after the norm fusions, whose epsilons it rescales; before int4 reads the weights
    QuantizeWeights(),
    FoldAwqDivisions(),  # after the quantizer, whose Divs and block scales it folds
)}
