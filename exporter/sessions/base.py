"""What a session is: one ONNX model of the package, traced from transformers' own modules.

A session says whether it applies to an export, what to trace (a wrapper module, sample inputs,
dynamic shapes), its graph's I/O names, its genai_config section and any files it needs beside it.
The pipeline runs the same steps for each: trace -> FX passes -> lower -> ONNX passes ->
post-conditions. Passes see the session in their ``applies`` (``is_decoder``, ``is_encoder``,
``captured``, ``traced_frame_multiple``) and in their ``__call__``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.export import ExportedProgram


@dataclass(frozen=True)
class Traced:
    program: ExportedProgram
    sample_inputs: tuple  # what lowering replays
    # The transformers module the trace wrapper holds as ``model``: initializer names are its
    # state_dict names, prefixed ``model.``.
    module: torch.nn.Module


class Session(Protocol):
    name: str
    is_decoder: bool  # the text decoder: KV cache, logits
    is_encoder: bool  # an image or audio tower
    # The trace takes only frame counts (``input_features``' dim 1) divisible by this; None: any.
    traced_frame_multiple: int | None

    def applies(self, settings) -> str | None: ...

    def filename(self, settings) -> str: ...

    def captured(self, settings) -> bool:
        """Whether ONNX Runtime GenAI captures this session's graph (then nothing may run on the CPU)."""
        ...

    def trace(self, prepared, settings) -> Traced: ...

    def input_names(self, settings) -> list[str]: ...

    def output_names(self, settings) -> list[str]: ...

    def genai_section(self, settings, graph_inputs: list[str]) -> dict[str, Any]: ...

    def extra_files(self, settings) -> dict[str, dict[str, Any]]:
        """JSON files the session's section names (processor configs), by file name."""
        ...


def session_options(profile, captured: bool) -> dict[str, Any]:
    """A section's session options: the profile's provider, with graph capture only where captured."""
    provider_options = (
        [{profile.genai_provider: profile.genai_provider_options(captured)}] if profile.genai_provider else []
    )
    return {"log_id": "onnxruntime-genai", "provider_options": provider_options}


def export_program(wrapper: torch.nn.Module, sample: tuple, dynamic_shapes) -> ExportedProgram:
    from exporter.load.layout import eval_mode
    from exporter.trace.decoder import NoopsUntraced, ordered_string_sets

    model = wrapper.model
    with torch.no_grad(), eval_mode(model), ordered_string_sets(model), NoopsUntraced():
        return torch.export.export(wrapper, sample, dynamic_shapes=dynamic_shapes, strict=False)
