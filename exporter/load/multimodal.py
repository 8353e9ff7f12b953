"""A Gemma 4 multimodal package's facts: which checkpoints get one, its special tokens, and the
image and audio processor settings, read from the checkpoint's own processor config.

ONNX Runtime GenAI 0.18 runs Gemma 4 multimodal packages (``type: gemma4``) with four sessions:
decoder, embedding, vision and speech (``exporter.sessions``). Its processor finds images and audio
in a prompt by six literal strings and preprocesses them with onnxruntime-extensions operators
whose settings this module writes (``vision_processor_json``, ``speech_processor_json``).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exporter.errors import ExporterError

# Architectures the exporter builds a multimodal package for (others: their language model only).
MULTIMODAL_MODEL_TYPES = frozenset({"gemma4"})

# The strings ONNX Runtime GenAI's Gemma 4 processor hard-codes (start, placeholder, end).
IMAGE_STRINGS = ("<|image>", "<|image|>", "<image|>")
AUDIO_STRINGS = ("<|audio>", "<|audio|>", "<audio|>")

VISION_PROCESSOR_FILENAME = "vision_processor.json"
SPEECH_PROCESSOR_FILENAME = "speech_processor.json"

# Gemma4LogMel's settings and their JSON types (the operator refuses an int where it wants a float).
_LOG_MEL_FLOATS = ("frame_length_ms", "hop_length_ms", "min_frequency", "max_frequency", "preemphasis", "mel_floor")
_LOG_MEL_INTS = ("feature_size", "sampling_rate", "preemphasis_htk_flavor", "fft_overdrive")
# transformers' feature extractor settings the operator has no way to apply.
_LOG_MEL_UNSUPPORTED_DEFAULTS = {"dither": 0.0, "input_scale_factor": 1.0}


@dataclass(frozen=True)
class ImageSettings:
    patch_size: int
    max_soft_tokens: int
    pooling_kernel_size: int


@dataclass(frozen=True)
class MultimodalFacts:
    """What the package's sessions and files need beyond the decoder layout."""

    image_token_id: int
    audio_token_id: int
    boa_token_id: int
    hidden_size: int  # the language model's: encoders project into it
    image: ImageSettings
    log_mel: dict[str, Any] | None  # Gemma4LogMel's attributes; None: the model has no audio tower

    @property
    def has_audio(self) -> bool:
        return self.log_mel is not None


def is_multimodal(config) -> bool:
    """Whether ``config`` is an architecture the exporter writes a multimodal package for."""
    return config.model_type in MULTIMODAL_MODEL_TYPES and getattr(config, "vision_config", None) is not None


def read_processor_settings(folder: Path) -> dict[str, dict[str, Any]]:
    """The checkpoint's image processor and feature extractor settings: Google's layout (one
    ``processor_config.json`` with ``image_processor`` and ``feature_extractor`` sections), or
    transformers' older separate ``preprocessor_config.json``."""
    sections: dict[str, dict[str, Any]] = {}
    combined = folder / "processor_config.json"
    if combined.is_file():
        values = _read_json(combined)
        for section in ("image_processor", "feature_extractor"):
            if isinstance(values.get(section), dict):
                sections[section] = values[section]
        if "image_seq_length" in values:
            sections.setdefault("image_processor", {}).setdefault("image_seq_length", values["image_seq_length"])
    separate = folder / "preprocessor_config.json"
    if separate.is_file() and "image_processor" not in sections:
        sections["image_processor"] = _read_json(separate)
    return sections


