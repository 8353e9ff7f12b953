"""Trace each distinct decoder layer once: a layer built like an earlier one is a stand-in op while
torch.export traces, and is then filled in with a copy of that earlier layer's traced nodes.

Tracing runs every op of every layer through torch.export's fake tensors and symbolic shapes
(about 70% of a 35-layer Gemma 4 trace); copying a layer's nodes costs a small fraction of that.

- **Same structure**: the same classes, weight names, shapes and dtypes, and every attribute of
  the layer and its submodules (``layer_idx`` aside): numbers and strings by value, anything else
  (the config, an instance ``forward``) by identity, so the same code path.
- **The first layer of a structure** is traced as it is, its inputs and outputs passed through
  boundary ops: every tensor of its arguments, its own cache entry's keys and values, what it
  returns and what it writes to its cache entry.
- **A later layer** calls ``layer_stand_in`` on the same tensors (its other arguments must be the
  same objects or values), which gives outputs shaped like the first layer's; its cache entry is
  set from them as the first layer's was.
- **``expand``** then copies the first layer's nodes in place of each stand-in: its arguments
  become the stand-in's, its weights the later layer's (same names under the later layer's path),
  anything else it read outside itself the same node (the masks, rotary tables and, for a
  KV-shared layer, the owner's keys and values, which every later layer of that structure reads
  too).

Only transformers' own layer classes whose replicated graph the tests compare with a full trace are
replicated (``REPLICATED_CLASSES``): a layer whose forward branched on ``layer_idx`` itself would
copy wrongly, and no check of the traced graph can see that. Every layer is traced instead where a
layer or its modules have forward hooks (one on a stand-in would never run, one on a first layer
would be copied); where another thread traces the same model (there its layers run their own
forward); where a first layer is called with a container other than a tuple (a write into it
would be lost); where a later layer's call, sizes or cache entry differ from its first layer's;
and where ``expand`` finds the first layer's nodes read outside it other than through its output
boundaries (a value it wrote into an object another layer reads) or reading a graph input other
than through its input boundaries (a lifted constant, which only the traced layer's program
holds). The trace's program meta says how many layers were copied, or why none were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import re
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import Node
from torch.utils import _pytree as pytree

from fx_passes.base import outputs_named_as_in_graph

# Decoder layer classes whose replicated graph the tests compare with a full trace
# (tests/exporter/trace/test_layer_replicas.py).
REPLICATED_CLASSES = frozenset({
    "CohereDecoderLayer", "Gemma2DecoderLayer", "Gemma4TextDecoderLayer", "GPTNeoXLayer", "GraniteDecoderLayer",
    "LlamaDecoderLayer", "MistralDecoderLayer", "Phi3DecoderLayer", "PhiDecoderLayer", "Qwen3DecoderLayer",
    "SmolLM3DecoderLayer",
})
_INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_index"})
_PLAIN = (bool, int, float, str, type(None))

_TEMPLATES: dict[tuple[int, int], list[torch.Tensor]] = {}  # (trace id, first layer) -> its outputs' fake values


@torch.library.custom_op("genai_exporter::layer_boundary", mutates_args=())
def layer_boundary(value: torch.Tensor, position: int, output: bool) -> torch.Tensor:
    """Marks a traced layer's input or output; ``expand`` erases it."""
    return value.clone()


@layer_boundary.register_fake
def _(value, position, output):
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)


@torch.library.custom_op("genai_exporter::layer_stand_in", mutates_args=())
def layer_stand_in(inputs: list[torch.Tensor], trace_id: int, first: int, layer: int) -> list[torch.Tensor]:
    """Stands for layer ``layer`` while tracing; ``expand`` replaces it with a copy of ``first``."""
    raise RuntimeError("layer_stand_in only exists while tracing")


@layer_stand_in.register_fake
def _(inputs, trace_id, first, layer):
    return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            for t in _TEMPLATES[(trace_id, first)]]


@dataclasses.dataclass
class _Traced:
    """What the first layer of a structure read and wrote."""

    inputs: list = dataclasses.field(default_factory=list)  # the tensors it read, in boundary order
    arguments: Any = None  # the pytree spec of its arguments
    result: Any = None  # the pytree spec of what it returned
    others: list = dataclasses.field(default_factory=list)  # its arguments that are not tensors
    cache_writes: tuple[str, ...] = ()  # its own cache entry's fields it replaced ("keys", "values")


@dataclasses.dataclass
class Replicas:
    """The trace's layers: which layer each stands in for, and where the layers live in the program."""

    trace_id: int
    layers_path: str  # the decoder layers' module path in the traced module
    first_of: dict[int, int]  # layer -> the first layer of its structure (itself for a first)
    traced: dict[int, _Traced] = dataclasses.field(default_factory=dict)

    @property
    def stand_ins(self) -> int:
        return sum(first != layer for layer, first in self.first_of.items())


