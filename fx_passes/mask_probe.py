"""Learn what an attention mask of the traced program means by running the nodes that build it.

GroupQueryAttention builds causal and sliding-window masks itself, so substituting it is only
right when the model's mask is exactly causal, optionally limited to the last W tokens. Rather
than trusting config fields (which differ per family and are sometimes ignored by the code), the
mask subgraph is run on one unpadded probe sequence and the result is compared with those two
forms. Padding is not probed: GroupQueryAttention takes it from the attention mask's row sums.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from fx_passes.graph_facts import PassDidNotApply, ancestors


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


def probe_inputs(program: ExportedProgram, length: int) -> dict[str, torch.Tensor]:
    """One unpadded sequence of ``length`` tokens with an empty past."""
    inputs = {}
    for spec in program.graph_signature.input_specs:
        if spec.kind != torch.export.graph_signature.InputKind.USER_INPUT:
            continue
        node = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == spec.arg.name)
        value = node.meta["val"]
        if node.name == "attention_mask":
            inputs[node.name] = torch.ones(1, length, dtype=value.dtype)
        elif node.name == "position_ids":
            inputs[node.name] = torch.arange(length, dtype=value.dtype)[None]
        elif node.name == "input_ids":
            inputs[node.name] = torch.zeros(1, length, dtype=value.dtype)
        else:  # a past KV input: [batch, heads, past, head]
            inputs[node.name] = torch.zeros(1, int(value.shape[1]), 0, int(value.shape[3]), dtype=value.dtype)
    return inputs


def causal_window(mask: torch.Tensor, name: str) -> int:
    """0 for a causal mask, W for a causal mask limited to the last W keys; anything else is an
    error. ``mask`` is [..., queries, keys], boolean (True = attend) or additive (0 = attend)."""
    allowed = mask if mask.dtype == torch.bool else mask == 0
    allowed = allowed.reshape(-1, *allowed.shape[-2:])
    queries, keys = allowed.shape[-2:]
    if queries != keys:
        raise PassDidNotApply(f"mask {name} of the probe is {tuple(mask.shape)}; expected square")
    seen = int(allowed[0, -1].sum())
    window = 0 if seen == keys else seen
    position = torch.arange(keys)
    expected = position[None, :] <= position[:, None]
    if window:
        expected &= position[None, :] > position[:, None] - window
    if not bool((allowed == expected).all()):
        raise PassDidNotApply(
            f"mask {name} is neither causal nor a causal sliding window (its last query sees {seen} of "
            f"{keys} keys); GroupQueryAttention cannot build it"
        )
    return window
