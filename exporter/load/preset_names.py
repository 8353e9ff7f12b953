"""The presets' names, apart from ``exporter.load.presets`` (which imports torch and transformers to build
them): the command line reads them to know, without those imports, that a model argument names a
preset (exported even where a folder of that name exists) and what it exports by default."""

from __future__ import annotations

PRESET_NAMES = frozenset({
    "gemma-4-e2b-shape",
    "llama-shape",
    "qwen3-moe-shape",
    "tiny-cohere",
    "tiny-gemma-3n",
    "tiny-gemma-4",
    "tiny-gemma-4-moe",
    "tiny-gemma-4-multimodal",
    "tiny-gemma2",
    "tiny-gpt-neox",
    "tiny-gpt-oss",
    "tiny-granite",
    "tiny-llama",
    "tiny-llama4",
    "tiny-mistral",
    "tiny-mixtral",
    "tiny-phi",
    "tiny-phi3",
    "tiny-qwen3",
    "tiny-qwen3-moe",
    "tiny-smollm3",
})

DEFAULT_PRESET = "tiny-gemma-4"
