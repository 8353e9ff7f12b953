"""The FX pass protocol and the loop that runs a chosen list of passes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument


class Settings(Protocol):
    """What a pass reads of an export besides the program: the export plan's settings
    (``exporter.plan.ExportSettings``, the one object FX and ONNX passes, the plan and the sessions
    read), written here as the protocol passes rely on, since passes sit below the plan. Passes
    ask it about their own session (``settings.stored_weight_bytes(session)``,
    ``session.captured(settings)``): the sessions of one package differ."""

    profile: Any  # the EP profile's facts
    layout: Any  # the decoder layout derived from the model (never the model's name)
    precision: str
    graph_capture: bool
    attention_op: bool  # the profile's attention op replaces transformers' attention
    full_logits: bool

    def quantized(self, session: Any) -> bool: ...

    def stored_weight_bytes(self, session: Any) -> float: ...


@dataclass(frozen=True)
class PassRecord:
    name: str
    changes: dict[str, int]
    seconds: float


class FxPass(Protocol):
    name: str

    def applies(self, settings: Settings, session: Any) -> str | None:
        """Why the pass runs on this session (``exporter.sessions``) of an export with these settings,
        or None where it does not."""
        ...

    def __call__(
        self, program: ExportedProgram, settings: Settings, session: Any
    ) -> tuple[ExportedProgram, dict[str, int]]: ...

    # Optional, by name: ``note(changes) -> str | None``, what the report says of the counts;
    # ``findings(changes) -> dict``, settings the plan takes from what the pass found
    # (``exporter.plan.ExportSettings.with_findings``); ``unplanned_note(settings, session) ->
    # str | None``, what the plan notes where the pass is not planned on a session.


def erase_nodes(program: ExportedProgram, matches: Callable[[Any], bool]) -> int:
    """Erase every call node ``matches`` accepts, its users reading its first argument instead
    (a pass-through); returns how many were erased."""
    graph = program.graph_module.graph
    erased = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and matches(node):
            if node.users:
                node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            erased += 1
    if erased:
        graph.lint()
        program.graph_module.recompile()
    return erased


def program_fake_mode(graph):
    """The fake-tensor mode the program was traced in (its placeholders' values carry it)."""
    return torch._guards.detect_fake_mode(
        [n.meta["val"] for n in graph.nodes if n.op == "placeholder" and "val" in n.meta])


def add_parameter(program: ExportedProgram, target: str, tensor: torch.Tensor) -> torch.fx.Node:
    """Add ``tensor`` to the program as a new weight named ``target``; returns its placeholder."""
    graph = program.graph
    first_placeholder = next(n for n in graph.nodes if n.op == "placeholder")
    with graph.inserting_before(first_placeholder):
        node = graph.placeholder("p_" + target.replace(".", "_"))
    node.meta["val"] = program_fake_mode(graph).from_tensor(tensor, static_shapes=True)
    program.state_dict[target] = torch.nn.Parameter(tensor, requires_grad=False)
    program.graph_signature.input_specs.insert(
        0, InputSpec(kind=InputKind.PARAMETER, arg=TensorArgument(name=node.name), target=target, persistent=None)
    )
    return node


def run_fx_passes(
    program: ExportedProgram, passes: list[FxPass], settings: Settings, session: Any
) -> tuple[ExportedProgram, list[PassRecord]]:
    records = []
    for fx_pass in passes:
        start = time.perf_counter()
        program, changes = fx_pass(program, settings, session)
        records.append(PassRecord(fx_pass.name, dict(changes), time.perf_counter() - start))
    outputs_named_as_in_graph(program)
    return program, records


def outputs_named_as_in_graph(program: ExportedProgram) -> None:
    """Point the signature's outputs at the nodes the graph now returns: a pass that replaces an
    output's producer (a present KV now written by GroupQueryAttention) renames it, and lowering
    reads outputs by name."""
    output = next(n for n in reversed(program.graph.nodes) if n.op == "output")
    returned = output.args[0]
    specs = program.graph_signature.output_specs
    if len(returned) != len(specs):
        raise RuntimeError(f"the graph returns {len(returned)} values, its signature {len(specs)}")
    for spec, node in zip(specs, returned, strict=True):
        if isinstance(spec.arg, TensorArgument) and isinstance(node, torch.fx.Node):
            spec.arg = TensorArgument(name=node.name)
