"""Build genai_config.json: the decoder section from the graph's I/O, token ids from the generation
config, search defaults, and the profile's provider options."""

from __future__ import annotations

from typing import Any

from exporter.errors import ExporterError
from exporter.load.layout import DecoderLayout

# Model types ONNX Runtime GenAI 0.18 knows as plain decoder LMs (read from its library's strings).
GENAI_DECODER_TYPES = frozenset(
    {"gemma", "gemma2", "gemma3_text", "gemma4_text", "gptoss", "granite", "llama", "mistral", "nemotron",
     "olmo", "phi3", "qwen2", "qwen3", "smollm3"}
)
# transformers' model_type -> GenAI's name for it, where they differ (GenAI's builder writes the
# architecture's name before "For", lowercased: GptOssForCausalLM -> gptoss).
_GENAI_NAMES = {"gpt_oss": "gptoss"}
# ONNX Runtime GenAI treats every decoder-only type alike given the I/O names below; a family it
# does not list is written as this one, and the report says so.
FALLBACK_DECODER_TYPE = "llama"
MULTIMODAL_TYPE = "gemma4"


def genai_model_type(layout: DecoderLayout) -> str:
    name = _GENAI_NAMES.get(layout.model_type, layout.model_type)
    return name if name in GENAI_DECODER_TYPES else FALLBACK_DECODER_TYPE


def _token_ids(value) -> int | list[int] | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        ids = [int(v) for v in value]
        return ids[0] if len(ids) == 1 else ids
    return int(value)


def build_genai_config(settings, generation_config: Any, sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``settings``: the export plan's (``exporter.plan.ExportSettings``): the layout, the context
    length it chose, whether past and present share one KV buffer (every present written in place
    by GroupQueryAttention), and a Gemma 4 multimodal package's facts (GenAI's ``gemma4`` type,
    with the token ids). ``sections``: each session's section by its name (``decoder``, ...),
    built by the session."""
    layout, multimodal, share_kv_buffer = settings.layout, settings.multimodal, settings.share_kv_buffer
    eos = _token_ids(getattr(generation_config, "eos_token_id", None))
    bos = _token_ids(getattr(generation_config, "bos_token_id", None))
    pad = _token_ids(getattr(generation_config, "pad_token_id", None))
    if pad is None:
        pad = eos[0] if isinstance(eos, list) else eos
    if eos is None:
        raise ExporterError(
            "the model has no eos_token_id; set model.generation_config.eos_token_id before exporting"
        )
    context_length = settings.context_length
    model = {
        **({} if bos is None else {"bos_token_id": bos}),  # GenAI refuses a null; a model without one omits it
        "context_length": context_length,
        **sections,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "type": genai_model_type(layout),
        "vocab_size": layout.vocab_size,
    }
    if multimodal is not None:
        # GenAI 0.18 runs a package with an embedding session as "gemma4" (as "gemma4_text" it
        # would take it for a text decoder and refuse it).
        model["type"] = MULTIMODAL_TYPE
        model["image_token_id"] = multimodal.image_token_id
        model["audio_token_id"] = multimodal.audio_token_id
        model["boa_token_id"] = multimodal.boa_token_id
        if "speech" not in sections:
            # GenAI 0.18 refuses a gemma4 package without a speech section, even one with no audio.
            model["speech"] = {"config_filename": ""}
    return {
        "model": model,
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
