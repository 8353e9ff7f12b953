"""The vision session of a Gemma 4 multimodal package: one image's patches -> its soft tokens in
the language model's width, ``image_features [tokens, hidden]``.

``pixel_values`` is declared fp32 whatever the package precision and cast inside the graph:
ONNX Runtime GenAI converts the processor's fp32 patches to whatever the graph declares, and one
conversion fewer on the host is one place less to get wrong. GenAI runs the session once per image
(batch 1); with several images in a prompt it pads each to the largest one's patch count with
positions (-1, -1), which transformers' own pooler drops.

The patch count is traced as ``pooling_kernel_size**2 * soft_tokens`` (GenAI always feeds a
multiple: each image's patches, or the largest image's), so the pooler's ``int(sqrt(patches //
soft_tokens))`` is the kernel size for every count, not a guard on the sample's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.export import Dim

from exporter.load.multimodal import VISION_PROCESSOR_FILENAME, vision_processor_json
from exporter.sessions.base import Traced, export_program, session_options

SAMPLE_GRID = 6  # a 6 x 6 patch image: 36 patches, 4 soft tokens with 3 x 3 pooling


class GenAIVision(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model  # Gemma4ForConditionalGeneration

    def forward(self, pixel_values, pixel_position_ids):
        inner = self.model.model
        dtype = inner.embed_vision.embedding_projection.weight.dtype
        # get_image_features without its per-image split, which needs the sizes on the host.
        hidden = inner.vision_tower(pixel_values=pixel_values.to(dtype), pixel_position_ids=pixel_position_ids)
        return inner.embed_vision(inputs_embeds=hidden.last_hidden_state)


class VisionSession:
    name = "vision"
    is_decoder = False
    is_encoder = True
    traced_frame_multiple = None

    def applies(self, settings) -> str | None:
        return "ONNX Runtime GenAI's Gemma 4 package always has a vision encoder" if settings.multimodal else None

    def filename(self, settings) -> str:
        return "vision/model.onnx"

    def captured(self, settings) -> bool:
        return False

    def trace(self, prepared, settings) -> Traced:
        patch = settings.multimodal.image.patch_size
        generator = torch.Generator().manual_seed(0)
        pixel_values = torch.rand((1, SAMPLE_GRID * SAMPLE_GRID, 3 * patch * patch), generator=generator)
        rows, columns = torch.meshgrid(torch.arange(SAMPLE_GRID), torch.arange(SAMPLE_GRID), indexing="ij")
        positions = torch.stack([columns.flatten(), rows.flatten()], dim=-1).unsqueeze(0)  # (x, y)
        sample = (pixel_values, positions)
        patches = settings.multimodal.image.pooling_kernel_size ** 2 * Dim("soft_tokens", min=2)
        with _one_hot_with_symbolic_classes():
            program = export_program(GenAIVision(prepared.model), sample, ({1: patches}, {1: patches}))
        return Traced(program, sample, prepared.model)

    def input_names(self, settings) -> list[str]:
        return ["pixel_values", "pixel_position_ids"]

    def output_names(self, settings) -> list[str]:
        return ["image_features"]

    def genai_section(self, settings, graph_inputs: list[str]) -> dict[str, Any]:
        return {
            "filename": self.filename(settings),
            "config_filename": VISION_PROCESSOR_FILENAME,
            "session_options": session_options(settings.profile, self.captured(settings)),
            "inputs": {name: name for name in self.input_names(settings)},
            "outputs": {"image_features": "image_features"},
        }

    def extra_files(self, settings) -> dict[str, dict[str, Any]]:
        return {VISION_PROCESSOR_FILENAME: vision_processor_json(settings.multimodal)}


@contextlib.contextmanager
def _one_hot_with_symbolic_classes() -> Iterator[None]:
    """Let the pooler's ``F.one_hot(positions, soft_tokens)`` take a symbolic class count while tracing.

    ``one_hot``'s class count is a plain int, so torch.export would fix the soft-token count at the
    sample's; the comparison with ``arange`` is the same one-hot for any count.
    """
    original = torch.nn.functional.one_hot

    def one_hot(tensor: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
        if isinstance(num_classes, torch.SymInt):
            return (tensor.unsqueeze(-1) == torch.arange(num_classes, device=tensor.device)).long()
        return original(tensor, num_classes)

    torch.nn.functional.one_hot = one_hot
    try:
        yield
    finally:
        torch.nn.functional.one_hot = original
