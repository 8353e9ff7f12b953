"""Erase dtype conversions that convert a tensor to the dtype it already has.

Hugging Face modules upcast to float32 around norms and softmax and cast back (``.to(dtype)``,
``type_as``), which is a no-op when the model already runs in float32. Each one still costs a node
in every later stage (torch.onnx's decomposition re-trace, the ONNX graph, runtime Cast kernels).
Only conversions whose input and output have the same dtype (read from the traced fake tensors),
and which change nothing else (device, memory format, copy), are erased.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram

from fx_passes.base import Settings, erase_nodes

_aten = torch.ops.aten
_DTYPE_ONLY_TARGETS = {
    _aten.to.dtype: ("dtype",),
    _aten.to.dtype_layout: ("dtype", "layout", "device"),
    _aten.type_as.default: (),
}


def _is_noop(node: torch.fx.Node) -> bool:
    source = node.args[0] if node.args else None
    if not isinstance(source, torch.fx.Node):
        return False
    source_value, value = source.meta.get("val"), node.meta.get("val")
    if not isinstance(source_value, torch.Tensor) or not isinstance(value, torch.Tensor):
        return False
    if source_value.dtype != value.dtype or source_value.device != value.device:
        return False
    allowed = set(_DTYPE_ONLY_TARGETS[node.target])
    for key, argument in node.kwargs.items():
        if key == "copy" and argument:
            return False
        if key == "memory_format" and argument not in (None, torch.preserve_format):
            return False
        if key not in allowed and key not in ("copy", "memory_format", "non_blocking"):
            return False
    return True


class DropNoopCasts:
    name = "drop_noop_casts"

    def applies(self, settings, session) -> str | None:
        return "casts to the dtype a tensor already has are no-ops"

    def __call__(
        self, program: ExportedProgram, settings: Settings, session
    ) -> tuple[ExportedProgram, dict[str, int]]:
        erased = erase_nodes(program, lambda node: node.target in _DTYPE_ONLY_TARGETS and _is_noop(node))
        return program, {"casts_erased": erased}
