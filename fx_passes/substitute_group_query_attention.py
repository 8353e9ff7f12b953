"""Replace each layer's attention (cache concat, KV-head repetition, mask, attention) with one
``genai_exporter::group_query_attention`` marker, lowered to ONNX Runtime's GroupQueryAttention;
a layer it cannot take (a mask it cannot build, such as chunked attention) keeps its own.

Found from the graph, not from model names: each attention core (SDPA or the eager soft-capped
chain, see ``attention_cores``) is traced back to the ``cat([past, new])`` its keys and values
come from. The first core to read a cache owns it: its marker takes the new K/V and the past
input, and its present K/V replace the concat as graph outputs. A later core reading the same
cache (Gemma 4's KV-shared layers) gets empty new K/V and the owner's present as its past, the
form ONNX Runtime 1.32 computes correctly (``tests/fx_passes/test_gqa_reference_kernel.py``); its
present, which nobody reads, is left out of the ONNX node where the profile says
``omit_unread_presents`` (and on one query per row the ONNX node becomes MatMul/Softmax where it says
``matmul_kv_shared_attention``). Each mask is run on a probe sequence to learn whether it is causal or a
causal sliding window (``mask_probe``); the marker builds that mask itself, so transformers' mask
subgraph becomes dead and is removed.

Padding: GroupQueryAttention reads only each row's count of real tokens, with the cache compact
(ONNX Runtime GenAI pads on the right). Left-padded batches, transformers' own convention, are
not supported by the substituted graph; ONNX Runtime GenAI never sends them.
"""

from __future__ import annotations

import operator

import torch
from torch.export import ExportedProgram
from torch.fx import Graph, Node

import fx_passes.custom_ops.ops  # noqa: F401  (registers the custom ops)
from fx_passes.analyses.attention_cores import AttentionCore, cache_concat, find_attention_cores, heads_output
from fx_passes.analyses.graph_facts import (
    PassDidNotApply,
    evaluate_nodes,
    probe_inputs,
    same_shape,
    set_fake_value,
    user_input,
)
from fx_passes.analyses.mask_probe import causal_window, decode_step_agrees
from fx_passes.analyses.rotary import Rotary, match_rotary, rotary_caches
from fx_passes.base import Settings, add_parameter

_aten = torch.ops.aten
_GQA = torch.ops.genai_exporter.group_query_attention.default
_WINDOWED = torch.ops.genai_exporter.window_attention.default
_WINDOW_SLOTS = torch.ops.genai_exporter.sliding_window_slots.default
_ROTARY = torch.ops.genai_exporter.rotary_embedding.default


