"""A KV-shared layer's attention on one query per row as MatMul/Softmax over its owner's real slots,
in place of its GroupQueryAttention: the KV-shared layers (Gemma 4's last 20 of 35) attend over a
cache another layer wrote, and with the prefill truncation every call they make is one query per
row (decode steps, and the prompt's last token).

ONNX Runtime 1.32's CPU GroupQueryAttention computes each query head on its own, so it reads its KV
head once per query head (8 times in Gemma 4). Here each KV head's query heads are the rows of one
MatMul, which reads the keys once. The slots read are the owner's buffer from the earliest slot
any row's window can see to the longest row's last token, one Slice per owner and step (its
readers share it; ``Where`` zeroes a shorter row's slots past its own tokens, so no unwritten
buffer content reaches a score), and the positions, window and padding become one score bias per
window per step.

Measured on the CPU EP, one thread as GenAI runs it on 2 cores: one node timed alone (512 real
tokens, one query, 8 heads, one KV head, medians of 300 interleaved calls) took 0.153 ms as
GroupQueryAttention without presents against 0.064 ms in this form, Slices included (head 256), and
0.290 against 0.132 (head 512). gemma-4-e2b-shape fp32 through GenAI (``scripts/compare_packages.py
--processes 8``) decoded at 22.3 against 21.1 tokens/s at max_length 576 and 22.4 against 21.8 at
4096, TTFT unchanged. Verified against the kernel it replaces in
``tests/exporter/onnx_passes/test_matmul_kv_shared_attention.py``.

A call with several queries per row (``--full-logits``, whose prefill runs every token through
these layers) keeps GroupQueryAttention, which skips what a causal mask hides.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
import torch

from fx_passes.custom_ops.ops import hidden_score_bias

_HANDLED_ATTRIBUTES = {"num_heads", "kv_num_heads", "scale", "softcap", "local_window_size", "do_rotary",
                       "rotary_interleaved"}
_INPUTS_READ = 9  # query, key, value, past key, past value, seqlens_k, total length, cos and sin caches


def _is_attention(node: ir.Node | None) -> bool:
    return node is not None and node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft"


def _input(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if len(node.inputs) > index else None


def _is_kv_shared_call(node: ir.Node) -> bool:
    """A GroupQueryAttention whose past is another GroupQueryAttention's present."""
    past_key = _input(node, 3) if _is_attention(node) else None
    return past_key is not None and _is_attention(past_key.producer())


def _rewritable(node: ir.Node) -> bool:
    """A KV-shared call (its past key and value are one other GroupQueryAttention's presents, it
    brings no new tokens, nobody reads its own presents) on one float32 query per row (the
    precision this form was measured and tested at), with only the attributes and inputs it
    computes."""
    if not _is_kv_shared_call(node):
        return False
    query, new_key, new_value, past_key, past_value = (_input(node, index) for index in range(5))
    return (
        past_value is not None and past_value.producer() is past_key.producer()
        and all(new is not None and new.shape is not None and new.shape[1] == 0 for new in (new_key, new_value))
        and query.shape is not None and query.shape.rank() == 3 and query.shape[1] == 1
        and query.dtype == ir.DataType.FLOAT
        and isinstance(past_key.shape[3] if past_key.shape is not None else None, int)
        and all(not output.uses() and not output.is_graph_output() for output in node.outputs[1:])
        and set(node.attributes) <= _HANDLED_ATTRIBUTES
        and all(value is None for value in node.inputs[_INPUTS_READ:])
    )


class _Builder:
    """Nodes made for one graph, named under one prefix (the pass runs after the name fixes)."""

    def __init__(self, graph: ir.Graph, prefix: str):
        self.graph, self.prefix, self.nodes = graph, prefix, []

    def op(self, op_type: str, inputs, domain: str = "", **attributes) -> ir.Value:
        node = ir.node(op_type, inputs, attributes, domain=domain, name=f"{self.prefix}/{op_type}_{len(self.nodes)}")
        node.outputs[0].name = f"{self.prefix}/{op_type}_{len(self.nodes)}_out"
        self.nodes.append(node)
        return node.outputs[0]

    def constant(self, name: str, array: np.ndarray) -> ir.Value:
        full_name = f"{self.prefix}.{name}"
        if full_name not in self.graph.initializers:
            self.graph.register_initializer(ir.Value(name=full_name, shape=ir.Shape(array.shape),
                                                     type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                                                     const_value=ir.tensor(array, name=full_name)))
        return self.graph.initializers[full_name]


