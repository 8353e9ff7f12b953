"""GroupQueryAttention without the present outputs nobody reads: a KV-shared layer (Gemma 4's last
20 of 35) attends over its owner's cache and writes no cache of its own, yet the lowered node
still names a present key and value. Asked for them, ONNX Runtime 1.32's CPU kernel zero-fills
them (as long as the past: GenAI's buffer of max_length slots) and copies the past into them at
every step; without them it reads the past where it lies. The outputs are optional in the
contrib op's schema.

Measured on the CPU EP, one KV-shared decode call (one query, 8 heads, one KV head, a 576-slot
past): 0.19 against 0.50 ms at head size 256, 0.54 against 0.83 ms at 512; with a 4096-slot past
the call without presents still takes 0.23 ms. In a gemma-4-e2b-shape fp32 decode step (512-token
past, one thread) its 35 GroupQueryAttention nodes take about 11 ms instead of 13-14.6 ms.
Verified on ONNX Runtime 1.32's CPU kernel (``tests/exporter/test_omit_unread_presents.py``); a
profile turns it on only for a kernel that was run so."""

from __future__ import annotations

import onnx_ir as ir


def _unread(value: ir.Value) -> bool:
    return not value.uses() and not value.is_graph_output()


class OmitUnreadPresents:
    name = "omit_unread_presents"

    def applies(self, facts, session) -> str | None:
        if not (facts.profile.omit_unread_presents and facts.attention_op and session.is_decoder
                and facts.layout.num_kv_shared_layers):
            return None
        return (f"{facts.profile.name}'s GroupQueryAttention reads a KV-shared layer's past in place when asked for "
                "no present")

    def __call__(self, model: ir.Model, facts=None) -> dict[str, int]:
        omitted = 0
        for node in list(model.graph.all_nodes()):
            if (node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft" or len(node.outputs) != 3
                    or not all(_unread(present) for present in node.outputs[1:])):
                continue
            output = node.outputs[0]
            replacement = ir.Node(node.domain, node.op_type, list(node.inputs),
                                  attributes=list(node.attributes.values()), num_outputs=1, name=node.name,
                                  version=node.version)
            replacement.outputs[0].shape, replacement.outputs[0].type = output.shape, output.type
            node.graph.insert_before(node, replacement)
            output.replace_all_uses_with(replacement.outputs[0], replace_graph_outputs=True)
            node.graph.remove(node, safe=True)
            replacement.outputs[0].name = output.name
            omitted += 1
        return {"presents_omitted": omitted}