@contextlib.contextmanager
def stand_ins(wrapper: torch.nn.Module, cache_of) -> Iterator[Replicas | str | None]:
    """While tracing ``wrapper``, every decoder layer built like an earlier one is a stand-in.
    ``cache_of(layer_index)``: the trace's cache entry of a layer (an object with ``keys`` and
    ``values``), or None. Yields None where no layer repeats a replicated class, and why not where
    one does but no layer can stand in."""
    found = _decoder_layers(wrapper)
    if found is None:
        yield None
        return
    layers_path, layers = found
    with _PATCHING:
        busy = id(layers) in _PATCHED_LAYERS
        _PATCHED_LAYERS.add(id(layers))
    if busy:  # its layers' forwards are the other trace's stand-ins, which run the layers' own here
        yield "another thread is tracing the same model"
        return
    try:
        first_of = _first_of_structure(layers)
        if all(first == index for index, first in first_of.items()):
            yield None
        elif _hooked(layers):
            yield "a decoder layer or one of its modules has a forward hook"
        else:
            with _stand_ins(Replicas(trace_id=id(wrapper), layers_path=layers_path, first_of=first_of),
                            layers, cache_of) as replicas:
                yield replicas
    finally:
        with _PATCHING:
            _PATCHED_LAYERS.discard(id(layers))


_PATCHING = threading.Lock()
_PATCHED_LAYERS: set[int] = set()  # the layer lists a trace has stand-ins in


def _first_of_structure(layers: torch.nn.ModuleList) -> dict[int, int]:
    """Each layer's first layer of the same structure (itself where no earlier one is like it, or
    its class is not replicated)."""
    first_of, firsts = {}, {}
    for index, layer in enumerate(layers):
        first_of[index] = firsts.setdefault(_structure(layer), index) if _replicated_class(type(layer)) else index
    return first_of


@contextlib.contextmanager
def _stand_ins(replicas: Replicas, layers: torch.nn.ModuleList, cache_of) -> Iterator[Replicas]:
    first_of = replicas.first_of
    repeated = {first for index, first in first_of.items() if first != index}
    patched = [index for index, first in first_of.items() if first in repeated]
    own_forwards = {index: vars(layers[index]).get("forward") for index in patched}  # accelerate sets one
    for index in patched:
        layer = layers[index]
        layer.forward = _stand_in_forward(replicas, index, layer.forward, cache_of)
    try:
        yield replicas
    finally:
        for index, forward in own_forwards.items():
            del layers[index].forward
            if forward is not None:
                layers[index].forward = forward
        for key in [k for k in _TEMPLATES if k[0] == replicas.trace_id]:
            del _TEMPLATES[key]


def _holds_mutable_container(spec) -> bool:
    """Whether an argument's pytree holds a container other than a tuple (a list, a dict, a
    ``ModelOutput``, a dataclass), which pytree would rebuild."""
    if spec.type is not None and not issubclass(spec.type, tuple):
        return True
    return any(_holds_mutable_container(child) for child in spec.children())


def _hooked(layers: torch.nn.ModuleList) -> bool:
    """Whether a hook may change what a layer computes: one on a stand-in's modules would never
    run, and one on a first layer's would be copied to the others."""
    from torch.nn.modules import module as modules

    global_hooks = (modules._global_forward_hooks, modules._global_forward_pre_hooks)
    return any(global_hooks) or any(
        m._forward_hooks or m._forward_pre_hooks for layer in layers for m in layer.modules())


