"""Make an FX-passed program what torch.onnx's decomposition step would give it, without that
step's re-trace of the whole graph (12 of 16.5 s lowering a 35-layer Gemma 4).

A traced decoder already holds only ops torch.onnx translates, but for three things the re-trace
fixed as a side effect, done here directly:
- values: FX passes change shapes upstream (the last-token passes turn a layer's sequence into one
  token) without re-running what follows; every node's fake value is recomputed, in graph order
  (2.5 s at 35 layers);
- in-place arithmetic on fresh tensors (Gemma 4's ``hidden_states *= layer_scalar``) becomes its
  functional twin where nothing can see the mutation;
- reshapes (``flatten``, ``unflatten``, ``reshape``) become views whose symbolic sizes read the
  nodes that compute them, as the decomposition writes them (torch.onnx's own ``flatten`` reads
  ``Shape`` per node).

``prepare`` says why the program is not ready where it is not (an op torch.onnx cannot translate,
a node whose value cannot be recomputed, control flow); lowering then keeps torch.onnx's
decomposition.
"""

from __future__ import annotations

import operator

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate

from fx_passes.base import program_fake_mode

_aten = torch.ops.aten
_RESHAPES = (_aten.flatten.using_ints, _aten.unflatten.int, _aten.reshape.default)
_CONVERSIONS = (_aten.to.dtype, _aten.to.device, _aten.to.dtype_layout)
# Ops the decomposition writes as another op torch.onnx translates.
_TWINS = {_aten.__and__.Tensor: _aten.bitwise_and.Tensor, _aten.__or__.Tensor: _aten.bitwise_or.Tensor}
# Checks torch.onnx erases after its decomposition step.
_ASSERTIONS = (_aten._assert_scalar.default, _aten._assert_async.default, _aten._assert_async.msg,
               _aten._assert_tensor_metadata.default, _aten.sym_constrain_range_for_size.default)
_HANDLED_HERE = {*_RESHAPES, *_CONVERSIONS, *_TWINS, *_ASSERTIONS}


def prepare(program: ExportedProgram, translated: set) -> str | None:
    """Rewrite ``program`` in place; None where every node is then in ``translated`` (torch.onnx's
    registry) and the decomposition can be skipped, else why not (the program is then left as the
    decomposition can take it)."""
    modules = [m for m in program.graph_module.modules() if isinstance(m, GraphModule)]
    if len(modules) != 1:
        return "the graph has subgraphs (control flow)"
    graph_module = modules[0]
    functionalize_in_place_arithmetic(graph_module)
    untranslated = sorted({str(node.target) for node in graph_module.graph.nodes if node.op == "call_function"
                           and node.target not in translated and node.target not in _HANDLED_HERE})
    if untranslated:
        return f"torch.onnx translates no {', '.join(untranslated)}"
    if failed := refresh_fake_values(graph_module):
        return failed
    conversions_as_copies(graph_module)
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target in _TWINS:
            node.target = _TWINS[node.target]
    failed = reshapes_as_views(graph_module)
    graph_module.recompile()
    return failed


def refresh_fake_values(graph_module: GraphModule) -> str | None:
    """Recompute every call node's fake value from its inputs', in graph order, in the mode the
    program was traced in; where one cannot be, all are left as they were and the reason is
    returned."""
    fake_mode = program_fake_mode(graph_module.graph)
    nodes = [n for n in graph_module.graph.nodes if n.op == "call_function"]
    before = {node: node.meta.get("val") for node in nodes}

    def value(argument):
        return argument.meta["val"] if isinstance(argument, Node) else argument

    with fake_mode:
        for node in nodes:
            try:
                node.meta["val"] = node.target(*map_aggregate(node.args, value), **map_aggregate(node.kwargs, value))
            except Exception as error:  # e.g. an op without a fake kernel: the re-trace will say more
                for done, old in before.items():
                    done.meta["val"] = old
                return f"{node.target}'s value could not be recomputed ({type(error).__name__})"
    return None


def conversions_as_copies(graph_module: GraphModule) -> int:
    """``x.to(...)``: gone where the dtype stays (the device is the exporter's choice, not the
    graph's), else ``_to_copy`` to the new dtype, as the decomposition writes it. Returns how many
    were rewritten."""
    graph = graph_module.graph
    rewritten = 0
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
        rewritten += 1
    return rewritten


def functionalize_in_place_arithmetic(graph_module: GraphModule) -> int:
    """``x.mul_(y)`` -> ``mul(x, y)`` where nothing else can see ``x`` change: ``x`` is a fresh
    (non-aliasing) result whose other users all run before and alias nothing. Returns how many."""
    order = {node: index for index, node in enumerate(graph_module.graph.nodes)}
    rewritten = 0
    for node in graph_module.graph.nodes:
        twin = _functional_twin(node.target) if node.op == "call_function" else None
        if twin is not None and _mutation_unobserved(node, order):
            node.target = twin
            rewritten += 1
    if rewritten:
        graph_module.recompile()
    return rewritten


def reshapes_as_views(graph_module: GraphModule) -> str | None:
    """``flatten`` / ``unflatten`` / ``reshape`` -> ``view`` to their output shape, each symbolic
    size read from the node that already computes it or from a graph input's dimension, as the
    decomposition writes them. Where some size is neither (a product of sizes), nothing is
    rewritten and the reason is returned: the decomposition computes it in its own way."""
    graph = graph_module.graph
    order = {node: index for index, node in enumerate(graph.nodes)}
    size_nodes: dict = {}
    for node in graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.SymInt):
            size_nodes.setdefault(value.node.expr, node)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    input_dims: dict = {}
    for node in placeholders:
        for axis, size in enumerate(getattr(node.meta.get("val"), "shape", ())):
            if isinstance(size, torch.SymInt):
                input_dims.setdefault(size.node.expr, (node, axis, size))
    reshapes = [n for n in graph.nodes if n.op == "call_function" and n.target in _RESHAPES]
    for node in reshapes:
        for size in node.meta["val"].shape:
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            known = size_nodes.get(expr)
            if expr is not None and expr not in input_dims and (known is None or order[known] > order[node]):
                return f"{node.target} to a size no node computes ({expr})"
    made: dict = {}
    for node in reshapes:
        sizes: list = []
        for size in node.meta["val"].shape:
            if not isinstance(size, torch.SymInt):
                sizes.append(int(size))
                continue
            expr = size.node.expr
            known = size_nodes.get(expr)
            if known is None or order[known] > order[node]:
                if expr not in made:
                    placeholder, axis, value = input_dims[expr]
                    with graph.inserting_after(placeholders[-1]):
                        made[expr] = graph.call_function(_aten.sym_size.int, (placeholder, axis))
                    made[expr].meta["val"] = value
                known = made[expr]
            sizes.append(known)
        # A view needs a contiguous source in torch, and whether a fake value is contiguous can
        # differ between dispatch modes (CPU attention's output): a contiguous copy makes it so
        # in any. It lowers to an Identity, which the ONNX passes remove.
        with graph.inserting_before(node):
            source = graph.call_function(_aten.clone.default, (node.args[0],),
                                         {"memory_format": torch.contiguous_format})
        source.meta["val"] = node.args[0].meta["val"].clone(memory_format=torch.contiguous_format)
        node.target, node.args, node.kwargs = _aten.view.default, (source, sizes), {}
    return None


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
