"""Gather each row's last real token before the projection to the vocabulary.

Generation reads only the last position's logits, so the LM head (a [hidden, vocab] matmul, by
far the widest in small models) and whatever follows it (soft-capping, scaling) run on one row
per sequence. The logits output becomes [batch, 1, vocab], which ONNX Runtime GenAI recognises
as last-token logits. The projection is found from the graph: walking back from the logits
output through single-input operations to the first linear/matmul whose output width is the
vocabulary size, or to a concatenation of such projections of one input (an LM head split to fit
an EP's buffer limit).
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram

import fx_passes.custom_ops.ops  # noqa: F401  (registers the custom ops)
from fx_passes.analyses.graph_facts import (
    PassDidNotApply,
    axes_equal_to,
    graph_input,
    graph_outputs,
    sequence_symbol,
    set_fake_value,
    user_input,
)
from fx_passes.base import Settings

_aten = torch.ops.aten
_PROJECTIONS = (_aten.linear.default, _aten.matmul.default, _aten.mm.default)


def insert_last_token(graph: torch.fx.Graph, tensor: torch.fx.Node, mask: torch.fx.Node, axis: int,
                      captured: bool, before: torch.fx.Node | None = None) -> torch.fx.Node:
    """A ``last_token`` of ``tensor``, right after it or right ``before`` a node (its first reader,
    so in-place writes into ``tensor`` in between are gathered too); in a graph-captured decoder it
    reads the position ids instead of the mask (``last_token``'s form with no shape arithmetic)."""
    position_ids = graph_input(graph, "position_ids") if captured else None
    with graph.inserting_after(tensor) if before is None else graph.inserting_before(before):
        gathered = graph.call_function(torch.ops.genai_exporter.last_token.default, (tensor, mask, axis, position_ids))
    set_fake_value(gathered)
    return gathered


def _vocabulary_projections(node: torch.fx.Node, vocab_size: int) -> list[torch.fx.Node]:
    """The projection(s) ``node`` is, if its output is vocabulary-wide: one linear/matmul, or the
    last-axis concatenation of several that read the same input."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.shape[-1] != vocab_size:
        return []
    if node.target in _PROJECTIONS:
        return [node]
    if node.target is _aten.cat.default and node.args[1:] in ((-1,), (value.dim() - 1,)):
        parts = list(node.args[0])
        if all(p.target in _PROJECTIONS and p.args[0] is parts[0].args[0] for p in parts):
            return parts
    return []


class GatherLastToken:
    name = "gather_last_token"

    def applies(self, settings, session) -> str | None:
        if not session.is_decoder or settings.full_logits:
            return None
        return "generation reads the last token's logits only"

    def __call__(self, program: ExportedProgram, settings: Settings, session) -> tuple[ExportedProgram, dict[str, int]]:
        graph = program.graph
        logits = graph_outputs(program)[0]
        vocab_size = settings.layout.vocab_size
        walked = []
        node = logits
        while isinstance(node, torch.fx.Node) and node.op == "call_function":
            walked.append(str(node.target))
            projections = _vocabulary_projections(node, vocab_size)
            if projections:
                break
            node = next(iter(node.all_input_nodes), None)
        else:
            raise PassDidNotApply(
                f"{self.name}: found no projection to the vocabulary (linear/matmul with {vocab_size} outputs) "
                f"feeding the logits output; walked back through: {', '.join(walked) or 'nothing'}"
            )
        hidden = projections[0].args[0]
        axes = axes_equal_to(hidden, sequence_symbol(program))
        if len(axes) != 1:
            raise PassDidNotApply(
                f"{self.name}: the LM head's input {hidden.name} has shape "
                f"{tuple(hidden.meta['val'].shape)}; expected exactly one sequence axis"
            )
        gathered = insert_last_token(graph, hidden, user_input(program, "attention_mask"), axes[0], session.captured(settings))
        for projection in projections:
            projection.replace_input_with(hidden, gathered)
        graph.lint()
        program.graph_module.recompile()
        return program, {"gathers": 1}