class SubstituteGroupQueryAttention:
    name = "substitute_group_query_attention"

    def applies(self, settings, session) -> str | None:
        if not session.is_decoder or not settings.attention_op:
            return None
        return f"{settings.profile.name} runs GroupQueryAttention at {settings.precision}"

    def __call__(self, program: ExportedProgram, settings: Settings, session) -> tuple[ExportedProgram, dict]:
        layout = settings.layout
        cores, unrecognised = _recognised_cores(program, layout)
        if unrecognised:
            # A model this pass was not built for: every layer keeps transformers' attention (a
            # layer whose core was found may share a cache with one whose core was not, and a
            # cache is written and read in one layout), and the report says why.
            plain = {layer: f"its attention was not recognised ({unrecognised})" for layer in range(layout.num_layers)}
            return program, {"layers": layout.num_layers, "kv_shared_layers": 0, "sliding_window_layers": 0,
                             "soft_capped_layers": 0, "attention_sink_layers": 0, "rotary_in_attention_layers": 0,
                             "window_mask_layers": 0,
                             "full_span_layers": 0, "substituted_layers": [], "plain_layers": plain}
        windows = _windows(program, cores, layout)
        graph = program.graph
        kernel = settings.profile.attention_kernel
        # Layers GroupQueryAttention cannot take keep their traced attention, and why.
        plain = _plain_layers(cores, windows, kernel)
        attention_mask = user_input(program, "attention_mask")
        presents: dict[Node, Node] = {}  # a cache's concat -> the present of the marker that owns it
        rotary = None
        if settings.profile.attention_rotary:
            limit = settings.profile.max_buffer_size
            if limit is not None:  # counted at fp32, the caches' widest form
                limit //= 4
            rotary = _RotaryCaches(program, layout.context_length, limit)
        # (window, KV heads, head size, query heads per KV head) -> the slots its layers share
        window_slots: dict[tuple[int, int, int, int], tuple[Node, Node]] = {}
        position_ids = None  # read once, by the first window layer that rotates its queries
        shared = rotated = masked = full_span = 0
        sinks: dict[Node, Node] = {}  # a core's sink logits -> them as [heads], made once
        for core, window in zip(cores, windows, strict=True):
            key_cat, value_cat = cache_concat(core.key), cache_concat(core.value)
            if core.layer in plain:
                continue
            # Where the EP's GroupQueryAttention would drop what this layer computes, it still writes
            # the cache (owners), but the attention itself reads the buffer's slots in the graph.
            graph_window = _graph_window(core, window, kernel, settings.context_length)
            owner = key_cat not in presents
            heads = int(core.query.meta["val"].shape[1])
            kv_heads, head = (int(d) for d in key_cat.meta["val"].shape[1::2])
            new_key = key_cat.args[0][1] if owner else None
            query_rotary = key_rotary = None
            caches = ()
            if rotary is not None:
                query_rotary, key_rotary = _rotary_of(core.query), _rotary_of(new_key) if owner else None
                caches = rotary.caches_for(query_rotary, key_rotary, owner)
                if caches:
                    rotated += 1
                else:
                    query_rotary = key_rotary = None
            with graph.inserting_before(core.output):
                sink = () if core.sink is None else (_heads_vector(graph, core.sink, heads, sinks),)
                query = _heads_last(graph, core.query, query_rotary)
                if owner:
                    key = _heads_last(graph, new_key, key_rotary)
                    value = _heads_last(graph, value_cat.args[0][1])
                    past_key, past_value = key_cat.args[0][0], value_cat.args[0][0]
                    if graph_window:  # only the cache it writes is read: its attention, one head per KV head
                        marker = _call(graph, _GQA, key, key, value, past_key, past_value, attention_mask,
                                       kv_heads, kv_heads, core.scale, core.softcap, 0, *caches)
                    else:
                        marker = _call(graph, _GQA, query, key, value, past_key, past_value, attention_mask,
                                       heads, kv_heads, core.scale, core.softcap, window, *_rotary_args(caches, sink), *sink)
                    output, present_key, present_value = (_call(graph, operator.getitem, marker, i) for i in range(3))
                else:
                    present_key, present_value = presents[key_cat], presents[value_cat]
                    shared += 1
                    if not graph_window:
                        empty = _no_tokens(graph, query, kv_heads * head)
                        marker = _call(graph, _GQA, query, empty, empty, present_key, present_value, attention_mask,
                                       heads, kv_heads, core.scale, core.softcap, window, *_rotary_args(caches, sink), *sink)
                        output = _call(graph, operator.getitem, marker, 0)
                if graph_window:
                    if caches:  # the window attention takes its queries rotated, by one ONNX Runtime kernel
                        position_ids = position_ids or user_input(program, "position_ids")
                        query = _call(graph, _ROTARY, query, position_ids, *caches, heads)
                    shape = (graph_window, kv_heads, head, heads // kv_heads)
                    if shape not in window_slots:  # the first such layer's query gives the shape
                        slots = _call(graph, _WINDOW_SLOTS, query, attention_mask, *shape)
                        window_slots[shape] = tuple(_call(graph, operator.getitem, slots, i) for i in range(2))
                    output = _call(graph, _WINDOWED, query, present_key, present_value, *window_slots[shape],
                                   heads, core.scale, core.softcap, *sink)
                    masked += 1
                    full_span += graph_window != window
            if owner:
                for concat, present in ((key_cat, present_key), (value_cat, present_value)):
                    concat.replace_all_uses_with(present, delete_user_cb=lambda user: user.op == "output")
                    presents[concat] = present
            _replace_output(graph, core, output)
        graph.eliminate_dead_code()
        graph.lint()
        program.graph_module.recompile()
        # One attention per layer, plus the cache-writing GroupQueryAttention of each owner whose
        # attention reads its window's slots of the buffer.
        expected = layout.num_layers - len(plain) + sum(
            1 for n in graph.nodes if n.target is _GQA and not _output_read(n))
        if sum(n.target in (_GQA, _WINDOWED) for n in graph.nodes) != expected or masked != sum(
                n.target is _WINDOWED for n in graph.nodes):
            raise PassDidNotApply(f"{self.name}: the rewritten graph lost an attention")
        return program, {
            "layers": len(cores),
            "kv_shared_layers": shared,
            "sliding_window_layers": sum(1 for w in windows if isinstance(w, int) and w),
            "soft_capped_layers": sum(1 for c in cores if c.softcap),
            "attention_sink_layers": sum(1 for c in cores if c.sink is not None and c.layer not in plain),
            "rotary_in_attention_layers": rotated,
            "window_mask_layers": masked,
            "full_span_layers": full_span,
            "substituted_layers": [c.layer for c in cores if c.layer not in plain],
            "plain_layers": plain,
        }

    def findings(self, changes: dict) -> dict:
        """What the plan's settings take from this pass (``ExportSettings.with_findings``): the
        layers it left with transformers' attention, each with why."""
        return {"plain_attention_layers": changes["plain_layers"]} if changes.get("plain_layers") else {}

    def note(self, changes: dict) -> str | None:
        notes = []
        if changes.get("plain_layers"):
            notes.append(f"{len(changes['plain_layers'])} of {changes['layers']} layers keep transformers' attention, "
                         f"not GroupQueryAttention ({describe_plain_layers(changes['plain_layers'])}); past and "
                         "present KV are separate buffers")
        if changes.get("full_span_layers"):
            notes.append(f"{changes['full_span_layers']} full-attention layers attend in the graph over every slot of "
                         "the KV buffer (max_length of them) at each step: the EP's GroupQueryAttention would not "
                         "compute them as the model does (a softcap it drops, or more query rows than it is exact for)")
        return "; ".join(notes) or None


def _recognised_cores(program: ExportedProgram, layout) -> tuple[list[AttentionCore], str | None]:
    """One attention core per decoder layer, each reading a KV cache built as ``cat([past, new])``;
    or why not (a core of another form, a cache of another layout, a layer without a core)."""
    try:
        cores = find_attention_cores(program)
        for core in cores:
            cache_concat(core.key), cache_concat(core.value)
    except PassDidNotApply as error:
        return [], str(error)
    if len(cores) != layout.num_layers:
        return [], (f"found {len(cores)} attention cores (scaled_dot_product_attention or matmul-softmax-matmul) "
                    f"for {layout.num_layers} decoder layers")
    # A core's layer index is read from a ``layers.N`` module path; a family whose blocks are named
    # otherwise (``h.N``) has none, and its cores are taken in graph order as before.
    known = [c.layer for c in cores if c.layer is not None]
    if len(set(known)) != len(known):
        return [], f"two attention cores in one decoder layer (layers {sorted(known)})"
    return cores, None


def _graph_window(core: AttentionCore, window: int, kernel, slots: int) -> int:
    """The window a layer attends through in the graph (``window_attention`` over the KV buffer's
    slots), 0 where the EP's GroupQueryAttention computes the layer as it is. A full-attention
    layer that must attend in the graph gets a window of every slot of the buffer (``slots``, the
    positions GenAI allocates): exact, at the cost of reading them all at every step."""
    keeps = ((window == 0 or kernel.window_in_every_call) and (not core.softcap or kernel.softcap)
             and kernel.exact_query_rows is None)
    return 0 if keeps else window or slots


def describe_plain_layers(plain: dict) -> str:
    """``{layer: why}`` as "layers 0, 1, 2: why; layer 5: why", one entry per reason."""
    by_reason: dict[str, list[str]] = {}
    for layer, why in plain.items():
        by_reason.setdefault(why, []).append(str(layer))
    return "; ".join(f"layer{'s' if len(layers) > 1 else ''} {', '.join(layers)}: {why}"
                     for why, layers in by_reason.items())


def _plain_layers(cores: list[AttentionCore], windows: list[int | str], kernel) -> dict[int, str]:
    """{layer: why} for the layers GroupQueryAttention cannot take. A KV cache is written and read
    in one layout: GroupQueryAttention's (each row's real tokens first) or transformers' (where the
    mask says). So every layer sharing a cache with a plain layer (its owner, or a KV-shared reader)
    stays plain too."""
    caches = [(cache_concat(core.key), cache_concat(core.value)) for core in cores]
    first_reader: dict[Node, int] = {}
    for index, concats in enumerate(caches):
        for concat in concats:
            first_reader.setdefault(concat, index)
    plain: dict[int, str] = {}
    for index, (core, window, (key_cat, value_cat)) in enumerate(zip(cores, windows, caches, strict=True)):
        heads = int(core.query.meta["val"].shape[1])
        kv_heads, head = (int(d) for d in key_cat.meta["val"].shape[1::2])
        if isinstance(window, str):
            plain[index] = window
        elif first_reader[key_cat] != first_reader[value_cat]:
            plain[index] = "it reads one layer's keys and another's values"
        elif heads % kv_heads or int(value_cat.meta["val"].shape[3]) != head:
            plain[index] = f"{heads} query heads over {kv_heads} KV heads, or value and key head sizes differ"
        elif core.sink is not None and not kernel.head_sink:
            plain[index] = "the EP's GroupQueryAttention drops its attention sinks (head_sink)"
    spreading = True
    while spreading:
        spreading = False
        by_cache = {concat: index for index in plain for concat in caches[index]}
        for index, concats in enumerate(caches):
            source = next((by_cache[c] for c in concats if c in by_cache), None)
            if index not in plain and source is not None:
                plain[index] = f"it shares its KV cache with layer {cores[source].layer}, which keeps plain attention"
                spreading = True
    return {cores[index].layer: why for index, why in sorted(plain.items())}


def _rotary_args(caches: tuple, sink: tuple) -> tuple:
    """The marker's cos/sin cache arguments, written out (None) where a sink follows them."""
    return caches or ((None, None) if sink else ())


def _heads_vector(graph: Graph, sink: Node, heads: int, made: dict[Node, Node]) -> Node:
    """A core's sink logits as the [heads] vector GroupQueryAttention's ``head_sink`` takes."""
    if sink not in made:
        made[sink] = sink if tuple(sink.meta["val"].shape) == (heads,) else _call(
            graph, _aten.reshape.default, sink, [heads])
    return made[sink]


def _output_read(marker: Node) -> bool:
    """Whether a GroupQueryAttention's attention output (item 0) has readers."""
    return any(user.args[1] == 0 and user.users for user in marker.users)


def _call(graph: Graph, target, *args, **kwargs) -> Node:
    node = graph.call_function(target, args, kwargs)
    set_fake_value(node)
    return node


class _RotaryCaches:
    """GroupQueryAttention's cos/sin caches, one pair per distinct rotary table of the model
    (Gemma 4 has two: sliding and full layers), added to the program as weights."""

    def __init__(self, program: ExportedProgram, max_positions: int, max_elements: int | None):
        self.program, self.max_positions, self.max_elements = program, max_positions, max_elements
        self.by_table: dict[tuple[Node, Node], tuple[Node, Node] | None] = {}
        self.made: list[tuple[tuple[torch.Tensor, torch.Tensor], tuple[Node, Node]]] = []

    def caches_for(self, query: Rotary | None, key: Rotary | None, owner: bool) -> tuple[Node, Node] | tuple[()]:
        if query is None or (owner and (key is None or (key.cos, key.sin) != (query.cos, query.sin))):
            return ()
        if int(query.unrotated.meta["val"].shape[-1]) % 16:
            return ()  # ONNX Runtime 1.32 rotates only head sizes that are multiples of 16
        table = (query.cos, query.sin)
        if table not in self.by_table:
            self.by_table[table] = self._caches(query)
        return self.by_table[table] or ()

    def _caches(self, rotary: Rotary) -> tuple[Node, Node] | None:
        tensors = rotary_caches(self.program, rotary, self.max_positions)
        if tensors is None or (self.max_elements is not None and tensors[0].numel() > self.max_elements):
            return None  # not rotate_half form, or a cache over the profile's buffer limit
        for made, nodes in self.made:  # layers often slice the same table separately
            if all(torch.equal(a, b) for a, b in zip(made, tensors, strict=True)):
                return nodes
        # GroupQueryAttention takes its caches in the query's dtype.
        dtype = rotary.unrotated.meta["val"].dtype
        nodes = tuple(add_parameter(self.program, f"rotary_{len(self.made)}.{name}_cache", tensor.to(dtype))
                      for name, tensor in zip(("cos", "sin"), tensors, strict=True))
        self.made.append((tensors, nodes))
        return nodes


def _is_heads_transpose(node: Node) -> bool:
    return node.target is _aten.transpose.int and sorted(node.args[1:]) == [1, 2]


def _rotary_of(node: Node) -> Rotary | None:
    """The rotation producing ``node`` [batch, heads, seq, head], applied in that layout or before
    the transpose to it."""
    return match_rotary(node.args[0] if _is_heads_transpose(node) else node)


def _heads_last(graph: Graph, node: Node, rotary: Rotary | None = None) -> Node:
    """``node`` [batch, heads, seq, head] as [batch, seq, heads * head], taken from before its
    rotation when ``rotary`` is given, and from the projection output it was viewed and
    transposed from where there is one."""
    if _is_heads_transpose(node):
        source = rotary.unrotated if rotary else node.args[0]  # [batch, seq, heads, head]
        flat = source.args[0] if source.target in (_aten.view.default, _aten.reshape.default) else None
        if flat is not None and same_shape(flat.meta["val"].shape, (*source.meta["val"].shape[:2], _width(source))):
            return flat
        return _call(graph, _aten.flatten.using_ints, source, 2, 3)
    source = rotary.unrotated if rotary else node
    return _call(graph, _aten.flatten.using_ints, _call(graph, _aten.transpose.int, source, 1, 2), 2, 3)


def _width(node: Node) -> int:
    shape = node.meta["val"].shape
    return int(shape[-2]) * int(shape[-1])


def _no_tokens(graph: Graph, query: Node, width: int) -> Node:
    """Empty new keys/values [batch, 0, width] for a layer that reads another layer's cache."""
    return _call(graph, _aten.slice.Tensor, _call(graph, _aten.slice.Tensor, query, 1, 0, 0), 2, 0, width)


def _replace_output(graph: Graph, core: AttentionCore, output: Node) -> None:
    """Give the core's readers the marker's [batch, seq, heads * head] output, skipping
    transformers' transpose/reshape back to that layout where it follows the core."""
    target, chain = heads_output(core)
    if chain:
        target.replace_all_uses_with(output)
    else:
        heads, head = (int(d) for d in core.output.meta["val"].shape[1::2])
        with graph.inserting_after(output):
            split = _call(graph, _aten.unflatten.int, output, 2, [heads, head])
        with graph.inserting_after(split):
            restored = _call(graph, _aten.transpose.int, split, 1, 2)
        core.output.replace_all_uses_with(restored)
    for node in [*reversed(chain), *reversed(core.nodes)]:
        if not node.users:
            graph.erase_node(node)


def _windows(program: ExportedProgram, cores: list[AttentionCore], layout) -> list[int | str]:
    """Each core's sliding window (0: none), read off its mask on a prompt longer than the window
    the config declares (a window of at least the context length never takes effect), then
    checked on one decode step at the end of the context (a wider window or chunking shows there);
    for a mask GroupQueryAttention cannot build (chunked attention, a bias), why not."""
    masks = list(dict.fromkeys(c.mask for c in cores if c.mask is not None))
    if not masks:
        return [0 if core.is_causal else "its attention has no mask and is not causal" for core in cores]
    context = layout.context_length
    declared = layout.sliding_window if layout.sliding_window and layout.sliding_window < context else 8
    prompt = evaluate_nodes(program, masks, probe_inputs(program, min(2 * declared + 1, context)))
    last_step = evaluate_nodes(program, masks, probe_inputs(program, 1, past=context - 1))
    window_of: dict[Node, int | str] = {}
    for mask, value, step in zip(masks, prompt, last_step, strict=True):
        try:
            window_of[mask] = causal_window(value, mask.name)
            decode_step_agrees(step, window_of[mask], mask.name)
        except PassDidNotApply as error:
            window_of[mask] = str(error)
    return [window_of[c.mask] if c.mask is not None else (0 if c.is_causal else "its attention has no mask and is "
                                                             "not causal") for c in cores]