def multimodal_facts(config, processor_settings: dict[str, dict[str, Any]], source: str) -> MultimodalFacts:
    text = config.get_text_config(decoder=True)
    if getattr(text, "use_bidirectional_attention", None) == "vision":
        raise ExporterError(
            f"{source} attends bidirectionally over image tokens, which ONNX Runtime GenAI's Gemma 4 "
            "decoder does not; export it with --text-only"
        )
    image = processor_settings.get("image_processor")
    if image is None:
        raise ExporterError(
            f"{source} has no image processor settings (processor_config.json with an 'image_processor' "
            "section, or preprocessor_config.json); add the checkpoint's processor files, or export with --text-only"
        )
    vision = config.vision_config
    max_soft_tokens = image.get("max_soft_tokens", image.get("image_seq_length"))
    if max_soft_tokens is None:
        raise ExporterError(f"{source}'s image processor settings have no max_soft_tokens; add it, or export with --text-only")
    settings = ImageSettings(
        patch_size=int(image.get("patch_size", vision.patch_size)),
        max_soft_tokens=int(max_soft_tokens),
        pooling_kernel_size=int(image.get("pooling_kernel_size", vision.pooling_kernel_size)),
    )
    if (settings.patch_size, settings.pooling_kernel_size) != (vision.patch_size, vision.pooling_kernel_size):
        raise ExporterError(
            f"{source}'s image processor cuts {settings.patch_size}-pixel patches pooled by {settings.pooling_kernel_size}, "
            f"its vision tower wants {vision.patch_size} and {vision.pooling_kernel_size}; fix the processor config"
        )
    log_mel = None
    if getattr(config, "audio_config", None) is not None:
        if "feature_extractor" not in processor_settings:
            raise ExporterError(
                f"{source} has an audio tower but no feature extractor settings (a 'feature_extractor' section in "
                "processor_config.json); add the checkpoint's processor files, or export with --text-only"
            )
        log_mel = _log_mel_attributes(processor_settings["feature_extractor"], source)
    return MultimodalFacts(
        image_token_id=int(config.image_token_id),
        audio_token_id=int(config.audio_token_id),
        boa_token_id=int(config.boa_token_id),
        hidden_size=int(text.hidden_size),
        image=settings,
        log_mel=log_mel,
    )


def _log_mel_attributes(section: dict[str, Any], source: str) -> dict[str, Any]:
    """Gemma4LogMel's attributes: the section's values, else transformers' own defaults for them."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    defaults = {name: p.default for name, p in inspect.signature(Gemma4AudioFeatureExtractor.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    values = {**defaults, **section}
    for name, neutral in _LOG_MEL_UNSUPPORTED_DEFAULTS.items():
        if float(values.get(name) or neutral) != neutral:
            raise ExporterError(
                f"{source}'s feature extractor sets {name}={values[name]}, which ONNX Runtime GenAI's log-mel "
                "cannot apply; export with --text-only"
            )
    attributes: dict[str, Any] = {name: float(values[name]) for name in _LOG_MEL_FLOATS}
    attributes.update({name: int(bool(values[name])) if isinstance(values[name], bool) else int(values[name])
                       for name in _LOG_MEL_INTS})
    for name in ("per_bin_mean", "per_bin_stddev"):
        if values.get(name) is not None:
            attributes[name] = [float(v) for v in values[name]]
    return attributes


def vision_processor_json(facts: MultimodalFacts) -> dict[str, Any]:
    """onnxruntime-extensions' image pipeline: decode, then Gemma 4's resize and patching."""
    image = facts.image
    return {"processor": {"name": "gemma4_image_processor", "transforms": [
        {"operation": {"name": "decode_image", "type": "DecodeImage", "attrs": {"color_space": "RGB"}}},
        {"operation": {"name": "gemma4_image_transform", "type": "Gemma4ImageTransform", "attrs": {
            "patch_size": image.patch_size,
            "max_soft_tokens": image.max_soft_tokens,
            "pooling_kernel_size": image.pooling_kernel_size,
        }}},
    ]}}


def speech_processor_json(facts: MultimodalFacts) -> dict[str, Any]:
    """onnxruntime-extensions' audio pipeline: decode, then Gemma 4's log-mel features."""
    return {"feature_extraction": {"sequence": [
        {"operation": {"name": "audio_decoder", "type": "AudioDecoder"}},
        {"operation": {"name": "gemma4_log_mel", "type": "Gemma4LogMel", "attrs": dict(facts.log_mel)}},
    ]}}


def require_special_strings(tokenizer, facts: MultimodalFacts) -> None:
    """ONNX Runtime GenAI finds images and audio by six literal strings: each must be one token,
    and the placeholders must be the config's image and audio token ids."""
    wanted = {"<|image|>": facts.image_token_id}
    strings = IMAGE_STRINGS + (AUDIO_STRINGS if facts.has_audio else ())
    if facts.has_audio:
        wanted["<|audio|>"] = facts.audio_token_id
    for text in strings:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ExporterError(
                f"the tokenizer splits '{text}' into {len(ids)} tokens; ONNX Runtime GenAI's Gemma 4 processor "
                "needs it as one token: use the checkpoint's own tokenizer, or export with --text-only"
            )
        if text in wanted and ids[0] != wanted[text]:
            raise ExporterError(
                f"the tokenizer gives '{text}' id {ids[0]}, the config's token id is {wanted[text]}; "
                "use the checkpoint's own tokenizer, or export with --text-only"
            )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ExporterError(f"cannot read {path}: {error}") from error
    if not isinstance(values, dict):
        raise ExporterError(f"{path} is not a JSON object")
    return values
