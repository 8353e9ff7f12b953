"""Make an FX-passed program what torch.onnx's decomposition step would give it, without that
step's re-trace of the whole graph (12 of 16.5 s lowering a 35-layer Gemma 4).

A traced decoder already holds only ops torch.onnx translates, but for a few things the re-trace
fixed as a side effect, done here directly:
- values: FX passes change shapes upstream (the last-token passes turn a layer's sequence into one
  token) without re-running what follows; the fake values of the nodes a pass changed, and of
  those downstream of a change, are recomputed in graph order;
- in-place arithmetic on fresh tensors (Gemma 4's ``hidden_states *= layer_scalar``) becomes its
  functional twin where nothing can see the mutation and the dtype stays;
- ``.to()`` that keeps the dtype goes, one that changes it becomes ``_to_copy``; ``&`` and ``|``
  become ``bitwise_and`` / ``bitwise_or``;
- reshapes (``flatten``, ``unflatten``, ``reshape``) become views whose symbolic sizes read the
  nodes that compute them, as the decomposition writes them (torch.onnx's own ``flatten`` reads
  ``Shape`` per node).

``ready_for_translation`` checks everything first and rewrites only when all of it applies;
otherwise it says why and leaves the graph as it was (fake values aside), and lowering keeps
torch.onnx's decomposition.

A ready program's values are fresh, so torch.onnx's next step, explicit type promotion, reads them
(``insert_type_promotions``) instead of re-running every node in fake mode (2.0 s at 35 layers).
"""

from __future__ import annotations

import operator

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node

from fx_passes.analyses.graph_facts import fake_value, same_shape
from fx_passes.base import outputs_named_as_in_graph, program_fake_mode

_aten = torch.ops.aten
_RESHAPES = (_aten.flatten.using_ints, _aten.unflatten.int, _aten.reshape.default)
_CONVERSIONS = (_aten.to.dtype, _aten.to.device, _aten.to.dtype_layout)
# Ops the decomposition writes as another op torch.onnx translates.
_TWINS = {_aten.__and__.Tensor: _aten.bitwise_and.Tensor, _aten.__or__.Tensor: _aten.bitwise_or.Tensor}
# Checks torch.onnx erases after its decomposition step.
_ASSERTIONS = (_aten._assert_scalar.default, _aten._assert_async.default, _aten._assert_async.msg,
               _aten._assert_tensor_metadata.default, _aten.sym_constrain_range_for_size.default)
_REWRITTEN_OR_ERASED = {*_RESHAPES, *_CONVERSIONS, *_TWINS, *_ASSERTIONS}


def ready_for_translation(program: ExportedProgram, translated: set) -> str | None:
    """Rewrite ``program`` in place so that torch.onnx can translate it without its decomposition
    (every op then in ``translated``, its registry) and return None; or return why not, with
    nothing rewritten."""
    modules = [m for m in program.graph_module.modules() if isinstance(m, GraphModule)]
    if len(modules) != 1:
        return "the graph has subgraphs (control flow)"
    graph_module = modules[0]
    graph = graph_module.graph
    order = {node: index for index, node in enumerate(graph.nodes)}
    in_place = [n for n in graph.nodes if n.op == "call_function" and _functional_twin(n.target) is not None
                and _mutation_unobserved(n, order)]
    untranslated = sorted({_op_name(node.target) for node in graph.nodes if node.op == "call_function"
                           and node.target not in translated and node.target not in _REWRITTEN_OR_ERASED
                           and node not in in_place})
    if untranslated:
        return f"torch.onnx translates no {', '.join(untranslated)}"
    if failed := refresh_fake_values(graph_module):
        return failed
    twins = {}
    fake_mode = program_fake_mode(graph)
    for node in in_place:
        twin = _functional_twin(node.target)
        try:
            value = fake_value(node, twin, fake_mode)
        except Exception as error:
            return f"{twin} could not run ({type(error).__name__})"
        kept = node.meta["val"]  # the in-place op keeps its input's dtype and shape
        if twin not in translated or value.dtype != kept.dtype or tuple(value.shape) != tuple(kept.shape):
            return f"{node.target} has no translated twin of the same dtype and shape"
        twins[node] = twin, value
    views = _views_of_reshapes(graph, order)
    if isinstance(views, str):
        return views
    for node, (twin, value) in twins.items():
        node.target, node.meta["val"] = twin, value
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _TWINS:
            node.target = _TWINS[node.target]
    _conversions_as_copies(graph)
    _write_views(graph, views)
    outputs_named_as_in_graph(program)  # a removed ``.to()`` may have been an output
    graph_module.recompile()
    return None


def record_traced_values(program: ExportedProgram) -> None:
    """Remember what each call node's fake value was computed from when the program was traced
    (its op, arguments and its inputs' values), so that ``refresh_fake_values`` recomputes only
    what a pass changed and what lies downstream of a change. A program without this record gets
    every value recomputed."""
    graph_module = program.graph_module
    graph_module.meta[_TRACED_VALUES] = {
        node: _computed_from(node) for node in graph_module.graph.nodes
        if node.op == "call_function" and "val" in node.meta}


