"""Which tensor types the ONNX schemas allow each node, read off a graph: an analysis, not a pass.
``widen_unsupported_dtypes`` widens what they refuse, and the post-conditions
(``exporter.verify.postconditions``) refuse a session where any refusal is left: ONNX Runtime
refuses to load such a graph on any EP."""

from __future__ import annotations

from dataclasses import dataclass

import onnx
import onnx.defs
import onnx.shape_inference
import onnx_ir as ir


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
