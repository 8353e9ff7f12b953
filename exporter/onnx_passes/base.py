"""The ONNX pass protocol, its record, and the loop that runs a planned list of passes.

Every pass has one shape, like the FX passes: a ``name``, ``applies(settings, session)`` saying why it
runs on that session of an export with these plan settings (or None), and ``__call__(model, settings,
session)`` that rewrites that session's model in place and returns a small dict of counts for the
report. A pass asks the plan settings about its session (``settings.quantized(session)``), never about the
export as a whole, because the sessions of one package differ (an int4 package's towers stay float).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import onnx_ir as ir


class OnnxPass(Protocol):
    name: str

    def applies(self, settings: Any, session: Any) -> str | None: ...

    def __call__(self, model: ir.Model, settings: Any, session: Any) -> dict[str, int]: ...


@dataclass(frozen=True)
class OnnxPassRecord:
    name: str
    changes: dict[str, int]
    nodes_before: int
    nodes_after: int
    seconds: float


def run_onnx_passes(model: ir.Model, passes: list[OnnxPass], settings: Any, session: Any) -> list[OnnxPassRecord]:
    records = []
    for onnx_pass in passes:
        before = count_nodes(model)
        start = time.perf_counter()
        changes = onnx_pass(model, settings, session)
        records.append(OnnxPassRecord(onnx_pass.name, dict(changes), before, count_nodes(model),
                                      time.perf_counter() - start))
    return records


def count_nodes(model: ir.Model, op_type: str | None = None) -> int:
    return sum(1 for node in model.graph.all_nodes() if op_type is None or node.op_type == op_type)


def run_in_place(ir_pass: ir.passes.PassBase, model: ir.Model) -> bool:
    """Run an onnx_ir pass that must edit ``model`` itself; returns whether it changed anything."""
    result = ir_pass(model)
    if result.model is not model:
        raise RuntimeError(f"ONNX pass {type(ir_pass).__name__} did not work in place")
    return result.modified
