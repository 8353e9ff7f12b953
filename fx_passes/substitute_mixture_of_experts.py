"""Replace routed-experts blocks with ONNX Runtime's MoE op where the EP runs it.

transformers traces a mixture-of-experts block (its ``batched_mm`` experts, ``exporter.load.experts``)
as: the router's logits, a softmax, the top k, maybe renormalised; then each (token, expert) pair
gathers its expert's whole weight matrices and multiplies them, and the outputs are summed with
their routing weights. Per token that streams k experts' weights through a gather, and prefill
gathers them once per token. ``com.microsoft.MoE`` routes and multiplies inside one kernel.

The pass finds each block from the graph: the nodes traced in one experts module (its 3-D
``gate_up_proj`` and ``down_proj`` read by ``index``), the top-k that picks its experts, and the
softmax over the logits before it. It then checks that the block computes what the MoE op computes
(``ops.mixture_of_experts``, the reference kernel) by running both on random weights and
inputs, with and without renormalisation, with its weights as stored or transposed ([experts, in,
out], gpt-oss's), and substitutes the one that matches. The experts' biases and the gating's
constants (gpt-oss: gate and up rows interleaved, ``gate * sigmoid(1.702 * gate) * (up + 1)`` with
both clamped) are read off the block and checked by the same probe. Routing may be a softmax's
top k, or the softmax of the logits' top k (gpt-oss), which is the same renormalised. A block whose
routing or experts differ (Gemma 4's per-expert scales and GELU-gated experts) stays as traced,
and the report says which and why.
"""

from __future__ import annotations

import operator

import sympy
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Node

from exporter.int4_options import Int4Options
from fx_passes.analyses.graph_facts import layer_index, probe_inputs
from fx_passes.base import Settings
from fx_passes.custom_ops import ops  # registers the custom ops; ops.mixture_of_experts is the reference kernel

_aten = torch.ops.aten
_MIXTURE_OF_EXPERTS = torch.ops.genai_exporter.mixture_of_experts.default
_PASS_THROUGH = (_aten.reshape.default, _aten.view.default, _aten._unsafe_view.default, _aten.flatten.using_ints)
_PROBE_TOKENS = 3
# Relative, by the dtype the block was traced in: float32 sums in another order agree to ~1e-6,
# fp16 and bf16 round each product at ~1e-3 and ~4e-3; a different routing, renormalisation or
# activation is off by ~1e-1, and a misplaced clamp by far more on the scaled probe.
_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 3e-2}
_FLOAT32_TOLERANCE = 1e-4


class _Block:
    """One experts module's nodes and what feeds them (its biases: None where it has none)."""

    def __init__(self, path: str, nodes: list[Node], gate_up: Node, down: Node, gate_up_bias: Node | None = None,
                 down_bias: Node | None = None):
        self.path, self.nodes, self.gate_up, self.down = path, nodes, gate_up, down
        self.gate_up_bias, self.down_bias = gate_up_bias, down_bias
        inside = set(nodes)
        self.outputs = [n for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)
                        and any(user not in inside for user in n.users)]
        self.layer = next((i for i in map(layer_index, nodes) if i is not None), None)


