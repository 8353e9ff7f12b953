"""The embedding session of a Gemma 4 multimodal package: token ids, plus the vision and speech
sessions' features, -> ``inputs_embeds`` and the per-layer token embeddings the decoder reads.

The features are scattered at the image and audio placeholder tokens, and those tokens look up the
pad token's embeddings, as transformers' ``Gemma4Model.forward`` does; every step calls
transformers' own modules. On text-only and decode steps ONNX Runtime GenAI feeds both feature
inputs with 0 rows; a placeholder token in such a step (the model generated it) keeps the pad
embedding, as in transformers without pixel values or audio.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.export import Dim

from exporter.sessions.base import Traced, export_program, session_options

SAMPLE_BATCH, SAMPLE_SEQ = 2, 8
SAMPLE_IMAGE_TOKENS, SAMPLE_AUDIO_TOKENS = 3, 2  # >= 2 each: torch.export specialises 0 and 1


class GenAIEmbedding(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model  # Gemma4ForConditionalGeneration

    def forward(self, input_ids, image_features, audio_features):
        inner = self.model.model
        image_mask, video_mask, audio_mask = inner.get_placeholder_mask(input_ids=input_ids)
        text_ids = torch.where(image_mask | video_mask | audio_mask, inner.config.text_config.pad_token_id, input_ids)
        inputs_embeds = inner.get_input_embeddings()(text_ids)
        per_layer_inputs = inner.language_model.get_per_layer_inputs(text_ids, None).flatten(2)
        for mask, features in ((image_mask, image_features), (audio_mask, audio_features)):
            # transformers scatters features only into a step that has them: a placeholder token
            # in a step with 0 feature rows (one the model generated) keeps the pad embedding.
            # Counted on the device, so that no size guard specialises the 0 rows away.
            has_features = features.new_ones(features.shape[:1], dtype=torch.int64).sum() > 0
            inputs_embeds = inputs_embeds.masked_scatter((mask & has_features).unsqueeze(-1).expand_as(inputs_embeds),
                                                         features.to(inputs_embeds.dtype))
        return inputs_embeds, per_layer_inputs


class EmbeddingSession:
    name = "embedding"
    is_decoder = False
    is_encoder = False
    traced_frame_multiple = None

    def applies(self, settings) -> str | None:
        return "a multimodal package embeds tokens and image and audio features apart from the decoder" \
            if settings.multimodal else None

    def filename(self, settings) -> str:
        return "embedding/model.onnx"

    def captured(self, settings) -> bool:
        return False

    def trace(self, prepared, settings) -> Traced:
        facts = settings.multimodal
        dtype = settings.compute_dtype
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, settings.layout.vocab_size, (SAMPLE_BATCH, SAMPLE_SEQ), generator=generator)
        input_ids[0, 1:1 + SAMPLE_IMAGE_TOKENS] = facts.image_token_id
        input_ids[1, 2:2 + SAMPLE_AUDIO_TOKENS] = facts.audio_token_id
        image_features = torch.randn((SAMPLE_IMAGE_TOKENS, facts.hidden_size), generator=generator).to(dtype)
        audio_features = torch.randn((SAMPLE_AUDIO_TOKENS, facts.hidden_size), generator=generator).to(dtype)
        sample = (input_ids, image_features, audio_features)
        dynamic = Dim.DYNAMIC
        program = export_program(GenAIEmbedding(prepared.model), sample,
                                 ({0: dynamic, 1: dynamic}, {0: dynamic}, {0: dynamic}))
        return Traced(program, sample, prepared.model)

    def input_names(self, settings) -> list[str]:
        return ["input_ids", "image_features", "audio_features"]

    def output_names(self, settings) -> list[str]:
        return ["inputs_embeds", "per_layer_inputs"]

    def genai_section(self, settings, graph_inputs: list[str]) -> dict[str, Any]:
        return {
            "filename": self.filename(settings),
            "session_options": session_options(settings.profile, self.captured(settings)),
            "inputs": {name: name for name in self.input_names(settings)},
            "outputs": {name: name for name in self.output_names(settings)},
        }

    def extra_files(self, settings) -> dict[str, dict[str, Any]]:
        return {}