def _decoder_layers(wrapper: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    """The decoder's layer list: the longest ModuleList whose entries are all of one class."""
    best = None
    for path, module in wrapper.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1 \
                and len({type(m) for m in module}) == 1 and (best is None or len(module) > len(best[1])):
            best = (path, module)
    return best


def _replicated_class(cls: type) -> bool:
    """One of transformers' own classes the tests compare (a remote-code class of the same name
    is not)."""
    return cls.__name__ in REPLICATED_CLASSES and cls.__module__.startswith("transformers.models.")


def _structure(layer: torch.nn.Module) -> tuple:
    """What two layers must share to be traced as one: their modules' classes, their attributes
    (plain values by value, anything else, such as the config or an instance ``forward``, by
    identity) and their weights' names, shapes and dtypes."""
    modules = []
    for path, module in layer.named_modules():
        attributes = tuple(sorted(
            (name, _plain(value)) for name, value in vars(module).items()
            if not name.startswith("_") and name not in _INDEX_ATTRIBUTES and not isinstance(value, torch.nn.Module)))
        modules.append((path, type(module).__qualname__, type(module).__module__, attributes))
    weights = tuple((name, tuple(t.shape), t.dtype) for name, t in
                    [*layer.named_parameters(), *layer.named_buffers()])
    return tuple(modules), weights


def _plain(value):
    """An attribute as the structure compares it: numbers, strings and None by value, tuples,
    lists, dicts and ``functools.partial`` item by item, anything else by identity."""
    if isinstance(value, _PLAIN):
        return type(value).__name__, value
    if isinstance(value, (tuple, list)):
        return type(value).__name__, tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return "dict", tuple(sorted((repr(k), _plain(v)) for k, v in value.items()))
    if isinstance(value, functools.partial):  # transformers' activations hold one each
        return "partial", id(value.func), _plain(value.args), _plain(value.keywords)
    return "object", id(value)


def _stand_in_forward(replicas: Replicas, index: int, forward, cache_of):
    first = replicas.first_of[index]
    tracing_thread = threading.get_ident()

    def traced_first(*args, **kwargs):
        if threading.get_ident() != tracing_thread:  # another thread's trace of the same model
            return forward(*args, **kwargs)
        if index in replicas.traced:
            raise NotReplicable(f"layer {index} runs twice")
        record = _Traced()
        leaves, record.arguments = pytree.tree_flatten((args, kwargs))
        if any(_holds_mutable_container(argument) for call_level in record.arguments.children()
               for argument in call_level.children()):
            # its tensors are passed on in a rebuilt container, where a write would be lost
            raise NotReplicable(f"layer {index} is called with a list, dict or other mutable container")
        position = 0
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                record.inputs.append(leaf)
                leaves[k] = layer_boundary(leaf, position, False)
                position += 1
            else:
                record.others.append(leaf)
        entry = cache_of(index)
        if entry is not None:
            for field in ("keys", "values"):
                record.inputs.append(getattr(entry, field))
                setattr(entry, field, layer_boundary(getattr(entry, field), position, False))
                position += 1
        args, kwargs = pytree.tree_unflatten(leaves, record.arguments)
        before_entry = None if entry is None else (entry.keys, entry.values)
        result = forward(*args, **kwargs)
        outputs = []

        def boundary(value):
            marked = layer_boundary(value, len(outputs), True)
            outputs.append(marked)
            return marked

        flat, record.result = pytree.tree_flatten(result)
        if not all(isinstance(v, torch.Tensor) for v in flat):
            raise NotReplicable(f"layer {index} returns something other than tensors")
        result = pytree.tree_unflatten([boundary(v) for v in flat], record.result)
        if entry is not None:
            written = [f for f, old in zip(("keys", "values"), before_entry, strict=True) if getattr(entry, f) is not old]
            for field in written:
                setattr(entry, field, boundary(getattr(entry, field)))
            record.cache_writes = tuple(written)
        replicas.traced[index] = record
        _TEMPLATES[(replicas.trace_id, index)] = outputs
        return result

    def stand_in(*args, **kwargs):
        if threading.get_ident() != tracing_thread:
            return forward(*args, **kwargs)
        if first not in replicas.traced:
            raise NotReplicable(f"layer {index} runs before layer {first}")
        record = replicas.traced[first]
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != record.arguments:
            raise NotReplicable(f"layer {index} is called with other arguments than layer {first}")
        inputs = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        others = [leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)]
        if not all(mine is theirs or (type(mine) is type(theirs) and isinstance(mine, _PLAIN) and mine == theirs)
                   for mine, theirs in zip(others, record.others, strict=True)):
            raise NotReplicable(f"layer {index} is called with other arguments than layer {first}")
        entry = cache_of(index)
        if entry is not None:
            inputs += [entry.keys, entry.values]
        if len(inputs) != len(record.inputs):
            raise NotReplicable(f"layer {index} reads {len(inputs)} tensors, layer {first} {len(record.inputs)}")
        for mine, theirs in zip(inputs, record.inputs, strict=True):
            if mine.dtype != theirs.dtype or mine.dim() != theirs.dim():
                raise NotReplicable(f"layer {index} reads tensors of other dtypes or ranks than layer {first}")
            for own, other in zip(mine.shape, theirs.shape, strict=True):
                # The copied nodes' recorded shapes are the first layer's: its inputs' sizes are
                # this layer's. A full trace relates most of them to other sizes too (a past key's
                # length to the mask's), but not all: a past value's length then shares the first
                # layer's symbol where a full trace gives it its own.
                try:
                    torch._check(own == other)
                except RuntimeError as error:  # sizes that differ: this layer is not like the first
                    raise NotReplicable(f"layer {index} reads other sizes than layer {first}") from error
        outputs = list(layer_stand_in(inputs, replicas.trace_id, first, index))
        taken = record.result.num_leaves
        result = pytree.tree_unflatten(outputs[:taken], record.result)
        if record.cache_writes:
            if entry is None:
                raise NotReplicable(f"layer {index} has no cache entry, layer {first} writes its own")
            for field in record.cache_writes:
                setattr(entry, field, outputs[taken])
                taken += 1
        return result

    return traced_first if first == index else stand_in


