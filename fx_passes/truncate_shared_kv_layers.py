"""Run the layers that write no KV cache on each sequence's last token only.

In generation, the logits of the last token are all that is read, and present KV outputs are all
that must cover every token. The nodes that feed the logits but no present KV (for Gemma 4 E2B:
the query path, attention and MLP of layer 14, or only what follows its attention once that is one
GroupQueryAttention writing the present KV, and everything in the KV-shared layers 15-34) can
therefore work on one token per sequence. The pass finds that region from the program's dataflow,
gathers the last real token of every sequence-length tensor that flows into it (hidden states,
per-layer inputs, rotary tables, the query axis of attention masks), and rewrites the sequence
lengths the region uses as shapes to 1. Key lengths (past + sequence) keep their value, so the
shared layers still attend over their source layer's whole cache.

Which layers are KV-shared comes from the decoder layout (derived from the model); the pass is an
error, not a no-op, when the model declares shared layers but the region does not contain them.
"""

from __future__ import annotations

import operator

import sympy
import torch
from torch.export import ExportedProgram
from torch.fx import Node

from fx_passes.analyses.graph_facts import (
    PassDidNotApply,
    ancestors,
    axes_equal_to,
    expr_of,
    graph_outputs,
    layer_index,
    sequence_symbol,
    set_fake_value,
    token_input,
    user_input,
)
from fx_passes.base import Settings
from fx_passes.gather_last_token import insert_last_token

_LAST_TOKEN = torch.ops.genai_exporter.last_token.default


_EXAMPLE_PROMPT = 512  # the prompt length the report's saving is counted for


