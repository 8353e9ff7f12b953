"""Erase the tensor-metadata assertions torch.export leaves in the graph.

``aten._assert_tensor_metadata`` nodes check dtypes and devices of intermediate tensors at run
time. They have no users, yet dead-code elimination keeps them because they are side-effecting,
so later passes that match dataflow around them would have to step over them. They carry no
meaning for the ONNX graph.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram

from fx_passes.base import Settings, erase_nodes

_ASSERT_TARGETS = (torch.ops.aten._assert_tensor_metadata.default,)


class DropRuntimeAsserts:
    name = "drop_runtime_asserts"

    def applies(self, settings, session) -> str | None:
        return "torch.export's runtime shape asserts check nothing ONNX Runtime can act on"

    def __call__(
        self, program: ExportedProgram, settings: Settings, session
    ) -> tuple[ExportedProgram, dict[str, int]]:
        erased = erase_nodes(program, lambda node: node.target in _ASSERT_TARGETS and not node.users)
        return program, {"asserts_erased": erased}