_TRACED_VALUES = "exporter.traced_values"


def refresh_fake_values(graph_module: GraphModule) -> str | None:
    """Bring every call node's fake value up to date with its inputs', in graph order, in the mode
    the program was traced in; where one cannot be, all are left as they were and the reason is
    returned.

    A node is recomputed unless it is as traced (``record_traced_values``: same op and arguments,
    each input's value the very one it was traced with); a recomputed value equal to the one it
    replaces (dtype, device, symbolic sizes and strides) keeps the old object, so its users need
    not run again. That gives the values recomputing all gives, running fewer nodes: 1379 of
    gemma-4-e2b-shape's 2392, most of them in the KV-shared layers the truncation pass cut to one
    token (0.8 against 1.4 s)."""
    nodes = [n for n in graph_module.graph.nodes if n.op == "call_function"]
    before = {node: node.meta["val"] for node in nodes if "val" in node.meta}
    traced = graph_module.meta.get(_TRACED_VALUES, {})
    fake_mode = program_fake_mode(graph_module.graph)
    for node in nodes:
        if node in before and node in traced and _same_inputs(traced[node], _computed_from(node)):
            continue
        try:
            value = fake_value(node, fake_mode=fake_mode)
        except Exception as error:  # e.g. an op without a fake kernel: the re-trace will say more
            for done in nodes:
                done.meta.pop("val", None)
                if done in before:
                    done.meta["val"] = before[done]
            return f"{_op_name(node.target)}'s value could not be recomputed ({type(error).__name__})"
        if not (node in before and _same_value(before[node], value)):
            node.meta["val"] = value
    return None


def _computed_from(node: Node) -> tuple:
    return node.target, node.args, node.kwargs, tuple(n.meta.get("val") for n in node.all_input_nodes)


def _same_inputs(recorded: tuple, now: tuple) -> bool:
    """Same op and arguments, and each input's value the same object."""
    return (recorded[0] is now[0] and _same_argument(recorded[1], now[1]) and _same_argument(recorded[2], now[2])
            and len(recorded[3]) == len(now[3]) and all(old is new for old, new in zip(recorded[3], now[3], strict=True)))


def _same_argument(old, new) -> bool:
    """Nodes by identity; sequences and dicts item by item; anything else by type and value (``2``
    is not ``2.0``: the op would give another dtype)."""
    if isinstance(old, Node) or isinstance(new, Node):
        return old is new
    if isinstance(old, (tuple, list)) and isinstance(new, (tuple, list)):
        return type(old) is type(new) and len(old) == len(new) and all(
            _same_argument(a, b) for a, b in zip(old, new, strict=True))
    if isinstance(old, dict) and isinstance(new, dict):
        return old.keys() == new.keys() and all(_same_argument(old[key], new[key]) for key in old)
    if type(old) is not type(new):
        return False
    try:
        return old is new or bool(old == new)
    except Exception:  # a value that does not compare as a plain one
        return False


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _same_value(old, new) -> bool:
    """Whether two fake values describe the same thing: a tensor's dtype, device, sizes, strides
    and offset (symbolic ones by their expressions, which adds no guard), a symbolic scalar's
    expression, a sequence's items, a plain value's value."""
    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        return (old.dtype == new.dtype and old.device == new.device
                and same_shape((*old.shape, *old.stride(), old.storage_offset()),
                               (*new.shape, *new.stride(), new.storage_offset())))
    if isinstance(old, _SYMBOLIC) or isinstance(new, _SYMBOLIC):
        return type(old) is type(new) and old.node.expr == new.node.expr
    if isinstance(old, (tuple, list)) and isinstance(new, (tuple, list)):
        return type(old) is type(new) and len(old) == len(new) and all(
            _same_value(a, b) for a, b in zip(old, new, strict=True))
    if old is None or isinstance(old, (bool, int, float)):
        return type(old) is type(new) and old == new
    return False


def insert_type_promotions(graph_module: GraphModule) -> None:
    """torch.onnx's explicit type promotion (a cast where an op's inputs differ in dtype, a Python
    number as a tensor of the op's dtype) by torch.onnx's own rules and interpreter, except that a
    node it leaves as it was gives its recorded value instead of running again. Only for a program
    ``ready_for_translation`` made ready: every call node's value was just brought up to date, and a
    promotion keeps each node's output dtype and shape, so no recorded value goes stale."""
    from torch.onnx._internal.fx.passes import type_promotion

    class OnRecordedValues(type_promotion._TypePromotionInterpreter):
        def run_node(self, node: Node):
            with self._set_current_node(node):
                if rule := type_promotion.get_type_promotion_rule(node, self.type_promotion_table):
                    self._maybe_promote_node(node, rule)  # re-runs the node if it changed it
            if node.op == "call_function" and "val" in node.meta:
                return node.meta["val"]
            return torch.fx.Interpreter.run_node(self, node)  # placeholders, attributes, the output

    promotion = type_promotion.InsertTypePromotion(graph_module)
    promotion.interpreter = OnRecordedValues(graph_module, type_promotion.TypePromotionTable())
    promotion.run()


