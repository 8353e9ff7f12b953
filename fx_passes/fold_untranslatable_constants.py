"""Compute, at export time, the values of ops ONNX has no operator for when they read constants only.

Gemma 3n's activation sparsity keeps the MLP activations above mean + std * Phi^-1(p), and takes
the normal quantile ``Phi^-1(p)`` of its constant sparsity level ``p`` with ``erfinv`` inside the
forward pass. ONNX has no Erfinv (torch.onnx stops with "No ONNX function found for
prims.erf_inv"), but the value depends on no input: it is computed here from the traced constants
and put in the graph as the number it is. An ``erfinv`` of a model input is left alone (the
lowering then names it).
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from fx_passes.analyses.graph_facts import ancestors, evaluate_nodes
from fx_passes.base import Settings, add_parameter, program_fake_mode

_UNTRANSLATABLE = (torch.ops.aten.erfinv.default,)


class FoldUntranslatableConstants:
    name = "fold_untranslatable_constants"

    def applies(self, settings, session) -> str | None:
        return "ops ONNX has no operator for (erfinv) become their value where they read constants only"

    def __call__(self, program: ExportedProgram, settings: Settings, session) -> tuple[ExportedProgram, dict[str, int]]:
        graph = program.graph
        user_inputs = {spec.arg.name for spec in program.graph_signature.input_specs
                       if spec.kind == InputKind.USER_INPUT}
        folded = 0
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target in _UNTRANSLATABLE]:
            if any(n.op == "placeholder" and n.name in user_inputs for n in ancestors([node])):
                continue
            (value,) = evaluate_nodes(program, [node], {})
            if value.dim() == 0:
                with graph.inserting_before(node):
                    constant = graph.call_function(torch.ops.aten.scalar_tensor.default, (value.item(),),
                                                   {"dtype": value.dtype})
                constant.meta["val"] = program_fake_mode(graph).from_tensor(value)
            else:
                constant = add_parameter(program, f"folded_{node.name}", value.detach().clone())
            node.replace_all_uses_with(constant)
            graph.erase_node(node)
            folded += 1
        if folded:
            graph.eliminate_dead_code()
            graph.lint()
            program.graph_module.recompile()
        return program, {"folded": folded}
