"""What must hold of a finished session's graph, read off the graph alone: the export checks it
before writing, and ``check`` checks a package with the same functions. Every session's ops must
have types their ONNX schemas allow; the other demands are the decoder's (the one session GenAI
captures and gives a KV cache), and for the other sessions of a multimodal package the export
only reports the nodes that would run on the CPU (``uncaptured_cpu_note``).

- ``cpu_placed_nodes``: the nodes an EP would run on the CPU in a graph that must be captured.
- ``presents_written_in_place``: whether every present KV is written by GroupQueryAttention, the
  only attention that can share one KV buffer between past and present.
- ``dtype_refusals``: the ONNX ops whose schema, at the graph's opset, refuses the types they are
  given (bf16 ``Conv`` before opset 22; one type parameter bound to two dtypes): ONNX Runtime
  refuses to load such a graph on any EP.

Graph capture (WebGPU's command recording, CUDA graphs) replays the device work of one run, so a
captured session refuses any node placed on the CPU. ONNX Runtime places on the CPU whatever
computes a shape input: a Reshape target, Slice bounds, Expand/Tile sizes, axes given as inputs,
and so on, together with the Shape/Concat/Squeeze chains that feed them. Constants are fine
(they are read once). This check reads the graph only, so it runs without the EP installed;
``python -m exporter check`` asks the real EP for its placement where it is installed.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
import onnx.defs
import onnx.shape_inference
import onnx_ir as ir

# (op type, input indices read on the CPU) for the ONNX ops a decoder graph uses.
_SHAPE_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,),
    "Expand": (1,),
    "Tile": (1,),
    "Slice": (1, 2, 3, 4),
    "Squeeze": (1,),
    "Unsqueeze": (1,),
    "ReduceSum": (1,),
    "ReduceMean": (1,),
    "ReduceMax": (1,),
    "ReduceMin": (1,),
    "CumSum": (1,),
    "Split": (1,),
    "Pad": (1, 2, 3),
    "TopK": (1,),
    "ConstantOfShape": (0,),
    "Range": (0, 1, 2),
    "OneHot": (1,),
    "Resize": (1, 2, 3),
}
# Ops whose every output is host memory.
_HOST_OPS = {"Shape", "Size", "NonZero"}


def cpu_placed_nodes(model: ir.Model) -> list[ir.Node]:
    """Nodes that compute a value read on the CPU, in graph order."""
    found: dict[int, ir.Node] = {}
    pending: list[ir.Value] = []
    for node in model.graph.all_nodes():
        if node.op_type in _HOST_OPS:
            found[id(node)] = node
        for index in _SHAPE_INPUTS.get(node.op_type, ()) if node.domain in ("", "ai.onnx") else ():
            if index < len(node.inputs) and node.inputs[index] is not None:
                pending.append(node.inputs[index])
    while pending:
        value = pending.pop()
        producer = value.producer()
        if producer is None or ir.convenience.get_const_tensor(value) is not None or id(producer) in found:
            continue
        found[id(producer)] = producer
        pending.extend(v for v in producer.inputs if v is not None)
    order = {id(node): i for i, node in enumerate(model.graph.all_nodes())}
    return sorted(found.values(), key=lambda node: order[id(node)])


def describe(nodes: list[ir.Node], limit: int = 6) -> str:
    named = ", ".join(f"{n.op_type} {n.name}" for n in nodes[:limit])
    more = f" and {len(nodes) - limit} more" if len(nodes) > limit else ""
    return named + more


def presents_written_in_place(model: ir.Model) -> bool:
    """Every ``present.*`` output is written by GroupQueryAttention (there is at least one)."""
    has_presents = any(v.name.startswith("present.") for v in model.graph.outputs)
    return has_presents and not presents_not_in_place(model)


def presents_not_in_place(model: ir.Model) -> list[str]:
    """The ``present.*`` outputs something other than GroupQueryAttention writes."""
    return sorted(v.name for v in model.graph.outputs
                  if v.name.startswith("present.") and ((node := v.producer()) is None or node.op_type != "GroupQueryAttention"))


@dataclass(frozen=True)
class DtypeRefusal:
    """``node``'s schema binds its inputs at ``inputs`` and outputs at ``outputs`` to one type,
    ``type_param``, which may be one of ``allowed``; the known ones are ``dtypes`` (sorted), which
    the schema refuses: a dtype it does not allow, or more than one. ``others_fixed``: every other
    output of the node has a type of its own (a literal or one-type parameter), so changing
    ``type_param`` changes no other output."""

    node: ir.Node
    type_param: str
    dtypes: tuple[ir.DataType, ...]
    allowed: frozenset[str]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    others_fixed: bool

    @property
    def dtype(self) -> ir.DataType | None:
        """The one dtype bound, where they agree."""
        return self.dtypes[0] if len(self.dtypes) == 1 else None

    def __str__(self) -> str:
        if self.dtype is not None:
            return f"{self.node.op_type} {self.node.name} on {_schema_type(self.dtype)}"
        types = " and ".join(map(_schema_type, self.dtypes))
        return f"{self.node.op_type} {self.node.name} with {self.type_param} bound to {types}"


def dtype_refusals(model: ir.Model) -> list[DtypeRefusal]:
    """Every standard-domain node whose tensor types its ONNX schema (at the graph's opset)
    refuses: a type parameter bound to a dtype it does not allow, or to several (where its formals
    are homogeneous). One entry per node and type parameter, in graph order (subgraphs too). Nodes
    of other domains (and ONNX Runtime's ops registered in the ONNX domain, which have no ONNX
    schema) and sequence or optional values are not checked; nor is a declared output type against
    what the schema would infer from an attribute (``Cast``'s ``to``)."""
    opset = model.opset_imports.get("")
    if opset is None:
        return []
    dtypes = value_dtypes(model)
    refusals = []
    for node in model.graph.all_nodes():
        if node.domain not in ("", "ai.onnx") or (schema := _schema(node.op_type, opset)) is None:
            continue
        allowed = {c.type_param_str: frozenset(c.allowed_type_strs) for c in schema.type_constraints}
        inputs, outputs = _bound_indices(schema.inputs, node.inputs), _bound_indices(schema.outputs, node.outputs)
        for type_param in dict.fromkeys([*inputs, *outputs]):
            if type_param not in allowed:  # a literal type (``tensor(int64)``), checked by no one here
                continue
            bound = [node.inputs[i] for i in inputs.get(type_param, ())] + \
                    [node.outputs[i] for i in outputs.get(type_param, ())]
            found = tuple(sorted({dtypes[v] for v in bound if v is not None and v in dtypes}, key=int))
            # A heterogeneous formal (If's, Loop's outputs) may hold several types.
            homogeneous = all(f.is_homogeneous for f in (*schema.inputs, *schema.outputs) if f.type_str == type_param)
            refused = [d for d in found if _schema_type(d) not in allowed[type_param]]
            if refused or (len(found) > 1 and homogeneous):
                fixed = all(other not in allowed or len(allowed[other]) == 1 for other in outputs if other != type_param)
                refusals.append(DtypeRefusal(
                    node, type_param, found, allowed[type_param],
                    tuple(i for i in inputs.get(type_param, ()) if node.inputs[i] is not None),
                    tuple(i for i in outputs.get(type_param, ()) if node.outputs[i].name), fixed))
    return refusals


def value_dtypes(model: ir.Model) -> dict[ir.Value, ir.DataType]:
    """Every tensor value's dtype: the graph's own where it has one, else inferred node by node in
    graph order with the ONNX schemas (inlined functions leave their values untyped). Sequences
    and optionals are left out."""
    opset = model.opset_imports.get("")
    dtypes: dict[ir.Value, ir.DataType] = {}
    for graph in model.graphs():
        for value in [*graph.inputs, *graph.initializers.values()]:
            if isinstance(value.type, ir.TensorType):
                dtypes[value] = value.dtype
    for node in model.graph.all_nodes():
        for value in node.outputs:
            if isinstance(value.type, ir.TensorType):
                dtypes[value] = value.dtype
        missing = [v for v in node.outputs if v.type is None and v.name]
        if not missing or node.domain not in ("", "ai.onnx") or (schema := _schema(node.op_type, opset)) is None:
            continue
        inputs = [v for v in node.inputs if v is not None]
        if any(v not in dtypes for v in inputs) or any(a.type == ir.AttributeType.GRAPH for a in node.attributes.values()):
            continue
        types = {v.name: onnx.helper.make_tensor_type_proto(int(dtypes[v]), None) for v in inputs}
        try:
            inferred = onnx.shape_inference.infer_node_outputs(schema, ir.serde.serialize_node(node), types)
        except Exception:  # noqa: BLE001 - e.g. a type the schema refuses: its outputs share their inputs' type
            inferred = {}
            bound_inputs = _bound_indices(schema.inputs, node.inputs)
            for type_param, indices in _bound_indices(schema.outputs, node.outputs).items():
                given = {dtypes[node.inputs[i]] for i in bound_inputs.get(type_param, ()) if node.inputs[i] is not None}
                if len(given) == 1:
                    for index in indices:
                        if node.outputs[index] in missing:
                            dtypes[node.outputs[index]] = next(iter(given))
        for value in missing:
            if value.name in inferred and inferred[value.name].HasField("tensor_type"):
                if elem_type := inferred[value.name].tensor_type.elem_type:
                    dtypes[value] = ir.DataType(elem_type)
    return dtypes


def _schema(op_type: str, opset: int) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:  # e.g. ONNX Runtime's SimplifiedLayerNormalization
        return None


def _bound_indices(formals, values) -> dict[str, tuple[int, ...]]:
    """The indices of a node's inputs (or outputs) that each type parameter binds; a variadic last
    formal takes the rest."""
    bound: dict[str, list[int]] = {}
    variadic = bool(formals) and formals[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic
    for index in range(len(values) if variadic else min(len(values), len(formals))):
        bound.setdefault(formals[min(index, len(formals) - 1)].type_str, []).append(index)
    return {type_param: tuple(indices) for type_param, indices in bound.items()}


def _schema_type(dtype: ir.DataType) -> str:
    return f"tensor({onnx.TensorProto.DataType.Name(int(dtype)).lower()})"


def require(model: ir.Model, settings, session) -> None:
    """The export's check of a finished session against its plan (``exporter.plan.ExportSettings``):
    a one-line ``ExporterError`` before anything is written where GenAI would refuse the package."""
    from exporter.errors import ExporterBug, ExporterError

    if refused := dtype_refusals(model):
        raise ExporterBug(f"the {session.name} session gives ops types their ONNX schema does not allow, which "
                          f"ONNX Runtime refuses to load ({', '.join(map(str, refused[:4]))}"
                          f"{f' and {len(refused) - 4} more' if len(refused) > 4 else ''}); please report the model")
    if not session.is_decoder:
        return
    name = settings.profile.name
    if settings.share_kv_buffer and not presents_written_in_place(model):
        raise ExporterBug(f"EP '{name}' shares the KV buffer, but some present KV is not written by "
                          "GroupQueryAttention; please report the model")
    if not session.captured(settings):
        return
    if not settings.share_kv_buffer:
        # ONNX Runtime GenAI captures only decoders whose past and present share one buffer.
        raise ExporterError(
            f"EP '{name}' captures the decoder's graph, which needs every present KV written in place "
            "by GroupQueryAttention (a shared past/present buffer), and this graph's are not; export with "
            "--no-graph-capture (API: graph_capture=False)"
        )
    if on_cpu := cpu_placed_nodes(model):
        raise ExporterError(
            f"EP '{name}' captures the decoder's graph, but {len(on_cpu)} nodes would run on the CPU "
            f"({describe(on_cpu)}); export with --no-graph-capture (API: graph_capture=False), or report the model"
        )


def uncaptured_cpu_note(model: ir.Model, settings, session) -> str | None:
    """For a session an EP runs without graph capture (a multimodal package's encoders and
    embedding): the nodes ONNX Runtime would place on the CPU, for the report. Not an error: only
    a captured graph must run whole on the EP."""
    if session.captured(settings) or not settings.profile.genai_provider:
        return None
    on_cpu = cpu_placed_nodes(model)
    if not on_cpu or session.is_decoder:
        return None
    return (f"{session.name} session: {len(on_cpu)} shape nodes run on the CPU beside "
            f"{settings.profile.name} ({describe(on_cpu, 3)}); it is not captured, so that only costs copies")