class TruncateSharedKvLayers:
    name = "truncate_shared_kv_layers"

    def note(self, changes: dict[str, int]) -> str:
        """Where the pass cut and what it saves, for the report."""
        num_layers, shared = changes["num_layers"], changes["layers_on_last_token"]
        first_shared, first = num_layers - shared, changes["first_truncated_layer"]
        note = (
            f"prefill truncation at layer {first_shared} of {num_layers}: {shared} layers "
            f"({first_shared}-{num_layers - 1}, KV-shared) run on the last token only, saving {shared} "
            f"layer-rows for every prompt token but the last ({shared * (_EXAMPLE_PROMPT - 1)} for a "
            f"{_EXAMPLE_PROMPT}-token prompt)"
        )
        if first < first_shared:
            note += f"; the part of layer {first} that feeds no KV cache runs on it too"
        return note

    def applies(self, settings, session) -> str | None:
        shared = settings.layout.shared_layer_indices
        if not session.is_decoder or settings.full_logits or not shared:
            return None
        return f"layers {shared[0]}-{shared[-1]} read other layers' KV caches: prefill runs them on the last token"

    def __call__(self, program: ExportedProgram, settings: Settings, session) -> tuple[ExportedProgram, dict[str, int]]:
        layout = settings.layout
        graph = program.graph
        outputs = graph_outputs(program)
        feeds_present = ancestors(outputs[1:])
        region = {
            n for n in ancestors(outputs[:1]) - feeds_present if n.op == "call_function"
        }
        # Picking one output of a multi-output op (GroupQueryAttention's attention output, whose
        # presents stay whole) belongs with the op: the gathers go after the pick.
        region -= {n for n in region if n.target is operator.getitem and n.args[0] not in region}
        self._check_region_covers_shared_layers(region, graph, layout)

        seq = sequence_symbol(program)
        mask = user_input(program, "attention_mask")
        batch = expr_of(token_input(program).meta["val"].shape[0])

        # Gathers that an earlier pass put inside the region now see one token already.
        for node in [n for n in graph.nodes if n in region and n.target is _LAST_TOKEN]:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            region.discard(node)

        gathers = 0
        order = {node: index for index, node in enumerate(graph.nodes)}
        for producer in [n for n in graph.nodes if n not in region]:
            consumers = [user for user in producer.users if user in region]
            value = producer.meta.get("val")
            if not consumers or not isinstance(value, torch.Tensor):
                continue
            axes = axes_equal_to(producer, seq)
            if not axes:
                continue  # weights, caches (past + sequence long), scalars: the same for one token
            batch_axes = [axis for axis, size in enumerate(value.shape) if expr_of(size) == batch]
            if len(axes) > 1 or len(batch_axes) != 1 or batch_axes[0] >= axes[0]:
                raise PassDidNotApply(
                    f"{self.name}: cannot pick the last token of {producer.name} with shape "
                    f"{tuple(value.shape)} (needs one sequence axis after the batch axis)"
                )
            first_reader = min(consumers, key=order.__getitem__)  # after in-place writes made before it
            gathered = _insert_last_token_of(graph, producer, mask, batch_axes[0], axes[0], session.captured(settings), first_reader)
            for consumer in consumers:
                consumer.replace_input_with(producer, gathered)
            gathers += 1

        sizes_rewritten = self._rewrite_sequence_sizes(graph, region, seq)
        graph.eliminate_dead_code()
        graph.lint()
        program.graph_module.recompile()

        first_layer = min(i for i in (layer_index(n) for n in region) if i is not None)
        return program, {
            "first_truncated_layer": first_layer,
            "layers_on_last_token": len(layout.shared_layer_indices),
            "num_layers": layout.num_layers,
            "gathers": gathers,
            "sizes_rewritten": sizes_rewritten,
        }

    def _check_region_covers_shared_layers(self, region: set[Node], graph, layout) -> None:
        layer_nodes: dict[int, list[Node]] = {}
        for node in graph.nodes:
            index = layer_index(node)
            if index is not None and node.op == "call_function":
                layer_nodes.setdefault(index, []).append(node)
        not_truncatable = [
            i for i in layout.shared_layer_indices
            if i not in layer_nodes or any(n not in region for n in layer_nodes[i]
                                           if n.meta.get("val") is not None and isinstance(n.meta["val"], torch.Tensor))
        ]
        if not_truncatable:
            raise PassDidNotApply(
                f"{self.name}: looked for KV-shared layers {list(layout.shared_layer_indices)} feeding only the "
                f"logits, but layers {not_truncatable} also feed present KV outputs (or were not found in the graph)"
            )

    @staticmethod
    def _rewrite_sequence_sizes(graph, region: set[Node], seq: sympy.Expr) -> int:
        """Shape arguments of region ops that depend on the sequence length now describe one
        token: substitute 1 for it. A total length (past + sequence) is a key length and stays."""
        by_expr = {}
        for node in graph.nodes:
            value = node.meta.get("val")
            if isinstance(value, torch.SymInt) and node not in region:
                by_expr.setdefault(value.node.expr, node)

        rewritten = 0

        def substitute(argument):
            nonlocal rewritten
            if not isinstance(argument, Node) or not isinstance(argument.meta.get("val"), torch.SymInt):
                return argument
            expr = argument.meta["val"].node.expr
            if seq not in expr.free_symbols or _is_key_length(expr, seq):
                return argument
            one_token = expr.subs(seq, 1)
            rewritten += 1
            if one_token.is_Integer:
                return int(one_token)
            if one_token in by_expr:
                return by_expr[one_token]
            raise PassDidNotApply(f"cannot express the size {expr} for one token (needs {one_token})")

        for node in [n for n in graph.nodes if n in region]:
            if node.op != "call_function" or isinstance(node.meta.get("val"), torch.SymInt):
                continue  # symbolic arithmetic keeps meaning what it meant; its users are rewritten
            node.args = torch.fx.node.map_aggregate(node.args, substitute)
            node.kwargs = torch.fx.node.map_aggregate(node.kwargs, substitute)
        return rewritten


def _insert_last_token_of(graph, tensor: Node, mask: Node, batch_axis: int, seq_axis: int, captured: bool,
                          before: Node) -> Node:
    """``last_token`` of ``tensor`` right ``before`` its first reader in the region, whose batch
    axis may come after other axes (Gemma 3n's AltUp stack is [streams, batch, seq, hidden]):
    moved to the front for the gather and back after."""
    if batch_axis == 0:
        return insert_last_token(graph, tensor, mask, seq_axis, captured, before)
    rank = tensor.meta["val"].dim()
    order = [batch_axis, *(axis for axis in range(rank) if axis != batch_axis)]
    with graph.inserting_before(before):
        front = graph.call_function(torch.ops.aten.permute.default, (tensor, order))
    set_fake_value(front)
    gathered = insert_last_token(graph, front, mask, order.index(seq_axis), captured, before)
    with graph.inserting_after(gathered):
        back = graph.call_function(torch.ops.aten.permute.default, (gathered, [order.index(a) for a in range(rank)]))
    set_fake_value(back)
    return back


def _is_key_length(expr: sympy.Expr, seq: sympy.Expr) -> bool:
    """past + sequence: the length of a cache after this step."""
    rest = sympy.simplify(expr - seq)
    return rest != 0 and seq not in rest.free_symbols and bool(rest.free_symbols)