class SubstituteMixtureOfExperts:
    name = "substitute_mixture_of_experts"

    def applies(self, settings, session) -> str | None:
        if not session.is_decoder or not settings.layout.experts_modules:
            return None
        if settings.precision not in settings.profile.mixture_of_experts_precisions:
            return None
        return f"{settings.profile.name} runs ONNX Runtime's MoE for SwiGLU-gated experts at {settings.precision}"

    def unplanned_note(self, settings, session) -> str | None:
        """What the report says where a decoder has experts and the pass is not planned."""
        if not session.is_decoder or not settings.layout.experts_modules:
            return None
        return (f"{settings.layout.experts_modules} experts modules stay as traced: {settings.profile.name} at "
                f"{settings.precision} has no MoE op in this exporter; where a router picks experts, each routed "
                "token gathers its experts' whole weight matrices (prefill memory and time grow with prompt length "
                "x experts per token x expert size)")

    def __call__(self, program: ExportedProgram, settings: Settings, session) -> tuple[ExportedProgram, dict]:
        graph = program.graph
        substituted, plain = [], {}
        for block in _experts_blocks(program):
            found = _routing(block)
            if isinstance(found, str):
                plain[block.path] = found
                continue
            hidden, logits, k = found
            form = _matching_form(program, block, hidden, logits, k)
            if form is None:
                plain[block.path] = ("computes something else than softmax top-k routing over SwiGLU-gated experts "
                                     "(checked on random weights)")
                continue
            transposed, normalize, gating = form
            if why := _float_experts_off_the_ep(block, hidden, transposed, settings):
                plain[block.path] = why
                continue
            (output,) = block.outputs
            with graph.inserting_before(output.next):  # new nodes in the order made, after the block
                gate_up, down = block.gate_up, block.down
                if transposed:  # stored [experts, in, out]: the op reads [experts, out, in]
                    gate_up, down = (graph.call_function(_aten.transpose.int, (w, 1, 2)) for w in (gate_up, down))
                    for weight in (gate_up, down):
                        weight.meta["val"] = weight.args[0].meta["val"].transpose(1, 2)
                dtype = hidden.meta["val"].dtype
                if logits.meta["val"].dtype != dtype:  # the op types both alike
                    if logits.target is _aten._to_copy.default and logits.args[0].meta["val"].dtype == dtype:
                        logits = logits.args[0]  # Mixtral's router: logits of hidden's dtype, cast up for the softmax
                    else:  # logits computed in float32: rounded before the op's top k (the probe used them unrounded)
                        logits = graph.call_function(_aten._to_copy.default, (logits,), {"dtype": dtype})
                        logits.meta["val"] = logits.args[0].meta["val"].to(dtype)
                fused = graph.call_function(_MIXTURE_OF_EXPERTS, (hidden, logits, gate_up, down, k, normalize,
                                                                  block.gate_up_bias, block.down_bias, *gating))
            fused.meta = {**output.meta, "val": output.meta["val"]}
            output.replace_all_uses_with(fused)
            _unflattened(graph, fused)
            # The traced block, in-place adds included (dead-code elimination keeps those).
            for node in reversed(block.nodes):
                if not node.users:
                    graph.erase_node(node)
            substituted.append(block.layer if block.layer is not None else block.path)
        if substituted:
            graph.eliminate_dead_code()
            graph.lint()
            program.graph_module.recompile()
        return program, {"experts_modules": settings.layout.experts_modules,
                         "blocks": len(substituted) + len(plain), "substituted_layers": substituted,
                         "plain_blocks": plain}

    def note(self, changes: dict) -> str | None:
        notes = []
        if unrouted := changes["experts_modules"] - changes["blocks"]:
            notes.append(f"{unrouted} experts modules are not gathered by routed expert ids (every expert runs on "
                         "every token, as Llama 4's do): they stay as traced MatMuls")
        if changes["plain_blocks"]:
            reasons = sorted(set(changes["plain_blocks"].values()))
            notes.append(f"{len(changes['plain_blocks'])} of {changes['blocks']} mixture-of-experts blocks stay as "
                         f"traced MatMuls over weights gathered per routed token, not ONNX Runtime's MoE: each "
                         f"{'; or '.join(reasons)}")
        return "; ".join(notes) or None


_VIEWS = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default)


