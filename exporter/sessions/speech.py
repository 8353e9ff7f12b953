"""The speech session of a Gemma 4 multimodal package: log-mel frames ``[batch, frames, mels]``
and their mask -> the audio soft tokens in the language model's width, ``audio_features [tokens,
hidden]``, padding removed (transformers' ``get_audio_features`` then its mask).

torch.export can trace the audio tower only for frame counts divisible by 4 (its two stride-2
convolutions and chunked attention give shape guards its solver cannot reduce otherwise), so the
sample has 4k frames and the ONNX pass ``pad_audio_frames`` pads any count up to a multiple of 4
with masked frames, which change no real frame's output. ``input_features`` is declared fp32
whatever the package precision, like the vision session's pixels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.export import Dim

from exporter.load.multimodal import SPEECH_PROCESSOR_FILENAME, speech_processor_json
from exporter.sessions.base import Traced, export_program, session_options

FRAME_MULTIPLE = 4  # the tower halves the frames twice
SAMPLE_FRAMES = 100  # several attention chunks: one chunk would be specialised


class GenAISpeech(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model  # Gemma4ForConditionalGeneration

    def forward(self, input_features, input_features_mask):
        inner = self.model.model
        dtype = inner.embed_audio.embedding_projection.weight.dtype
        output = inner.get_audio_features(input_features.to(dtype), input_features_mask, return_dict=True)
        return output.pooler_output[output.attention_mask]


class SpeechSession:
    name = "speech"
    is_decoder = False
    is_encoder = True
    traced_frame_multiple = FRAME_MULTIPLE

    def applies(self, settings) -> str | None:
        if not settings.multimodal or not settings.multimodal.has_audio:
            return None
        return "the model has an audio encoder"

    def filename(self, settings) -> str:
        return "speech/model.onnx"

    def captured(self, settings) -> bool:
        return False

    def trace(self, prepared, settings) -> Traced:
        mels = settings.multimodal.log_mel["feature_size"]
        generator = torch.Generator().manual_seed(0)
        features = torch.randn((1, SAMPLE_FRAMES, mels), generator=generator)
        mask = torch.ones((1, SAMPLE_FRAMES), dtype=torch.bool)
        mask[:, -7:] = False
        frames = FRAME_MULTIPLE * Dim("quarter_frames", min=2)
        program = export_program(GenAISpeech(prepared.model), (features, mask), ({1: frames}, {1: frames}))
        return Traced(program, (features, mask), prepared.model)

    def input_names(self, settings) -> list[str]:
        return ["input_features", "input_features_mask"]

    def output_names(self, settings) -> list[str]:
        return ["audio_features"]

    def genai_section(self, settings, graph_inputs: list[str]) -> dict[str, Any]:
        return {
            "filename": self.filename(settings),
            "config_filename": SPEECH_PROCESSOR_FILENAME,
            "session_options": session_options(settings.profile, self.captured(settings)),
            # GenAI's names for the log-mel frames and their mask.
            "inputs": {"audio_embeds": "input_features", "attention_mask": "input_features_mask"},
            "outputs": {"audio_features": "audio_features"},
        }

    def extra_files(self, settings) -> dict[str, dict[str, Any]]:
        return {SPEECH_PROCESSOR_FILENAME: speech_processor_json(settings.multimodal)}
