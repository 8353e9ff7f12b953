"""Facts about a decoder's KV cache, derived once from the HF model.

Which layers own a KV cache (Gemma 4's KV-shared layers read another layer's and own none), and the
KV head count and head dim of each owning layer. These are read by running the model once on two
tokens with an empty ``DynamicCache`` and looking at what each layer stored, so every family that
transformers implements is covered without reading family-specific config fields. The config is
consulted only for what the cache cannot show (sliding window, vocabulary, context length).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import transformers
from transformers import DynamicCache, PreTrainedModel

from exporter.errors import ExporterError
from exporter.load.experts import traceable_experts


@dataclass(frozen=True)
class KvLayer:
    index: int
    num_kv_heads: int
    head_dim: int
    # The values' own head dim where it is smaller than the keys' (multi-head latent attention):
    # GenAI's decoder has one head size, so the package's cache holds values zero-padded to
    # ``head_dim`` and the graph reads the first ``value_head_dim`` of each.
    value_head_dim: int | None = None

    @property
    def padded_value_dims(self) -> int:
        return self.head_dim - self.value_head_dim if self.value_head_dim is not None else 0


@dataclass(frozen=True)
class DecoderLayout:
    model_type: str
    num_layers: int
    num_attention_heads: int
    hidden_size: int
    vocab_size: int
    context_length: int
    kv_layers: tuple[KvLayer, ...]
    sliding_window: int | None
    num_kv_shared_layers: int
    experts_modules: int = 0  # modules holding every expert's weights stacked (mixtures of experts)
    # The config's attention logit softcap (Gemma 2's attn_logit_softcapping), known before the
    # trace; the graph itself says which layers apply it.
    attention_softcap: float | None = None

    @property
    def kv_layer_indices(self) -> tuple[int, ...]:
        return tuple(layer.index for layer in self.kv_layers)

    def kv_cache_bytes(self, slots: int, element_bytes: int, batch_size: int = 1) -> int:
        """Bytes of the KV cache (keys and values of every KV-owning layer) for ``slots`` positions."""
        per_slot = sum(2 * layer.num_kv_heads * layer.head_dim for layer in self.kv_layers)
        return batch_size * slots * per_slot * element_bytes

    def padded_values_note(self) -> str | None:
        """What zero-padding narrower values to the keys' head size costs, in words (None where no
        layer pads)."""
        padded = [layer for layer in self.kv_layers if layer.padded_value_dims]
        if not padded:
            return None
        first = padded[0]
        stored = sum(2 * layer.num_kv_heads * layer.head_dim for layer in self.kv_layers)
        padding = sum(layer.num_kv_heads * layer.padded_value_dims for layer in padded)
        return (f"{len(padded)} of {len(self.kv_layers)} KV layers cache values narrower than their keys "
                f"({first.value_head_dim} against {first.head_dim} per head in layer {first.index}; multi-head "
                f"latent attention caches its latent and its rotary key so): ONNX Runtime GenAI's decoder has one "
                f"head size, so those values are zero-padded to it, {padding / stored:.0%} of the cache's bytes")

    @property
    def shared_layer_indices(self) -> tuple[int, ...]:
        owning = set(self.kv_layer_indices)
        return tuple(i for i in range(self.num_layers) if i not in owning)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Run in eval mode (no dropout), then give the caller back the mode it had."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def text_config(config):
    """The decoder's config: itself, or the ``text_config`` of a multimodal config."""
    return config.get_text_config(decoder=True)


