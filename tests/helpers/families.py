"""The decoder families the suite covers."""

# Every decoder family the suite covers, as built-in presets (all random weights, offline).
FAMILIES = [
    "tiny-gemma-4",
    "tiny-llama",
    "tiny-qwen3",
    "tiny-mistral",
    "tiny-phi3",
    "tiny-gemma2",
    "tiny-granite",
]
