"""What passes read off a torch.export program: its user inputs and outputs, the symbolic
sequence length, dataflow ancestry, which decoder layer a node belongs to, and the values of a
subgraph run on concrete probe inputs."""

from __future__ import annotations

import re

import sympy
import torch
from torch.export import ExportedProgram
from torch.fx import Node

_LAYER_PATTERN = re.compile(r"\.layers\.(\d+)(?:\.|$)")


class PassDidNotApply(RuntimeError):
    """A pass that should have changed the program could not; the message says what it looked
    for and what it found."""


def user_input(program: ExportedProgram, name: str) -> Node:
    return graph_input(program.graph, name)


def graph_input(graph: torch.fx.Graph, name: str) -> Node:
    for node in graph.nodes:
        if node.op == "placeholder" and node.name == name:
            return node
    raise PassDidNotApply(f"the program has no user input named '{name}'")


def graph_outputs(program: ExportedProgram) -> list[Node]:
    output = next(n for n in program.graph.nodes if n.op == "output")
    return list(output.args[0])


def token_input(program: ExportedProgram) -> Node:
    """The decoder's token input: ``input_ids``, or a multimodal decoder's ``inputs_embeds``
    (batch and sequence first in both)."""
    names = {n.name for n in program.graph.nodes if n.op == "placeholder"}
    return user_input(program, "inputs_embeds" if "inputs_embeds" in names else "input_ids")


def sequence_symbol(program: ExportedProgram) -> sympy.Expr:
    """The symbolic length of the current chunk of tokens (the token input's second dimension)."""
    size = token_input(program).meta["val"].shape[1]
    if not isinstance(size, torch.SymInt):
        raise PassDidNotApply("input_ids has a static sequence length; the program was traced without dynamic shapes")
    return size.node.expr


def expr_of(value) -> sympy.Expr | None:
    if isinstance(value, torch.SymInt):
        return value.node.expr
    if isinstance(value, int):
        return sympy.Integer(value)
    return None


def same_shape(a, b) -> bool:
    """Shapes equal dimension by dimension, symbolic sizes compared as expressions (no guards)."""
    return len(a) == len(b) and all(expr_of(x) == expr_of(y) for x, y in zip(a, b, strict=True))


def axes_equal_to(node: Node, expr: sympy.Expr) -> list[int]:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return []
    return [axis for axis, size in enumerate(value.shape) if expr_of(size) == expr]


def ancestors(roots) -> set[Node]:
    """Every node ``roots`` depend on, including in-place writes into a tensor they read: a
    program traced by torch.export keeps ops such as ``copy_`` into a slice (Gemma 3n's AltUp
    ``predictions[1:] += ...``), which have no users, so the dataflow alone would not show them.
    Every write into a tensor's storage counts, whether it comes before or after the read: more
    ancestors than needed, never fewer."""
    roots = [r for r in roots if isinstance(r, Node)]
    writes = _writes_by_base(roots[0].graph) if roots else {}
    seen: set[Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
            stack.extend(writes.get(_storage_base(node), ()))
    return seen


def _writes_by_base(graph) -> dict[Node, list[Node]]:
    """The nodes that write in place into each tensor (by the node that made its storage)."""
    writes: dict[Node, list[Node]] = {}
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        for argument, value in zip(schema.arguments, node.args):
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, Node):
                writes.setdefault(_storage_base(value), []).append(node)
    return writes


def _storage_base(node: Node) -> Node:
    """Follow views (ops whose output aliases their first input, e.g. slice, select, view) to the
    node whose output owns the storage."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], Node):
        schema = getattr(node.target, "_schema", None)
        alias = schema.returns[0].alias_info if schema is not None and len(schema.returns) == 1 else None
        if alias is None:
            break
        node = node.args[0]  # a view, or an in-place op returning its (written) input
    return node


def layer_index(node: Node) -> int | None:
    """The decoder layer a node was traced in (from ``nn_module_stack``), or None outside layers."""
    for path, _ in reversed(list(node.meta.get("nn_module_stack", {}).values())):
        match = _LAYER_PATTERN.search("." + path)
        if match:
            return int(match.group(1))
    return None


def set_fake_value(node: Node) -> None:
    """Fill ``node.meta["val"]`` by running its op on its inputs' fake values, for nodes a pass adds."""
    node.meta["val"] = fake_value(node)


def fake_value(node: Node, target=None, fake_mode=None):
    """What ``target`` (the node's own op by default) gives on the node's inputs' fake values, in
    ``fake_mode`` (by default the one those values carry). An op that writes its first argument
    runs on a copy, so the input's recorded value stays as it is."""
    def fake(argument):
        return argument.meta["val"] if isinstance(argument, Node) else argument

    target = target or node.target
    if fake_mode is None:
        fake_mode = torch._guards.detect_fake_mode([n.meta["val"] for n in node.all_input_nodes if "val" in n.meta])
    args = torch.fx.node.map_aggregate(node.args, fake)
    with fake_mode:
        if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable and args \
                and isinstance(args[0], torch.Tensor):
            args = (args[0].clone(), *args[1:])
        return target(*args, **torch.fx.node.map_aggregate(node.kwargs, fake))


def evaluate_nodes(program: ExportedProgram, targets: list[Node], user_inputs: dict[str, torch.Tensor]) -> list:
    """Run only the ancestors of ``targets`` on concrete inputs (weights from the program)."""
    signature = program.graph_signature
    weights = {}
    for placeholder, name in {**signature.inputs_to_parameters, **signature.inputs_to_buffers}.items():
        weights[placeholder] = program.state_dict[name] if name in program.state_dict else program.constants[name]
    for placeholder, name in signature.inputs_to_lifted_tensor_constants.items():
        weights[placeholder] = program.constants[name]
    needed = ancestors(targets)
    values: dict[Node, object] = {}
    for node in program.graph.nodes:
        if node not in needed:
            continue
        if node.op == "placeholder":
            values[node] = weights[node.name] if node.name in weights else user_inputs[node.name]
        elif node.op == "call_function":
            args = torch.fx.node.map_arg(node.args, values.__getitem__)
            kwargs = torch.fx.node.map_arg(node.kwargs, values.__getitem__)
            values[node] = node.target(*args, **kwargs)
    return [values[t] for t in targets]


def probe_inputs(program: ExportedProgram, length: int, past: int = 0) -> dict[str, torch.Tensor]:
    """One unpadded sequence of ``length`` new tokens after ``past`` cached ones. Past K/V are
    zero-stride views: only their shapes are read by mask and rotary subgraphs."""
    inputs = {}
    for spec in program.graph_signature.input_specs:
        if spec.kind != torch.export.graph_signature.InputKind.USER_INPUT:
            continue
        node = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == spec.arg.name)
        value = node.meta["val"]
        if node.name == "attention_mask":
            inputs[node.name] = torch.ones(1, past + length, dtype=value.dtype)
        elif node.name == "position_ids":
            inputs[node.name] = torch.arange(past, past + length, dtype=value.dtype)[None]
        elif node.name == "input_ids":
            inputs[node.name] = torch.zeros(1, length, dtype=value.dtype)
        elif node.name in ("inputs_embeds", "per_layer_inputs"):  # a multimodal decoder's: [batch, seq, width]
            inputs[node.name] = torch.zeros(1, dtype=value.dtype).expand(1, length, int(value.shape[2]))
        else:  # a past KV input: [batch, heads, past, head]
            shape = (1, int(value.shape[1]), past, int(value.shape[3]))
            inputs[node.name] = torch.zeros(1, dtype=value.dtype).expand(shape)
    return inputs