def _unflattened(graph: torch.fx.Graph, fused: Node) -> None:
    """Where the block flattens [batch, seq, hidden] to [tokens, hidden] and reshapes its output
    back, the op takes and gives the 3-D tensor itself (ONNX Runtime's MoE takes either): the
    reshape back reads the batch and sequence sizes, which shape work on the CPU computes, and a
    captured graph cannot have it."""
    flat = fused.args[0]
    if flat.target not in _VIEWS or not isinstance(flat.args[0], Node):
        return
    unflat = flat.args[0]
    if unflat.meta["val"].shape[-1] != flat.meta["val"].shape[-1]:  # only a flatten of the leading dims
        return
    shape = [str(d) for d in unflat.meta["val"].shape]
    backs = list(fused.users)
    if len(shape) != 3 or not backs or any(
            b.target not in _VIEWS or [str(d) for d in b.meta["val"].shape] != shape for b in backs):
        return
    fused.args = (unflat, *fused.args[1:])
    fused.meta["val"] = unflat.meta["val"].new_empty(unflat.meta["val"].shape)
    fused.meta.pop("tensor_meta", None)  # the 2-D block output's
    for back in backs:
        back.replace_all_uses_with(fused)
        graph.erase_node(back)


_FLOAT_PRECISIONS = ("fp32", "fp16", "bf16")


def _float_experts_off_the_ep(block: _Block, hidden: Node, transposed: bool, settings: Settings) -> str | None:
    """Why the block must stay traced on a profile that runs only ``QMoE`` (webgpu: its float
    ``MoE`` runs on the CPU): the int4 block size must divide both expert widths, or
    ``quantize_weights`` leaves the op float. None where the op may be substituted."""
    profile = settings.profile
    if settings.precision != "int4" or any(p in profile.mixture_of_experts_precisions for p in _FLOAT_PRECISIONS):
        return None
    down = block.down.meta["val"].shape
    widths = (int(hidden.meta["val"].shape[-1]), int(down[1] if transposed else down[2]))
    size = (settings.int4 or Int4Options()).block_size
    if all(width % size == 0 for width in widths):
        return None
    return (f"has expert widths {widths} that the int4 block size {size} does not divide, so QMoE cannot take it, "
            f"and {profile.name} runs no float MoE on the EP")


def _experts_blocks(program: ExportedProgram) -> list[_Block]:
    """Every experts module whose stacked gate_up_proj and down_proj the graph indexes by expert."""
    targets = {spec.arg.name: spec.target for spec in program.graph_signature.input_specs
               if spec.kind == InputKind.PARAMETER}
    by_path: dict[str, dict[str, Node]] = {}
    for node in program.graph.nodes:
        if node.target is not _aten.index.Tensor or not isinstance(node.args[0], Node):
            continue
        target = targets.get(node.args[0].name, "")
        for weight in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            if target.endswith("." + weight):
                by_path.setdefault(_innermost_path(node), {})[weight] = node.args[0]
    blocks = []
    for path, weights in by_path.items():
        if not {"gate_up_proj", "down_proj"} <= set(weights):
            continue
        nodes = [n for n in program.graph.nodes if n.op == "call_function" and _within(n, path)]
        blocks.append(_Block(path, nodes, weights["gate_up_proj"], weights["down_proj"],
                             weights.get("gate_up_proj_bias"), weights.get("down_proj_bias")))
    return blocks


def _routing(block: _Block) -> tuple[Node, Node, int] | str:
    """(the experts' input, the router's logits, k), or why the block does not have that form."""
    if len(block.outputs) != 1:
        return f"has {len(block.outputs)} outputs"
    inside = set(block.nodes)
    indexed = [n for n in block.nodes if n.target is _aten.index.Tensor and n.args[0] is block.gate_up]
    if len(indexed) != 1 or not isinstance(indexed[0].args[1][0], Node):
        return "does not gather its experts' weights once by expert id"
    ids = indexed[0].args[1][0]
    while ids in inside and ids.target in _PASS_THROUGH:
        ids = ids.args[0]
    top_k = ids.args[0] if ids.target is operator.getitem and ids.args[1] == 1 else None
    if top_k is None or top_k.target is not _aten.topk.default:
        return "takes expert ids that are not a top-k's indices"
    k, dim, largest = (list(top_k.args[1:4]) + [-1, True])[:3]
    scores = top_k.args[0]
    if dim not in (-1, scores.meta["val"].dim() - 1) or not largest:
        return "routes by something other than the top k of a softmax over the experts"
    if scores.target is _aten.softmax.int:  # a softmax's top k
        logits = scores.args[0]
    elif any(user.target is _aten.softmax.int for user in _top_values(top_k)):  # the softmax of the logits' top k
        logits = scores
    else:
        return "routes by something other than the top k of a softmax over the experts"
    # The experts' input: [tokens, hidden], hidden being the weights' in-width as stored or transposed.
    widths = {int(d) for d in block.gate_up.meta["val"].shape[1:]}
    hidden = [a for n in block.nodes for a in n.all_input_nodes
              if a not in inside and a.op != "placeholder" and isinstance(a.meta.get("val"), torch.Tensor)
              and a.meta["val"].dim() == 2 and a.meta["val"].shape[-1] in widths]
    if len(set(hidden)) != 1:
        return "reads no single [tokens, hidden] input"
    return hidden[0], logits, int(k)


