"""Inline the model-local functions torch.onnx emits, so the later passes see one flat graph."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common

from exporter.onnx_passes.base import run_in_place


class InlineFunctions:
    name = "inline_functions"

    def applies(self, settings, session) -> str | None:
        return "later passes match nodes of one flat graph"

    def __call__(self, model: ir.Model, settings, session) -> dict[str, int]:
        functions = len(model.functions)
        run_in_place(common.InlinePass(), model)
        return {"functions_inlined": functions - len(model.functions)}
