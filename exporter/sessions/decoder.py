"""The decoder session: ONNX Runtime GenAI's decoder I/O (input_ids, or a multimodal package's
inputs_embeds and per_layer_inputs; attention_mask, position_ids, past KV of the KV-owning layers
-> logits, present KV), traced from the HF model with ``exporter.trace.decoder``; its facts are the
``DecoderLayout``."""

from __future__ import annotations

from typing import Any

from exporter.sessions.base import Traced, session_options
from exporter.trace.decoder import input_names, output_names, trace


class DecoderSession:
    name = "decoder"
    is_decoder = True
    is_encoder = False
    traced_frame_multiple = None

    def applies(self, settings) -> str | None:
        return "every package has a text decoder"

    def filename(self, settings) -> str:
        # ONNX Runtime GenAI's name for a text-only package's decoder; a multimodal package keeps
        # each session in its own folder.
        return "decoder/model.onnx" if settings.multimodal else "model.onnx"

    def captured(self, settings) -> bool:
        return settings.graph_capture

    def trace(self, prepared, settings) -> Traced:
        program, sample = trace(prepared.decoder, settings.layout, embeds=settings.multimodal is not None)
        return Traced(program, sample, prepared.decoder)

    def input_names(self, settings) -> list[str]:
        return input_names(settings.layout, embeds=settings.multimodal is not None)

    def output_names(self, settings) -> list[str]:
        return output_names(settings.layout)

    def genai_section(self, settings, graph_inputs: list[str]) -> dict[str, Any]:
        layout = settings.layout
        if settings.multimodal:
            inputs = {"inputs_embeds": "inputs_embeds", "per_layer_inputs": "per_layer_inputs"}
        else:
            inputs = {"input_ids": "input_ids"}
        inputs["attention_mask"] = "attention_mask"
        if "position_ids" in graph_inputs:
            inputs["position_ids"] = "position_ids"
        inputs["past_key_names"] = "past_key_values.%d.key"
        inputs["past_value_names"] = "past_key_values.%d.value"
        first_kv = layout.kv_layers[0]
        return {
            "session_options": session_options(settings.profile, self.captured(settings)),
            "filename": self.filename(settings),
            # Gemma 4's head dims differ per layer; GenAI reads each KV input's dim from the
            # graph and wants the first (sliding) layer's here.
            "head_size": first_kv.head_dim,
            "hidden_size": layout.hidden_size,
            "inputs": inputs,
            "outputs": {
                "logits": "logits",
                "present_key_names": "present.%d.key",
                "present_value_names": "present.%d.value",
            },
            "num_attention_heads": layout.num_attention_heads,
            "num_hidden_layers": layout.num_layers,
            "num_key_value_heads": first_kv.num_kv_heads,
        }

    def extra_files(self, settings) -> dict[str, dict[str, Any]]:
        return {}