def _top_values(top_k: Node) -> list[Node]:
    """The readers of a top-k's values."""
    return [user for item in top_k.users if item.target is operator.getitem and item.args[1] == 0
            for user in item.users]


def _gating(block: _Block) -> tuple[bool, float, float, float | None] | None:
    """(gate and up rows interleaved, alpha, beta, limit) as the block's nodes write them: rows
    taken by step-2 slices; the constant the gate is scaled by inside its sigmoid; the one added to
    the clamped up half; the clamps' bound. Defaults where absent (SiLU gating). A clamp of another
    form than the op's (the gate from above, the up half both ways, one bound) gives None: the op
    could not compute it. The probe checks the rest."""
    interleaved = any(n.target is _aten.slice.Tensor and len(n.args) > 4 and n.args[4] == 2 for n in block.nodes)
    alpha = next((float(n.args[1]) for n in block.nodes if n.target is _aten.mul.Tensor
                  and isinstance(n.args[1], (int, float)) and any(u.target is _aten.sigmoid.default for u in n.users)),
                 1.0)
    clamps = [n for n in block.nodes if n.target is _aten.clamp.default and n.meta["val"].dtype.is_floating_point]
    limit = None
    if clamps:
        bounds = [(tuple(n.args[1:3]) + (None, None))[:2] for n in clamps]
        from_above = [high for low, high in bounds if low is None]
        if len(clamps) != 2 or len(from_above) != 1 or not isinstance(from_above[0], (int, float)):
            return None
        limit = float(from_above[0])
        if [b for b in bounds if b[0] is not None] != [(-limit, limit)]:
            return None
    beta = next((float(n.args[1]) for n in block.nodes if n.target in (_aten.add.Tensor,)
                 and isinstance(n.args[1], (int, float)) and n.args[0] in clamps), 0.0)
    return interleaved, alpha, beta, limit


def _matching_form(program: ExportedProgram, block: _Block, hidden: Node, logits: Node,
                   k: int) -> tuple[bool, bool, tuple[bool, float, float, float | None]] | None:
    """(weights transposed, routing weights renormalised, the gating ``_gating`` read) with which
    the reference kernel matches the block, or None, on random weights and inputs of the traced
    shapes: inputs of order 1, and again scaled past the clamps' bound (so a clamp placed otherwise
    than the op's shows)."""
    generator = torch.Generator().manual_seed(0)
    probe = probe_inputs(program, length=_PROBE_TOKENS)
    sizes = _symbol_sizes(program, probe)
    given = {hidden: _random(hidden, sizes, generator), logits: _random(logits, sizes, generator)}
    weights = {node: _random(node, sizes, generator) * 0.2 for node in (block.gate_up, block.down)}
    biases = {node: _random(node, sizes, generator) for node in (block.gate_up_bias, block.down_bias) if node is not None}
    gating = _gating(block)
    if gating is None:
        return None
    # Twice: inputs of order 1, and scaled so the projections pass any clamp's bound by far.
    scales = (1.0, 4.0 * gating[3]) if gating[3] else (1.0,)
    wants = []
    try:
        for scale in scales:
            scaled = {**given, hidden: given[hidden] * scale}
            wants.append(_evaluate(block.outputs[0], {**scaled, **weights, **biases}, program, probe, sizes,
                                   generator))
    except _NotEvaluable:
        return None
    for transposed in (False, True):
        gate_up, down = (weights[w].transpose(1, 2) if transposed else weights[w] for w in (block.gate_up, block.down))
        if gate_up.shape[2] != given[hidden].shape[1] or down.shape[1] != wants[0].shape[-1]:
            continue
        for normalize in (True, False):
            if all(_matches(ops.mixture_of_experts(given[hidden] * scale, given[logits], gate_up, down, k, normalize,
                                                   biases.get(block.gate_up_bias), biases.get(block.down_bias),
                                                   *gating), want)
                   for scale, want in zip(scales, wants, strict=True)):
                return transposed, normalize, gating
    return None


