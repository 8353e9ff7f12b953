"""Rewrites of the lowered ONNX model, one module per pass, run in the registry's order where the
export plan says they apply (``exporter.plan``)."""

from exporter.onnx_passes.base import OnnxPass, OnnxPassRecord, run_onnx_passes
from exporter.onnx_passes.norm_fusions import FusionDidNotApply
from exporter.onnx_passes.registry import ONNX_PASSES

__all__ = ["ONNX_PASSES", "FusionDidNotApply", "OnnxPass", "OnnxPassRecord", "run_onnx_passes"]
