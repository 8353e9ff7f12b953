"""GroupQueryAttention without the present outputs nobody reads: a KV-shared layer (Gemma 4's last
20 of 35) attends over its owner's cache and writes no cache of its own, yet the lowered node
still names a present key and value. Asked for them, ONNX Runtime 1.32's CPU kernel zero-fills
them as long as the past (GenAI's shared buffer: max_length slots) and copies each row's real
tokens into them at every step; without them it reads the past where it lies. The outputs are
optional in the contrib op's schema.

Measured on the CPU EP (one thread, as GenAI runs it on 2 cores; 512 real tokens, one query, 8
heads, one KV head, medians of 200 interleaved calls), one KV-shared call with presents / with the
past first cut to its real tokens by a Slice (this exporter's earlier form) / without presents:
0.39 / 0.45 / 0.34 ms (head 256) and 0.62 / 0.72 / 0.53 ms (head 512) at 576 slots; 0.48 / 0.34 /
0.23 and 1.51 / 0.99 / 0.59 ms at 4096. In a gemma-4-e2b-shape fp32 decode step (ONNX Runtime's
profiler, 576 slots) its 20 KV-shared layers' attention took 6.2-6.7 ms against 9.1 ms with the
Slice. Verified on ONNX Runtime 1.32's CPU kernel (``tests/exporter/onnx_passes/test_omit_unread_presents.py``);
a profile turns it on only for a kernel that was run so. On cpu, a KV-shared call on one query per
row (every call once prefill is truncated) then becomes MatMul/Softmax
(``matmul_kv_shared_attention``); what this pass leaves runs with ``--full-logits``."""

from __future__ import annotations

import onnx_ir as ir


def _unread(value: ir.Value) -> bool:
    return not value.uses() and not value.is_graph_output()


def _is_attention(node: ir.Node | None) -> bool:
    return node is not None and node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft"


def _reads_another_layers_cache(node: ir.Node) -> bool:
    """A KV-shared call: its past is another GroupQueryAttention's present, not a graph input."""
    return _is_attention(node.inputs[3].producer() if len(node.inputs) > 3 and node.inputs[3] is not None else None)


class OmitUnreadPresents:
    name = "omit_unread_presents"

    def applies(self, settings, session) -> str | None:
        if not (settings.profile.attention_kernel.fills_requested_presents and settings.attention_op and session.is_decoder
                and settings.layout.num_kv_shared_layers):
            return None
        return (f"{settings.profile.name}'s GroupQueryAttention fills every present it is asked for and reads the past "
                "in place when asked for none")

    def __call__(self, model: ir.Model, settings, session) -> dict[str, int]:
        omitted = 0
        for node in list(model.graph.all_nodes()):
            if not _is_attention(node) or len(node.outputs) != 3:
                continue
            if not all(_unread(present) for present in node.outputs[1:]):
                if _reads_another_layers_cache(node):  # nothing should read a KV-shared layer's own present
                    raise RuntimeError(f"{self.name}: KV-shared GroupQueryAttention {node.name} has its present read")
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