def _matches(got: torch.Tensor, want: torch.Tensor) -> bool:
    scale = max(1.0, float(want.abs().max()))  # the scaled probe's outputs are large: relative to them
    tolerance = _TOLERANCE.get(want.dtype, _FLOAT32_TOLERANCE)
    return (got.shape == want.shape and bool(torch.isfinite(got).all()) and bool(torch.isfinite(want).all())
            and torch.allclose(got.float(), want.float(), atol=tolerance * scale, rtol=tolerance))


class _NotEvaluable(Exception):
    pass


def _evaluate(target: Node, known: dict[Node, object], program: ExportedProgram, probe: dict[str, torch.Tensor],
              sizes, generator) -> torch.Tensor:
    """Run the nodes between ``known`` values and ``target`` in program order (so in-place ops apply
    where they did). Model inputs may only be read for their sizes (probe values), parameters the
    block reads besides its experts' weights get random values; any other tensor from outside means
    the block is not in the forms substituted."""
    pending = _between(target, known)
    user_inputs = {spec.arg.name for spec in program.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT}
    for node in pending:
        if node.op == "placeholder" and node.name in user_inputs and any(
                user in pending and user.target is not _aten.sym_size.int for user in node.users):
            raise _NotEvaluable(node.name)
    values = dict(known)
    order = {node: index for index, node in enumerate(program.graph.nodes)}
    for node in sorted(pending, key=order.__getitem__):
        if node.op == "placeholder":
            values[node] = probe[node.name] if node.name in user_inputs else _random(node, sizes, generator)
        elif node.op == "call_function":
            args = torch.fx.node.map_arg(node.args, values.__getitem__)
            kwargs = torch.fx.node.map_arg(node.kwargs, values.__getitem__)
            values[node] = node.target(*args, **kwargs)
        else:
            raise _NotEvaluable(node.name)
    return values[target]


def _between(target: Node, known: dict) -> set[Node]:
    seen, stack = set(), [target]
    while stack:
        node = stack.pop()
        if node in seen or node in known:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def _symbol_sizes(program: ExportedProgram, probe: dict[str, torch.Tensor]) -> dict:
    sizes = {}
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in probe:
            for dim, size in zip(node.meta["val"].shape, probe[node.name].shape, strict=True):
                if isinstance(dim, torch.SymInt) and isinstance(dim.node.expr, sympy.Symbol):
                    sizes[dim.node.expr] = int(size)
    return sizes


def _random(node: Node, sizes: dict, generator: torch.Generator) -> torch.Tensor:
    value = node.meta["val"]
    shape = [int(d) if not isinstance(d, torch.SymInt) else int(d.node.expr.subs(sizes)) for d in value.shape]
    return torch.randn(shape, generator=generator).to(value.dtype)


def _innermost_path(node: Node) -> str:
    stack = list(node.meta.get("nn_module_stack", {}).values())
    return stack[-1][0] if stack else ""


def _within(node: Node, path: str) -> bool:
    inner = _innermost_path(node)
    return inner == path or inner.startswith(path + ".")

