"""Build genai_config.json: the decoder section from the graph's I/O, token ids from the generation
config, search defaults, and the profile's provider options."""

from __future__ import annotations

from typing import Any

from ep_profiles import EpProfile
from exporter.errors import ExporterError
from exporter.layout import DecoderLayout

# Model types ONNX Runtime GenAI 0.18 knows as plain decoder LMs (read from its library's strings).
GENAI_DECODER_TYPES = frozenset(
    {"gemma", "gemma2", "gemma3_text", "gemma4_text", "granite", "llama", "mistral", "nemotron",
     "olmo", "phi3", "qwen2", "qwen3", "smollm3"}
)
# ONNX Runtime GenAI treats every decoder-only type alike given the I/O names below; a family it
# does not list is written as this one, and the report says so.
FALLBACK_DECODER_TYPE = "llama"


def genai_model_type(layout: DecoderLayout) -> str:
    return layout.model_type if layout.model_type in GENAI_DECODER_TYPES else FALLBACK_DECODER_TYPE


def _token_ids(value) -> int | list[int] | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        ids = [int(v) for v in value]
        return ids[0] if len(ids) == 1 else ids
    return int(value)


def build_genai_config(
    layout: DecoderLayout,
    profile: EpProfile,
    generation_config: Any,
    graph_input_names: list[str],
    model_filename: str,
    context_length: int,
    share_kv_buffer: bool = False,
) -> dict[str, Any]:
    eos = _token_ids(getattr(generation_config, "eos_token_id", None))
    bos = _token_ids(getattr(generation_config, "bos_token_id", None))
    pad = _token_ids(getattr(generation_config, "pad_token_id", None))
    if pad is None:
        pad = eos[0] if isinstance(eos, list) else eos
    if eos is None:
        raise ExporterError(
            "the model has no eos_token_id; set model.generation_config.eos_token_id before exporting"
        )

    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask"}
    if "position_ids" in graph_input_names:
        inputs["position_ids"] = "position_ids"
    inputs["past_key_names"] = "past_key_values.%d.key"
    inputs["past_value_names"] = "past_key_values.%d.value"

    first_kv = layout.kv_layers[0]
    provider_options = (
        [{profile.genai_provider: profile.genai_provider_options()}] if profile.genai_provider else []
    )
    if profile.max_length is not None:
        context_length = min(context_length, profile.max_length)
    return {
        "model": {
            "bos_token_id": bos,
            "context_length": context_length,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": provider_options},
                "filename": model_filename,
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
            },
            "eos_token_id": eos,
            "pad_token_id": pad,
            "type": genai_model_type(layout),
            "vocab_size": layout.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": bool(getattr(generation_config, "do_sample", False)),
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": context_length,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": share_kv_buffer,
            "repetition_penalty": float(_setting(generation_config, "repetition_penalty", 1.0)),
            "temperature": float(_setting(generation_config, "temperature", 1.0)),
            # transformers' top_k 0 means no top-k filter: all of the vocabulary.
            "top_k": int(_setting(generation_config, "top_k", 50)) or layout.vocab_size,
            "top_p": float(_setting(generation_config, "top_p", 1.0)),
        },
    }


def _setting(generation_config, name: str, default):
    """A generation setting, or transformers' default where it is unset (a set 0 stays 0)."""
    value = getattr(generation_config, name, None)
    return default if value is None else value