class _Span:
    """One step's slots for every layer with this window: slots [start, end) of the buffers, where
    ``end`` is the longest row's token count and ``start`` the earliest slot any row's window
    reaches; ``row_tokens`` [batch, 1, span, 1] marks each row's own tokens, ``bias`` [batch, 1, 1, span]
    hides what its query may not see."""

    def __init__(self, make: _Builder, seqlens_k: ir.Value, total: ir.Value, window: int, dtype: np.dtype):
        i64 = ir.DataType.INT64
        # The query of row b is its last token, at position seqlens_k[b] (its count of tokens - 1).
        position = make.op("Unsqueeze", [make.op("Cast", [seqlens_k], to=i64), make.constant("axis_1", np.array([1]))])
        self.position = position  # [batch, 1], also the rotary's position ids
        end = make.op("Cast", [total], to=i64)  # a scalar
        if window > 0:
            earliest = make.op("ReduceMin", [position], keepdims=0)
            start = make.op("Max", [make.op("Sub", [earliest, make.constant(f"window_{window}_less_1",
                                                                             np.array(window - 1))]),
                                    make.constant("zero", np.array(0))])
        else:
            start = make.constant("zero", np.array(0))
        slots = make.op("Unsqueeze", [make.op("Range", [start, end, make.constant("one", np.array(1))]),
                                      make.constant("axis_0", np.array([0]))])  # [1, span]
        seen = make.op("LessOrEqual", [slots, position])  # [batch, span]: the row's tokens up to its query
        self.row_tokens = make.op("Unsqueeze", [seen, make.constant("axes_1_3", np.array([1, 3]))])
        if window > 0:
            inside = make.op("Greater", [slots, make.op("Sub", [position, make.constant(f"window_{window}",
                                                                                        np.array(window))])])
            seen = make.op("And", [seen, inside])
        hidden = np.array(hidden_score_bias(torch.float32), dtype)  # float32, the one dtype _rewritable takes
        bias = make.op("Where", [seen, make.constant(f"visible_{dtype.name}", np.array(0, dtype)),
                                 make.constant(f"hidden_{dtype.name}", hidden)])
        self.bias = make.op("Unsqueeze", [bias, make.constant("axes_1_2", np.array([1, 2]))])
        self.start = make.op("Unsqueeze", [start, make.constant("axis_0", np.array([0]))])
        self.end = make.op("Unsqueeze", [end, make.constant("axis_0", np.array([0]))])


class MatmulKvSharedAttention:
    name = "matmul_kv_shared_attention"

    def applies(self, settings, session) -> str | None:
        if not (settings.profile.attention_kernel.reads_kv_head_per_query_head and settings.attention_op and session.is_decoder
                and settings.layout.shared_layer_indices and not settings.full_logits):
            return None
        return (f"{settings.profile.name}'s GroupQueryAttention reads a KV head once per query head; KV-shared layers "
                "run on one query per row")

    def __call__(self, model: ir.Model, settings, session) -> dict[str, int]:
        graph = model.graph
        make = _Builder(graph, self.name)
        spans: dict[tuple, _Span] = {}
        slices: dict[tuple, tuple[ir.Value, ir.Value]] = {}
        rewritten = 0
        for node in list(graph):
            if not _rewritable(node):
                if _is_kv_shared_call(node):  # planned because every KV-shared call should be one query per row
                    raise RuntimeError(
                        f"{self.name}: KV-shared GroupQueryAttention {node.name} is not a float32 call on one query "
                        "per row with unread presents; the truncation pass should have made it one")
                continue
            first = len(make.nodes)
            query, _, _, past_key, past_value, seqlens_k, total = node.inputs[:7]
            attributes = {name: attribute.value for name, attribute in node.attributes.items()}
            heads, kv_heads = attributes["num_heads"], attributes["kv_num_heads"]
            head = past_key.shape[3]
            window = attributes.get("local_window_size", -1)
            dtype = query.dtype.numpy()
            span_key = (seqlens_k, total, max(window, 0))
            if span_key not in spans:
                spans[span_key] = _Span(make, seqlens_k, total, window, dtype)
            span = spans[span_key]
            if (past_key, past_value, span_key) not in slices:
                zero = make.constant(f"zero_{dtype.name}", np.array(0, dtype))
                slices[past_key, past_value, span_key] = tuple(
                    make.op("Where", [span.row_tokens, make.op("Slice", [buffer, span.start, span.end,
                                                                   make.constant("axes_2", np.array([2]))]), zero])
                    for buffer in (past_key, past_value))
            keys, values = slices[past_key, past_value, span_key]
            if attributes.get("do_rotary", 0):
                query = make.op("RotaryEmbedding", [query, span.position, node.inputs[7], node.inputs[8]],
                                domain="com.microsoft", num_heads=heads,
                                interleaved=attributes.get("rotary_interleaved", 0))
            # One token per row: [batch, 1, heads * head] is [batch, KV heads, query heads per KV head, head].
            groups = heads // kv_heads
            rows = make.op("Reshape", [query, make.constant(f"rows_{kv_heads}_{groups}_{head}",
                                                            np.array([0, kv_heads, groups, head]))])
            scores = make.op("MatMul", [rows, make.op("Transpose", [keys], perm=[0, 1, 3, 2])])
            scale = attributes.get("scale", 0.0) or 1 / math.sqrt(head)  # ONNX Runtime's default for 0
            if scale != 1.0:
                factor = make.constant(f"scale_{dtype.name}_{scale!r}", np.array(scale, dtype))
                scores = make.op("Mul", [scores, factor])
            if (softcap := attributes.get("softcap", 0.0)) > 0:
                cap = make.constant(f"softcap_{dtype.name}_{softcap!r}", np.array(softcap, dtype))
                scores = make.op("Mul", [make.op("Tanh", [make.op("Div", [scores, cap])]), cap])
            weights = make.op("Softmax", [make.op("Add", [scores, span.bias])], axis=-1)
            output = make.op("Reshape", [make.op("MatMul", [weights, values]),
                                         make.constant(f"output_{heads * head}", np.array([0, 1, heads * head]))])
            for new_node in make.nodes[first:]:
                graph.insert_before(node, new_node)
            replaced = node.outputs[0]
            output.shape, output.type = replaced.shape, replaced.type
            replaced.replace_all_uses_with(output, replace_graph_outputs=True)
            graph.remove(node, safe=True)
            output.name = replaced.name
            rewritten += 1
        return {"layers": rewritten}
