"""The residual stream scaled by a power of two, so that a half-precision package holds what the
float32 model holds: 2**-k times every value of the stream, the same numbers otherwise.

Why it is exact: every value of the stream is a sum of what the embedding and the layers write
into it, and it is read only by norms. An RMSNorm or LayerNorm of ``s * x`` with epsilon
``s**2 * eps`` equals the norm of ``x`` with ``eps``, so scaling what is written (the embedding and
each layer's output: a post-norm's scale, a projection's weight) by ``s`` and each reading norm's
epsilon by ``s**2`` changes no output. With ``s`` a power of two, each scaled weight and value is
exact in fp16 (unless it falls below fp16's normal range, 6.1e-5, where it loses low bits) and
the pass adds no node where each write ends in a weight it can scale.

The stream is found in the graph, not by family: the values joined to the final norm's input by
ops that are linear in them (Add, Sub, a skip norm's sum, Concat, Split, Where's branches, Mul or
Div by something outside the stream, reshapes, slices, float casts). Then, at its edges:
- a value the stream starts from (a norm's output, a MatMul, a Mul by a constant, a Gather of a
  table used once) has its weight scaled where nothing else reads that weight; otherwise a Mul by
  ``s`` is inserted (the embedding of a tied table, a graph input);
- a norm reading the stream gets epsilon times ``s**2``;
- a MatMul reading it with a constant weight gets the weight times ``1/s`` (Gemma 4's per-layer
  gate), so its output is the float32 model's;
- anything else reading it (and a graph output) reads it through a Mul by ``1/s``: these are
  counted in the record as ``unscaled_reads``, since there the values are as large as unscaled.

``s`` is ``2**-k`` with ``k`` from ``exporter.load.activation_ranges`` (0: the stream fits fp16 with
headroom, and the pass changes nothing).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import common

from exporter.onnx_passes.base import run_in_place
from exporter.weights.lazy_steps import ScaledWeight


@dataclasses.dataclass(frozen=True)
class _Norm:
    data: tuple[int, ...]  # inputs normalized together (a skip norm adds them first)
    weights: tuple[int, ...]  # inputs that scale or shift its output (scale, and a LayerNorm's bias)
    input_biases: tuple[int, ...] = ()  # inputs added to the data before normalizing
    sum_output: int | None = None  # the output holding the data's sum (a skip norm's residual)


NORMS = {
    "SimplifiedLayerNormalization": _Norm((0,), (1,)),
    "LayerNormalization": _Norm((0,), (1, 2)),
    "SkipSimplifiedLayerNormalization": _Norm((0, 1), (2,), (3,), 3),
    "SkipLayerNormalization": _Norm((0, 1), (2, 3), (4,), 3),
}
# Ops whose first input and outputs carry the same scale (the other inputs are shapes, axes or indices).
# ReduceSum and ReduceMean too: linear, and how the last token's row is picked (Where, ReduceSum).
_LAYOUT = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Flatten", "Slice", "Gather",
                     "GatherElements", "GatherND", "Expand", "Tile", "Split", "ReduceSum", "ReduceMean"})
_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})


class _Union:
    def __init__(self):
        self.parent: dict[ir.Value, ir.Value] = {}

    def find(self, value: ir.Value) -> ir.Value:
        root = value
        while self.parent.get(root, root) is not root:
            root = self.parent[root]
        while value is not root:
            self.parent[value], value = root, self.parent.get(value, value)
        return root

    def join(self, a: ir.Value, b: ir.Value) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[ra] = rb


def _is_constant(value: ir.Value | None) -> bool:
    return value is not None and (value.const_value is not None or value.is_initializer())


def _is_float(value: ir.Value | None) -> bool:
    return value is not None and value.dtype in _FLOATS


def _may_be_float(value: ir.Value | None) -> bool:
    """Float, or of a dtype shape inference left unknown (a linear op's output has its input's)."""
    return value is not None and (value.dtype is None or value.dtype in _FLOATS)


def _linear_links(node: ir.Node) -> list[ir.Value]:
    """The computed float values of ``node`` (inputs and outputs) that carry one scale if any of
    them does: ``node`` is linear in them. Constants are never links: a shared constant must not
    join unrelated nodes (each node gets its own scaled copy)."""
    op, inputs, outputs = node.op_type, list(node.inputs), list(node.outputs)
    if node.domain not in ("", "ai.onnx", "com.microsoft"):
        return []
    if op in NORMS:
        norm = NORMS[op]
        linked = [inputs[i] for i in norm.data if i < len(inputs)]
        if norm.sum_output is not None and len(outputs) > norm.sum_output:
            linked.append(outputs[norm.sum_output])
    elif op in ("Add", "Sub", "Concat", "Sum"):
        linked = [*inputs, *outputs]
    elif op in ("Mul", "Div"):
        # Linear in one operand where the other is a constant (a layer scalar); both computed
        # (a gate times a value) is linear in neither alone.
        if len(inputs) != 2 or not (_is_constant(inputs[1]) or (op == "Mul" and _is_constant(inputs[0]))):
            return []
        linked = [inputs[0] if _is_constant(inputs[1]) else inputs[1], outputs[0]]
    elif op == "Where":
        linked = [*inputs[1:], *outputs]
    elif op == "Cast":
        linked = [inputs[0], outputs[0]] if _may_be_float(inputs[0]) and _is_float(outputs[0]) else []
    elif op in _LAYOUT:
        linked = [inputs[0], *outputs]
    else:
        return []
    return [v for v in linked if _may_be_float(v) and not _is_constant(v)]


def _final_norm(graph: ir.Graph, norms: list[ir.Node]) -> ir.Node:
    """The norm the logits are computed from: the first met walking up from the graph's outputs
    (the last norm in node order where none is met)."""
    seen, frontier = set(), [v for v in graph.outputs if v.name == "logits"] or list(graph.outputs)
    while frontier:
        node = frontier.pop(0).producer()
        if node is None or id(node) in seen:
            continue
        if node.op_type in NORMS:
            return node
        seen.add(id(node))
        frontier += [v for v in node.inputs if v is not None]
    return norms[-1]


class ScaleResidualStream:
    name = "scale_residual_stream"

    def applies(self, settings, session) -> str | None:
        import torch

        if not session.is_decoder or settings.compute_dtype != torch.float16:
            return None
        return ("fp16 activations: the residual stream scaled by the power of two that keeps its float32 peak, "
                "measured at export, inside fp16's range (none where it fits)")

    def __call__(self, model: ir.Model, settings, session) -> dict[str, int]:
        exponent = settings.residual_exponent
        if exponent == 0:
            return {"exponent": 0}
        changes = _Scaling(model.graph, exponent).run()
        run_in_place(common.RemoveUnusedNodesPass(), model)  # a Constant whose scaled copy replaced it
        return changes


class _Scaling:
    def __init__(self, graph: ir.Graph, exponent: int):
        self.graph, self.exponent = graph, exponent
        self.dtype: ir.DataType | None = None  # the stream's, for values whose dtype inference left unknown
        self.counts: Counter[str] = Counter({"exponent": exponent})
        self.unscaled_ops: Counter[str] = Counter()
        self._constants: dict[tuple[ir.DataType, int], ir.Value] = {}
        self._unscaled_values: dict[ir.Value, ir.Value] = {}
        self._touched: set[str] = set()

    def run(self) -> dict[str, int]:
        stream = self._stream()
        for value in self._sources(stream):
            scaled = self._scale_source(value)
            if scaled is not value:
                stream.discard(value)
                stream.add(scaled)
        readers = {id(node): node for value in stream for node, _ in value.uses()}
        for node in readers.values():
            self._scale_constant_inputs(node, stream)
        done: set[int] = set()
        for value in sorted(stream, key=lambda v: v.name or ""):
            for node, index in list(value.uses()):
                self._read(node, index, value, done)
            if value.is_graph_output():
                self._unscale_graph_output(value)
        for name in self._touched:
            old = self.graph.initializers.get(name)
            if old is not None and not old.uses() and not old.is_graph_output():
                self.graph.initializers.pop(name)
        self.counts["stream_values"] = len(stream)
        self.counts["unscaled_reads"] = sum(self.unscaled_ops.values())
        for op, count in sorted(self.unscaled_ops.items()):
            self.counts[f"unscaled_reads_{op.replace(' ', '_')}"] = count
        return dict(self.counts)

    def _stream(self) -> set[ir.Value]:
        """The values joined by linear ops to the input of the norm the logits are computed from."""
        nodes = list(self.graph)
        norms = [n for n in nodes if n.op_type in NORMS]
        if not norms:
            raise RuntimeError("scale_residual_stream: the decoder has no norm to find its residual stream from")
        union = _Union()
        for node in nodes:
            links = _linear_links(node)
            for value in links[1:]:
                union.join(links[0], value)
        seed = _final_norm(self.graph, norms).inputs[0]
        self.dtype = seed.dtype
        if self.dtype not in _FLOATS:
            raise RuntimeError(f"scale_residual_stream: the last norm reads {seed.name} of dtype {seed.dtype}")
        root = union.find(seed)
        return {v for v in union.parent if union.find(v) is root} | {seed}

    def _sources(self, stream: set[ir.Value]) -> list[ir.Value]:
        """The stream's values not made from other stream values by a linear op, moved as far
        downstream as they go: where a linear node reads stream values that are all sources read
        by it alone (two embedding pieces, then their Concat, then the embedding scale), its
        output is the source instead, so one weight (the embedding scale) takes the scale."""
        def is_source(value):
            node = value.producer()
            return node is None or not any(v in stream for v in _linear_links(node) if v is not value)

        sources = {v for v in stream if is_source(v)}
        moved = True
        while moved:
            moved = False
            for value in list(sources):
                uses = list(value.uses())
                if len(uses) != 1 or value.is_graph_output():
                    continue
                node = uses[0][0]
                links = _linear_links(node)
                inputs = [v for v in node.inputs if v in links]
                outputs = [v for v in node.outputs if v in links and v in stream]
                if len(outputs) != 1 or node.op_type in NORMS or not inputs:
                    continue
                if all(v in sources and len(v.uses()) == 1 and not v.is_graph_output() for v in inputs):
                    for v in inputs:
                        sources.discard(v)
                        stream.discard(v)
                    sources.add(outputs[0])
                    moved = True
        return sorted(sources, key=lambda v: v.name or "")

    def _scale_source(self, value: ir.Value) -> ir.Value:
        """``value`` made to hold ``s`` times its numbers: by its producer's weight where only it
        reads that weight (the value itself returned), or by a Mul inserted after it (returned)."""
        node = value.producer()
        if node is not None and self._scale_producer_weights(node, value):
            self.counts["weights_scaled"] += 1
            return value
        if value.is_graph_output():
            raise RuntimeError(f"scale_residual_stream: the stream starts at graph output {value.name}")
        uses = list(value.uses())
        scaled = self._mul(value, -self.exponent)
        for user, index in uses:
            user.replace_input_with(index, scaled)
        self.counts["muls_inserted"] += 1
        return scaled

    def _scale_producer_weights(self, node: ir.Node, value: ir.Value) -> bool:
        if any(out is not value and (out.uses() or out.is_graph_output()) for out in node.outputs):
            return False
        if node.op_type in NORMS and value is node.outputs[0]:
            slots = list(NORMS[node.op_type].weights)
        elif node.op_type in ("MatMul", "Gather"):
            slots = [1 if node.op_type == "MatMul" else 0]
        elif node.op_type in ("Mul", "Div") and len(node.inputs) == 2 and _is_constant(node.inputs[1]):
            slots = [1]
        elif node.op_type == "Mul" and len(node.inputs) == 2 and _is_constant(node.inputs[0]):
            slots = [0]
        else:
            return False
        slots = [i for i in slots if i < len(node.inputs) and node.inputs[i] is not None]
        if not slots or not all(self._read_by_this_alone(node.inputs[i]) for i in slots):
            return False
        for slot in slots:
            self._replace_scaled(node, slot, -self.exponent)
        return True

    def _read_by_this_alone(self, value: ir.Value) -> bool:
        """A weight this node may take a scaled copy of: read by it alone, or a scalar (Granite's
        ``residual_multiplier``, shared by every layer), whose copy costs nothing."""
        if not (value.const_value is not None and _is_float(value) and not value.is_graph_output()):
            return False
        return len(value.uses()) == 1 or value.const_value.size <= 1

    def _scale_constant_inputs(self, node: ir.Node, stream: set[ir.Value]) -> None:
        """A constant added into the stream (a bias, a shared zero) is scaled for this node alone."""
        if node.op_type in NORMS:
            slots = NORMS[node.op_type].input_biases
        elif node.op_type in ("Add", "Sub", "Concat", "Sum", "Where"):
            slots = range(1 if node.op_type == "Where" else 0, len(node.inputs))
        else:
            return
        for slot in slots:
            value = node.inputs[slot] if slot < len(node.inputs) else None
            if _is_constant(value) and _is_float(value):
                self._replace_scaled(node, slot, -self.exponent)
                self.counts["constants_scaled"] += 1

    def _read(self, node: ir.Node, index: int, value: ir.Value, done: set[int]) -> None:
        """A reader of stream value ``value`` (its input ``index``) made to compute what it did."""
        if node.op_type == "Mul" and node.name.startswith(_UNSCALE_PREFIX):
            return
        if value in _linear_links(node):
            if node.op_type in NORMS and id(node) not in done:
                done.add(id(node))
                epsilon = node.attributes.get_float("epsilon", 1e-5)
                node.attributes["epsilon"] = ir.AttrFloat32("epsilon", float(epsilon * 2.0 ** (-2 * self.exponent)))
                self.counts["norms_rescaled"] += 1
            return
        weight = node.inputs[1] if node.op_type == "MatMul" and index == 0 else None
        if weight is not None and weight.is_initializer() and weight.const_value is not None and _is_float(weight):
            self._replace_scaled(node, 1, self.exponent)
            self.counts["readers_compensated"] += 1
            return
        if value not in self._unscaled_values:
            self._unscaled_values[value] = self._mul(value, self.exponent, prefix=_UNSCALE_PREFIX)
        node.replace_input_with(index, self._unscaled_values[value])
        self.unscaled_ops[node.op_type] += 1
        if (value.dtype or self.dtype) in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
            self.counts["unscaled_half_reads"] += 1  # read at its full size in half precision: may overflow

    def _unscale_graph_output(self, value: ir.Value) -> None:
        unscaled = self._mul(value, self.exponent, prefix=_UNSCALE_PREFIX)
        outputs = self.graph.outputs
        outputs[outputs.index(value)] = unscaled
        name = value.name
        value.name = f"{name}_scaled"
        unscaled.name = name
        self.unscaled_ops["graph output"] += 1

    def _mul(self, value: ir.Value, exponent: int, prefix: str = "residual_scale_") -> ir.Value:
        dtype = value.dtype or self.dtype
        constant = self._power_of_two(dtype, exponent)
        name = f"{prefix}{value.name}"
        node = ir.Node("", "Mul", [value, constant], name=name)
        out = node.outputs[0]
        out.name, out.dtype, out.shape = name, dtype, value.shape
        producer = value.producer()
        if producer is not None:
            self.graph.insert_after(producer, node)
        else:
            self.graph.insert_before(next(iter(self.graph)), node)
        return out

    def _power_of_two(self, dtype: ir.DataType, exponent: int) -> ir.Value:
        key = (dtype, exponent)
        if key not in self._constants:
            name = f"residual_scale_{dtype.name.lower()}_{'m' if exponent < 0 else 'p'}{abs(exponent)}"
            tensor = ir.tensor(np.array(2.0 ** exponent, dtype=dtype.numpy()), name=name)
            value = ir.Value(name=name, shape=ir.Shape([]), type=ir.TensorType(dtype), const_value=tensor)
            self.graph.register_initializer(value)
            self._constants[key] = value
        return self._constants[key]

    def _replace_scaled(self, node: ir.Node, slot: int, exponent: int) -> None:
        """``node``'s constant input ``slot`` replaced by a copy times ``2**exponent``."""
        value = node.inputs[slot]
        name = f"{value.name}_times_2_{'m' if exponent < 0 else 'p'}{abs(exponent)}"
        copy = self.graph.initializers.get(name)
        if copy is None:
            tensor = value.const_value
            lazy = ir.LazyTensor(ScaledWeight(tensor, exponent, name), dtype=tensor.dtype, shape=tensor.shape,
                                 name=name)
            copy = ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(tensor.dtype), const_value=lazy)
            self.graph.register_initializer(copy)
        node.replace_input_with(slot, copy)
        if value.is_initializer():
            self._touched.add(value.name)


_UNSCALE_PREFIX = "residual_unscale_"
