"""The decoder session: ONNX Runtime GenAI's decoder I/O (input_ids, attention_mask, position_ids,
past KV of the KV-owning layers -> logits, present KV), traced from the HF model with
``exporter.trace``; its facts are the ``DecoderLayout``."""

from __future__ import annotations

from typing import Any

from ep_profiles import EpProfile
from exporter.layout import DecoderLayout
from exporter.trace import input_names, output_names, trace


class DecoderSession:
    name = "decoder"
    filename = "model.onnx"  # ONNX Runtime GenAI's name for a text-only package's decoder

    def applies(self, settings) -> str | None:
        return "every package has a text decoder"

    def trace(self, model, layout: DecoderLayout):
        """(program, sample inputs): the sample inputs are what lowering replays."""
        return trace(model, layout)

    def input_names(self, layout: DecoderLayout) -> list[str]:
        return input_names(layout)

    def output_names(self, layout: DecoderLayout) -> list[str]:
        return output_names(layout)

    def genai_section(self, layout: DecoderLayout, profile: EpProfile, graph_inputs: list[str],
                      graph_capture: bool) -> dict[str, Any]:
        inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask"}
        if "position_ids" in graph_inputs:
            inputs["position_ids"] = "position_ids"
        inputs["past_key_names"] = "past_key_values.%d.key"
        inputs["past_value_names"] = "past_key_values.%d.value"
        provider_options = (
            [{profile.genai_provider: profile.genai_provider_options(graph_capture)}] if profile.genai_provider else []
        )
        first_kv = layout.kv_layers[0]
        return {
            "session_options": {"log_id": "onnxruntime-genai", "provider_options": provider_options},
            "filename": self.filename,
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
