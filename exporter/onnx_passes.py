"""The ONNX pass list run after lowering, in place of torch.onnx's default optimizer.

onnx_ir's and onnxscript's passes, chosen for linear cost: constant folding (without onnx's
per-node shape inference, which torch.onnx already ran), dead-node and dead-opset removal,
common-subexpression elimination, initializer deduplication, and clearing node metadata; for
graph-capture profiles also constant Reshape targets (``static_reshape_targets``), so no shape
arithmetic is left for the CPU. onnxscript's default rewrite-rule
set is left out: its matching cost grows with the square of the node count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.passes import common
from onnxscript.optimizer import _constant_folding

from exporter.static_reshape_targets import StaticReshapeTargets
from exporter.weights import FoldWeightTransposes


@dataclass(frozen=True)
class OnnxPassRecord:
    name: str
    nodes_before: int
    nodes_after: int
    seconds: float


def default_pass_list(graph_capture: bool = False, fold_shared_transposes: bool = True) -> list[ir.passes.PassBase]:
    """The clean-up list; ``graph_capture`` adds the rewrites a captured graph needs (constant
    Reshape targets, so no shape arithmetic is left for the CPU). Weight transposes are folded
    into stored weights (lazily); ``fold_shared_transposes`` also folds those of weights with
    other readers (a tied LM head), at the cost of a second copy."""
    return [
        common.InlinePass(),
        FoldWeightTransposes(fold_shared=fold_shared_transposes),
        _constant_folding.FoldConstantsPass(
            shape_inference=False,
            input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
            output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
        ),
        *([StaticReshapeTargets()] if graph_capture else []),
        common.RemoveUnusedNodesPass(),
        common.RemoveUnusedFunctionsPass(),
        common.RemoveUnusedOpsetsPass(),
        common.IdentityEliminationPass(),
        common.CommonSubexpressionEliminationPass(),
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=False, size_limit=16),
        common.DeduplicateInitializersPass(),
        common.OutputFixPass(),
        common.NameFixPass(),
        # Node metadata holds torch.onnx's FX provenance (stack traces, node reprs): several MB
        # per model, and its text varies between runs, which would break byte-identical exports.
        common.ClearMetadataAndDocStringPass(),
    ]


def run_onnx_passes(
    model: ir.Model,
    passes: list[ir.passes.PassBase] | None = None,
    on_pass: Callable[[OnnxPassRecord], None] | None = None,
) -> list[OnnxPassRecord]:
    records = []
    for onnx_pass in passes if passes is not None else default_pass_list():
        before = _count_nodes(model)
        start = time.perf_counter()
        result = onnx_pass(model)
        if result.model is not model:
            raise RuntimeError(f"ONNX pass {type(onnx_pass).__name__} did not work in place")
        record = OnnxPassRecord(type(onnx_pass).__name__, before, _count_nodes(model), time.perf_counter() - start)
        records.append(record)
        if on_pass is not None:
            on_pass(record)
    return records


def _count_nodes(model: ir.Model) -> int:
    return sum(1 for _ in model.graph.all_nodes())
