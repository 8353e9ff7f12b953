"""Constant folding: onnxscript's folder without onnx's per-node shape inference (torch.onnx
already ran it; at 35 layers it costs more than the export), then dead nodes removed. One factory
for both places it runs: after lowering, and after the fusions (a fused norm's scale cast to the
input's dtype is a constant subgraph)."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common
from onnxscript.optimizer import _constant_folding

from exporter.onnx_passes.base import run_in_place
from exporter.onnx_passes.weight_casts import fold_weight_casts


def fold_constants_pass() -> ir.passes.PassBase:
    return _constant_folding.FoldConstantsPass(
        shape_inference=False,
        input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
        output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
    )


class FoldConstants:
    """``after_fusions``: the second run, which applies where the profile fuses norms and also
    drops the nodes folding leaves unused (the first run leaves that to ``tidy``)."""

    def __init__(self, after_fusions: bool = False):
        self.after_fusions = after_fusions
        self.name = "fold_fusion_constants" if after_fusions else "fold_constants"

    def applies(self, facts, session) -> str | None:
        if not self.after_fusions:
            return "torch.onnx leaves constant subgraphs (shapes, casts of constants)"
        if not facts.profile.norm_fusions:
            return None
        return "the norm fusions cast scales to the input's dtype: constants to fold"

    def __call__(self, model: ir.Model, facts) -> dict[str, int]:
        weight_casts = fold_weight_casts(model.graph)  # lazily: the folder would read the weights now
        run_in_place(fold_constants_pass(), model)
        if self.after_fusions:
            run_in_place(common.RemoveUnusedNodesPass(), model)
        return {"weight_casts_folded": weight_casts}