@contextlib.contextmanager
def _buffers_on(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Every buffer on ``device`` for the probe, put back after. A model built on the meta device
    keeps its buffers real (``exporter.weights.meta_model.build_on_meta``), and a module that adds
    a buffer to a parameter's product (a router's score-correction bias: DeepSeek-V3, GLM-4-MoE)
    would mix devices; only shapes matter to the probe."""
    if device.type != "meta":
        yield
        return
    moved = [(module, name, buffer) for module in model.modules() for name, buffer in module._buffers.items()
             if buffer is not None and buffer.device != device]
    for module, name, buffer in moved:
        module._buffers[name] = buffer.to(device)
    try:
        yield
    finally:
        for module, name, buffer in moved:
            module._buffers[name] = buffer


# The cache layers transformers builds that hold keys and values as GenAI's decoder does (a
# KV-shared layer holds none: DummyLayer).
_KV_CACHE_LAYERS = frozenset({"DynamicLayer", "DynamicSlidingWindowLayer", "DummyLayer"})


def non_kv_state_layers(config) -> dict[int, str]:
    """The decoder layers whose state is not a key/value cache, with the cache layer transformers
    builds for each (``LinearAttentionLayer``: a convolution or recurrent state, as in LFM2,
    Qwen3-Next and Mamba hybrids; ``DynamicIndexedLayer``: an indexer's cache); read off the
    config alone, before any weight is read. Empty where transformers builds no cache from the
    config (the layout probe then says more)."""
    try:
        cache = DynamicCache(config=text_config(config))
    except Exception:  # noqa: BLE001 - a config the cache cannot read: the layout probe says more
        return {}
    return {index: type(layer).__name__ for index, layer in enumerate(cache.layers)
            if type(layer).__name__ not in _KV_CACHE_LAYERS}


def derive_layout(model: PreTrainedModel) -> DecoderLayout:
    config = text_config(model.config)
    cache = DynamicCache()
    param = next(model.parameters())
    probe_ids = torch.zeros((1, 2), dtype=torch.long, device=param.device)
    with torch.no_grad(), eval_mode(model), traceable_experts(model), _buffers_on(model, param.device):
        model(input_ids=probe_ids, cache=cache, use_cache=True)

    kv_layers = []
    for index, layer in enumerate(cache.layers):
        keys = getattr(layer, "keys", None)
        if keys is None or keys.numel() == 0:
            continue
        _, num_kv_heads, _, head_dim = keys.shape
        value_head_dim = int(layer.values.shape[-1])
        if tuple(layer.values.shape[:3]) != tuple(keys.shape[:3]):
            raise ExporterError(
                f"{config.model_type} caches values of shape {list(layer.values.shape)} beside keys of "
                f"{list(keys.shape)} (layer {index}): ONNX Runtime GenAI's decoder carries keys and values of one "
                "head count and length, so this exporter refuses the model")
        if value_head_dim > head_dim:
            raise ExporterError(
                f"{config.model_type} caches values of {value_head_dim} per head, wider than its keys' {head_dim} "
                f"(layer {index}): ONNX Runtime GenAI's decoder takes one head size for both, and this exporter "
                "pads only values narrower than keys, so it refuses the model")
        kv_layers.append(KvLayer(index, int(num_kv_heads), int(head_dim),
                                 value_head_dim if value_head_dim < head_dim else None))
    if not kv_layers:
        raise RuntimeError("no layer stored keys in the cache (the exporter reads the KV layout from what the "
                           "layers store in a transformers DynamicCache)")

    num_layers = int(config.num_hidden_layers)
    layer_types = getattr(config, "layer_types", None) or []
    has_sliding = "sliding_attention" in layer_types or (
        not layer_types and getattr(config, "sliding_window", None)
    )
    return DecoderLayout(
        model_type=config.model_type,
        num_layers=num_layers,
        num_attention_heads=int(config.num_attention_heads),
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        context_length=int(getattr(config, "max_position_embeddings", 0) or 4096),
        kv_layers=tuple(kv_layers),
        sliding_window=int(config.sliding_window) if has_sliding and config.sliding_window else None,
        num_kv_shared_layers=num_layers - len(kv_layers),
        experts_modules=sum(1 for module in model.modules() if holds_stacked_experts(module)),
        attention_softcap=float(softcap) if (softcap := getattr(config, "attn_logit_softcapping", None)) else None,
    )


def holds_stacked_experts(module: torch.nn.Module) -> bool:
    """transformers' experts modules hold every expert's weights in 3-D tensors [experts, out, in]."""
    down = getattr(module, "down_proj", None)
    return isinstance(down, torch.nn.Parameter) and down.dim() == 3


def causal_lm_view(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """transformers' causal LM class for a multimodal model's language model, holding that model's
    own language model and LM head (shared, not copied): the decoder session traces it as it
    traces any text model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    decoder_config = model.config.get_text_config(decoder=True)
    causal_lm_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[decoder_config.model_type])
    with torch.device("meta"):
        view = causal_lm_class(decoder_config)
    view.model = model.model.language_model
    view.lm_head = model.lm_head
    view.generation_config = model.generation_config
    return view.eval()
