"""The FX pass protocol and the loop that runs a chosen list of passes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch.export import ExportedProgram


@dataclass(frozen=True)
class PassContext:
    """What a pass may read besides the program: the EP profile, the export options and the
    decoder layout derived from the HF config (never the model's name)."""

    profile: Any
    layout: Any
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PassRecord:
    name: str
    changes: dict[str, int]
    seconds: float


class FxPass(Protocol):
    name: str

    def __call__(
        self, program: ExportedProgram, context: PassContext
    ) -> tuple[ExportedProgram, dict[str, int]]: ...


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


def run_fx_passes(
    program: ExportedProgram,
    passes: list[FxPass],
    context: PassContext,
    on_pass: Callable[[PassRecord], None] | None = None,
) -> tuple[ExportedProgram, list[PassRecord]]:
    records = []
    for fx_pass in passes:
        start = time.perf_counter()
        program, changes = fx_pass(program, context)
        record = PassRecord(fx_pass.name, dict(changes), time.perf_counter() - start)
        records.append(record)
        if on_pass is not None:
            on_pass(record)
    return program, records
