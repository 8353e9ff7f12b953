"""The clean-up list after folding, chosen for linear cost: dead nodes, functions and opsets,
identities (full-range Slices too: transformers' ``x[:, :, i]`` lowers to two of them per layer,
each a kernel dispatch), common subexpressions, small constants lifted to initializers, duplicate
initializers, output and name fixes, and node metadata cleared. onnxscript's default rewrite-rule
set is left out: its matching cost grows with the square of the node count; its one full-slice
rule matches single nodes."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common
from onnxscript.rewriter import RewriteRuleSet
from onnxscript.rewriter.rules.common import collapse_slice_rule

from exporter.onnx_passes.base import run_in_place


def _before_slices() -> list[ir.passes.PassBase]:
    return [common.RemoveUnusedNodesPass(), common.RemoveUnusedFunctionsPass(), common.RemoveUnusedOpsetsPass()]


def _after_slices() -> list[ir.passes.PassBase]:
    return [
        common.IdentityEliminationPass(),
        common.CommonSubexpressionEliminationPass(),
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=False, size_limit=16),
        DeduplicateConstantsPass(),
        common.OutputFixPass(),
        common.NameFixPass(),
        # Node metadata holds torch.onnx's FX provenance (stack traces, node reprs): several MB
        # per model, and its text varies between runs, which would break byte-identical exports.
        common.ClearMetadataAndDocStringPass(),
    ]


class DeduplicateConstantsPass(common.DeduplicateInitializersPass):
    """onnx_ir's deduplication of equal initializers, over the constants only: weights, and what
    folded passes make of them when written (a transposed or cast weight: every lazy initializer),
    stay apart even where their values are equal (fresh-init norms), so that no weight value decides
    the graph, and no weight is read before the package is written (what lets the command line
    replay an export with another checkpoint's weights: ``exporter.cache.replay``). They are set aside
    while onnx_ir's pass runs and put back in their order."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        order = list(graph.initializers)
        weights = {name: graph.initializers.pop(name) for name in order
                   if isinstance(graph.initializers[name].const_value, ir.LazyTensor)}
        try:
            return super().call(model)
        finally:
            remaining = {**weights, **{name: graph.initializers.pop(name) for name in list(graph.initializers)}}
            for name in order:
                if name in remaining:
                    graph.register_initializer(remaining[name])


_FULL_RANGE_SLICES_TO_IDENTITIES = RewriteRuleSet([collapse_slice_rule])


class Tidy:
    name = "tidy"

    def applies(self, settings, session) -> str | None:
        return "lowering and folding leave dead nodes, duplicates and provenance metadata"

    def __call__(self, model: ir.Model, settings, session) -> dict[str, int]:
        for ir_pass in _before_slices():
            run_in_place(ir_pass, model)
        # Counted by the rule itself, so the count is the Slices it matched, not others CSE merges.
        full_range_slices = _FULL_RANGE_SLICES_TO_IDENTITIES.apply_to_model(model)
        for ir_pass in _after_slices():
            run_in_place(ir_pass, model)
        return {"initializers": len(model.graph.initializers), "full_range_slices_removed": full_range_slices}