def _op_name(target) -> str:
    """``aten.mul_.Tensor``, or a Python function's name (its repr holds an address)."""
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


def _conversions_as_copies(graph: torch.fx.Graph) -> None:
    """``x.to(...)``: gone where the dtype stays (the device is the exporter's choice, not the
    graph's), else ``_to_copy`` to the new dtype, as the decomposition writes it."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _CONVERSIONS:
            continue
        source = node.args[0]
        if node.target is _aten.to.dtype_layout:
            dtype = node.kwargs.get("dtype")
        else:
            dtype = node.args[1] if node.target is _aten.to.dtype else node.args[2]
        if dtype is None or dtype == source.meta["val"].dtype:
            node.replace_all_uses_with(source)
            graph.erase_node(node)
        else:
            node.target, node.args, node.kwargs = _aten._to_copy.default, (source,), {"dtype": dtype}


def _views_of_reshapes(graph: torch.fx.Graph, order: dict) -> dict | str:
    """For each ``flatten`` / ``unflatten`` / ``reshape``, the sizes of the view to its output
    shape: each symbolic size is the node that already computes it, or a graph input's
    (placeholder, axis). Where some size is neither (a product of sizes), why not: the
    decomposition computes it in its own way."""
    size_nodes: dict = {}
    for node in graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.SymInt):
            size_nodes.setdefault(value.node.expr, node)
    input_dims: dict = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            for axis, size in enumerate(getattr(node.meta.get("val"), "shape", ())):
                if isinstance(size, torch.SymInt):
                    input_dims.setdefault(size.node.expr, (node, axis))
    views = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _RESHAPES:
            continue
        sizes: list = []
        for size in node.meta["val"].shape:
            if not isinstance(size, torch.SymInt):
                sizes.append(int(size))
                continue
            known = size_nodes.get(size.node.expr)
            if known is not None and order[known] < order[node]:
                sizes.append(known)
            elif size.node.expr in input_dims:
                sizes.append(input_dims[size.node.expr])
            else:
                return f"{node.target} to a size no node computes ({size.node.expr})"
        views[node] = sizes
    return views


def _write_views(graph: torch.fx.Graph, views: dict) -> None:
    """Each reshape -> ``view`` of a contiguous copy to its sizes; the input dimensions a size
    reads become ``sym_size`` nodes right after the graph's inputs."""
    made: dict = {}
    for node, sizes in views.items():
        for index, size in enumerate(sizes):
            if isinstance(size, tuple):  # (placeholder, axis)
                if size not in made:
                    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
                    with graph.inserting_after(last_input):
                        made[size] = graph.call_function(_aten.sym_size.int, size)
                    made[size].meta["val"] = size[0].meta["val"].shape[size[1]]
                sizes[index] = made[size]
        # A view needs a contiguous source in torch, and whether a fake value is contiguous can
        # differ between dispatch modes (CPU attention's output): a contiguous copy makes it so
        # in any. It lowers to an Identity, which the ONNX passes remove.
        with graph.inserting_before(node):
            source = graph.call_function(_aten.clone.default, (node.args[0],),
                                         {"memory_format": torch.contiguous_format})
        source.meta["val"] = node.args[0].meta["val"].clone(memory_format=torch.contiguous_format)
        node.target, node.args, node.kwargs = _aten.view.default, (source, sizes), {}


def _functional_twin(target) -> torch._ops.OpOverload | None:
    """``aten.mul.Tensor`` for ``aten.mul_.Tensor``: an in-place aten op that writes its first
    argument only and returns it."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    schema = target._schema
    name = schema.name.split("::")[-1]
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if not name.endswith("_") or written != schema.arguments[:1] or len(schema.returns) != 1:
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


def _mutation_unobserved(node: Node, order: dict) -> bool:
    mutated = node.args[0] if node.args else None
    if not isinstance(mutated, Node) or not _fresh_result(mutated):
        return False
    others = [user for user in mutated.users if user is not node]
    return all(order[user] < order[node] and _fresh_result(user) for user in others)


def _fresh_result(node: Node) -> bool:
    """The node's output owns its memory: an aten op whose results alias no argument, or one of
    such an op's results."""
    if node.op == "call_function" and node.target is operator.getitem:
        return isinstance(node.args[0], Node) and _fresh_result(node.args[0])
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    schema = node.target._schema
    return not schema.is_mutable and all(r.alias_info is None for r in schema.returns)
