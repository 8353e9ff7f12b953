"""The decoder families the suite covers, and what their graphs are expected to hold."""

# Every decoder family the suite covers, as built-in presets (all random weights, offline).
FAMILIES = [
    "tiny-gemma-4",
    "tiny-llama",
    "tiny-qwen3",
    "tiny-mistral",
    "tiny-phi3",
    "tiny-gemma2",
    "tiny-granite",
    "tiny-qwen3-moe",
    "tiny-mixtral",
    "tiny-gemma-4-moe",
    "tiny-gemma-3n",
    "tiny-cohere",
    "tiny-phi",
    "tiny-gpt-neox",
    "tiny-smollm3",
    "tiny-llama4",
]

# Families normalised by LayerNorm (ONNX's LayerNormalization), with no RMSNorm to fuse.
LAYER_NORM_FAMILIES = {"tiny-phi", "tiny-gpt-neox"}

# Families whose every norm is an RMSNorm, with a scale or without (Gemma 4's value norm, Llama 4's
# query and key norms), all of which fuse, and which compute no other mean of squares or power.
# Left out, as each keeps some: Gemma 4's MoE (two norms of one hidden state share their squares,
# so neither matches), Gemma 3n (AltUp rescales its streams by their RMS) and Cohere (its norms
# centre on the mean first).
PLAIN_RMS_NORM_FAMILIES = set(FAMILIES) - LAYER_NORM_FAMILIES - {
    "tiny-gemma-4-moe", "tiny-gemma-3n", "tiny-cohere"}

# Families with routed-experts blocks: ONNX Runtime's MoE where the CPU profile runs it (softmax
# top-k routing, SwiGLU-gated experts), else MatMuls over weights gathered per routed token behind the
# router's Softmax (Gemma 4: per-expert scales and GELU-gated experts).
MIXTURE_OF_EXPERTS_FAMILIES = {"tiny-qwen3-moe", "tiny-mixtral", "tiny-gemma-4-moe"}
FUSED_MIXTURE_OF_EXPERTS_FAMILIES = {"tiny-qwen3-moe", "tiny-mixtral"}

# Layers GroupQueryAttention cannot take, by family: Llama 4's chunked attention (a mask that is
# neither causal nor a sliding window) keeps transformers' attention in its three RoPE layers.
PLAIN_ATTENTION_LAYERS = {"tiny-llama4": [0, 1, 2]}
