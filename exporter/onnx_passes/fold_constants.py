"""Constant folding: onnxscript's folder without onnx's per-node shape inference (torch.onnx
already ran it; at 35 layers it costs more than the export), then dead nodes removed. One factory
for both places it runs: after lowering, and after the fusions (a fused norm's scale cast to the
input's dtype is a constant subgraph).

Identities and casts of weights are folded lazily first (``weight_folds``). In a tower (the vision
and speech sessions, which run once per image or clip) any other node that would read a weight's
values stays for run time: a few small nodes per audio layer (``per_dim_scale``'s softplus; in the
tiny preset also the position table's Gathers, which at full size are too large to fold), and the
package's weights stay functions of the checkpoint's tensors that a replay repeats
(``exporter.cache.replay``). The decoder and the embedding session fold them, since they run at every
token (Gemma 2's ``1 + weight`` norm scales)."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common
from onnxscript.optimizer import _constant_folding

from exporter.onnx_passes.base import run_in_place
from exporter.onnx_passes.weight_folds import fold_weight_nodes, is_made_from_weight


def fold_constants_pass(keep_weight_nodes: bool = False) -> ir.passes.PassBase:
    return _constant_folding.FoldConstantsPass(
        shape_inference=False,
        input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
        output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
        should_fold=_reads_no_weight if keep_weight_nodes else lambda node: None,
    )


def _reads_no_weight(node: ir.Node) -> bool | None:
    """The folder's ``should_fold``: False for a node with a weight among its inputs (the folder
    reads every input's values before it evaluates a node; it answers Shape and Size before asking);
    None, the folder's own rules, for any other."""
    if any(value is not None and value.is_initializer() and is_made_from_weight(value.const_value)
           for value in node.inputs):
        return False
    return None


class FoldConstants:
    """``after_fusions``: the second run, which applies where the profile fuses norms and also
    drops the nodes folding leaves unused (the first run leaves that to ``tidy``). ``towers``: the
    variant of either run for the vision and speech sessions, which leaves nodes that read weights
    for run time."""

    def __init__(self, after_fusions: bool = False, towers: bool = False):
        self.after_fusions, self.towers = after_fusions, towers
        self.name = f"fold_{'tower_' if towers else ''}{'fusion_' if after_fusions else ''}constants"

    def applies(self, settings, session) -> str | None:
        if session.is_encoder != self.towers:  # a tower runs once per image or clip
            return None
        if self.after_fusions and not settings.profile.norm_fusions:
            return None
        why = ("the norm fusions cast scales to the input's dtype: constants to fold" if self.after_fusions else
               "torch.onnx leaves constant subgraphs (shapes, casts of constants)")
        return f"{why}; nodes that read weights run once per input, at run time" if self.towers else why

    def __call__(self, model: ir.Model, settings, session) -> dict[str, int]:
        weight_nodes = fold_weight_nodes(model.graph)  # lazily: the folder would read the weights now
        run_in_place(fold_constants_pass(keep_weight_nodes=self.towers), model)
        if self.after_fusions:
            run_in_place(common.RemoveUnusedNodesPass(), model)
        return {"weight_nodes_folded": weight_nodes}