class NotReplicable(Exception):
    """A layer the replication cannot stand in for; the export traces every layer instead."""


def expand(program: ExportedProgram, replicas: Replicas) -> str | None:
    """Replace every stand-in with a copy of its first layer's nodes, and erase the boundaries.
    Returns why not, or raises ``NotReplicable``, where a first layer's nodes cannot stand for a
    later layer's; the program may then be partly rewritten: trace again."""
    graph = program.graph
    signature = program.graph_signature
    weights = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}  # placeholder -> name
    placeholder_of = {target: name for name, target in weights.items()}
    nodes_by_name = {n.name: n for n in graph.nodes}
    weight_names = {nodes_by_name[name]: target for name, target in weights.items()}
    layer_nodes = _nodes_by_layer(graph, replicas.layers_path)
    firsts = sorted(set(replicas.first_of.values()) & set(replicas.traced))
    bodies = {}
    for first in firsts:
        body = layer_nodes.get(first, [])
        reason = _unsafe_to_copy(body, first, weight_names)
        if reason:
            return reason
        bodies[first] = body
    stand_in_nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is _STAND_IN]
    for stand_in in stand_in_nodes:
        _, _, first, layer = stand_in.args
        if first not in bodies:
            return f"layer {first} was not traced"
        old_prefix = f"{replicas.layers_path}.{first}."
        new_prefix = f"{replicas.layers_path}.{layer}."
        mapped: dict[Node, Node] = {}
        outputs: dict[int, Node] = {}
        inputs = stand_in.args[0]

        def argument(node: Node) -> Node:
            if node in mapped:
                return mapped[node]
            if node in weight_names and weight_names[node].startswith(old_prefix):
                name = new_prefix + weight_names[node][len(old_prefix):]
                if name not in placeholder_of:  # a weight the program holds once for several layers
                    raise NotReplicable(f"layer {layer} has no weight {name} of its own")
                return nodes_by_name[placeholder_of[name]]
            return node

        with graph.inserting_before(stand_in):
            for node in bodies[first]:
                if node.target is _BOUNDARY and not node.args[2]:
                    mapped[node] = inputs[node.args[1]]
                    continue
                copy = graph.node_copy(node, argument)
                copy.meta = {**node.meta, "nn_module_stack": _restacked(node.meta.get("nn_module_stack"),
                                                                        replicas.layers_path, first, layer)}
                mapped[node] = copy
                if node.target is _BOUNDARY:
                    outputs[node.args[1]] = copy
        for user in list(stand_in.users):
            if user.target is not _GETITEM:
                return f"layer {layer}'s stand-in is read whole"  # never: the trace unpacks its list
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(stand_in)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _BOUNDARY:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    graph.lint()
    outputs_named_as_in_graph(program)
    program.graph_module.recompile()
    return None


_BOUNDARY = torch.ops.genai_exporter.layer_boundary.default
_STAND_IN = torch.ops.genai_exporter.layer_stand_in.default
_GETITEM = operator.getitem


def _nodes_by_layer(graph, layers_path: str) -> dict[int, list[Node]]:
    """Each decoder layer's call nodes, in graph order (by the innermost layer in its module stack)."""
    pattern = re.compile(re.escape(layers_path) + r"\.(\d+)$")
    found: dict[int, list[Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for path, _ in reversed(list(node.meta.get("nn_module_stack", {}).values())):
            if (match := pattern.fullmatch(path)):
                found.setdefault(int(match.group(1)), []).append(node)
                break
    return found


def _unsafe_to_copy(body: list[Node], first: int, weight_names: dict) -> str | None:
    """Why a first layer's nodes cannot stand for another's: a node read outside the layer other
    than through an output boundary, or a graph input (past keys and values) read other than
    through an input boundary."""
    members = set(body)
    for node in body:
        for user in node.users:
            if user not in members and node.target is not _BOUNDARY:
                return f"layer {first}'s {node.name} is read outside it other than through its outputs"
        if node.target is _BOUNDARY and not node.args[2]:
            continue
        for read in node.all_input_nodes:
            if read.op == "placeholder" and read not in weight_names:
                return f"layer {first} reads graph input {read.name} directly"
    return None


def _restacked(stack: dict | None, layers_path: str, first: int, layer: int) -> dict | None:
    """A copied node's module stack, naming its own layer's modules."""
    if stack is None:
        return None
    old = re.compile(re.escape(f"{layers_path}.{first}") + r"(?=\.|$)")
    new = f"{layers_path}.{layer}"
    return {old.sub(new, key): (old.sub(new, path), kind) for key, (path, kind) in stack.items()}
