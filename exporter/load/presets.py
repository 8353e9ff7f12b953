"""Built-in models made locally: random weights from a fixed seed and a tokenizer trained on a
short built-in text, so the whole pipeline runs offline and in tests.

Each preset is a transformers config plus a seed; ``build_preset`` makes the model and tokenizer.
Gemma 4 presets temper the q/k RMSNorm weights (x0.25, as ``--random-weights`` does): random-init Gemma 4 has attention logits
with std ~ sqrt(head_dim) and scaling 1.0, so softmax is nearly argmax and fp32 itself is not a
stable reference; tempered, fp32 vs fp64 agree to ~1e-6 (measured on tiny-gemma-4).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from exporter.weights.stores import TEMPERED_QK_NORM_SCALE

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
# A multimodal preset's tokenizer adds Gemma 4's image and audio markers (ids 4-10, in this order):
# ONNX Runtime GenAI's processor finds images and audio by these strings.
MULTIMODAL_TOKENS = ("<|image>", "<|image|>", "<image|>", "<|audio>", "<|audio|>", "<audio|>", "<|video|>")

# Public-domain text (Lewis Carroll, "Alice's Adventures in Wonderland", 1865) to train the tokenizer.
_CORPUS = """\
Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing
to do: once or twice she had peeped into the book her sister was reading, but it had no pictures or
conversations in it, and what is the use of a book, thought Alice, without pictures or
conversations? So she was considering in her own mind (as well as she could, for the hot day made
her feel very sleepy and stupid), whether the pleasure of making a daisy-chain would be worth the
trouble of getting up and picking the daisies, when suddenly a White Rabbit with pink eyes ran close
by her. There was nothing so very remarkable in that; nor did Alice think it so very much out of the
way to hear the Rabbit say to itself, Oh dear! Oh dear! I shall be late! But when the Rabbit actually
took a watch out of its waistcoat-pocket, and looked at it, and then hurried on, Alice started to her
feet, for it flashed across her mind that she had never before seen a rabbit with either a
waistcoat-pocket, or a watch to take out of it, and burning with curiosity, she ran across the field
after it, and fortunately was just in time to see it pop down a large rabbit-hole under the hedge.
In another moment down went Alice after it, never once considering how in the world she was to get
out again. The rabbit-hole went straight on like a tunnel for some way, and then dipped suddenly
down, so suddenly that Alice had not a moment to think about stopping herself before she found
herself falling down a very deep well. 0 1 2 3 4 5 6 7 8 9 + - * / = ( ) [ ] { } < > : ; , . ! ?
"""


def _gemma4(**overrides) -> transformers.PretrainedConfig:
    return transformers.Gemma4TextConfig(**overrides)


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    make_config: Callable[[], transformers.PretrainedConfig]
    seed: int = 0
    temper_qk_norm: bool = False
    # A multimodal preset's image processor and feature extractor settings (processor_config.json's
    # sections); it then also moves every constant saved tensor, as a trained checkpoint's are.
    processor_settings: dict[str, dict[str, Any]] = field(default_factory=dict)


def _tiny_gemma4_config():
    layer_types = (["sliding_attention"] * 4 + ["full_attention"]) * 2
    return _gemma4(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        global_head_dim=64,
        vocab_size=512,
        vocab_size_per_layer_input=512,
        hidden_size_per_layer_input=16,
        num_kv_shared_layers=4,
        use_double_wide_mlp=True,
        sliding_window=16,
        final_logit_softcapping=30.0,
        max_position_embeddings=2048,
        **_special_ids(),
    )


def _gemma4_e2b_shape_config():
    layer_types = (["sliding_attention"] * 4 + ["full_attention"]) * 7
    return _gemma4(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=35,
        layer_types=layer_types,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        vocab_size=32768,
        vocab_size_per_layer_input=32768,
        hidden_size_per_layer_input=256,
        num_kv_shared_layers=20,
        use_double_wide_mlp=True,
        sliding_window=512,
        final_logit_softcapping=30.0,
        max_position_embeddings=4096,
        **_special_ids(),
    )


def _tiny_gemma4_multimodal_config():
    ids = {token: 4 + i for i, token in enumerate(MULTIMODAL_TOKENS)}
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16, patch_size=16, pooling_kernel_size=3, position_embedding_size=128, use_clipped_linears=True,
    )
    # subsampling_conv_channels[0] must be 128 (transformers sizes the projection from it as if it
    # were the mel bins' count); the second is free.
    audio = transformers.Gemma4AudioConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[128, 4],
        output_proj_dims=48, use_clipped_linears=True,
    )
    return transformers.Gemma4Config(
        text_config=_tiny_gemma4_config().to_dict(), vision_config=vision.to_dict(), audio_config=audio.to_dict(),
        boi_token_id=ids["<|image>"], image_token_id=ids["<|image|>"], eoi_token_id=ids["<image|>"],
        boa_token_id=ids["<|audio>"], audio_token_id=ids["<|audio|>"], eoa_token_index=ids["<audio|>"],
        video_token_id=ids["<|video|>"], tie_word_embeddings=True, architectures=["Gemma4ForConditionalGeneration"],
        **_special_ids(),
    )


# transformers' Gemma 4 processor settings, small: at most 70 soft tokens (630 patches) per image.
_TINY_MULTIMODAL_PROCESSOR = {
    "image_processor": {"patch_size": 16, "max_soft_tokens": 70, "pooling_kernel_size": 3},
    "feature_extractor": {"feature_size": 128, "sampling_rate": 16000, "frame_length_ms": 20.0,
                          "hop_length_ms": 10.0, "min_frequency": 0.0, "max_frequency": 8000.0,
                          "preemphasis": 0.0, "preemphasis_htk_flavor": True, "fft_overdrive": False,
                          "mel_floor": 0.001},
}


def _special_ids() -> dict:
    return {"pad_token_id": PAD_ID, "eos_token_id": EOS_ID, "bos_token_id": BOS_ID}


def _small(config_class, **overrides):
    base = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        **_special_ids(),
    )
    base.update(overrides)
    return lambda: config_class(**base)


def _tiny_gemma4_moe_config():
    """Gemma 4 26B-A4B's decoder structure (a dense MLP beside a routed-experts block in every
    layer, no per-layer embeddings or KV sharing) in miniature."""
    layer_types = ["sliding_attention"] * 3 + ["full_attention"]
    return _gemma4(
        hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types), layer_types=layer_types,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, vocab_size=512,
        hidden_size_per_layer_input=0, num_kv_shared_layers=0, sliding_window=8, final_logit_softcapping=30.0,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        max_position_embeddings=2048, **_special_ids(),
    )


def _tiny_gemma3n_config():
    """Gemma 3n's text decoder in miniature: AltUp streams, Laurel blocks, per-layer embeddings,
    activation sparsity in the first layers and the last 2 of 6 layers KV-shared."""
    layers = 6
    return transformers.Gemma3nTextConfig(
        hidden_size=64, intermediate_size=[128] * layers, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, vocab_size_per_layer_input=512,
        hidden_size_per_layer_input=8, num_kv_shared_layers=2, laurel_rank=8, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        activation_sparsity_pattern=[0.95, 0.95] + [0.0] * (layers - 2),
        max_position_embeddings=2048, tie_word_embeddings=True, **_special_ids(),
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "tiny-gemma-4",
            "Gemma 4 E2B's structure in miniature (10 layers, 4 KV-shared, sliding window 16)",
            _tiny_gemma4_config,
            temper_qk_norm=True,
        ),
        Preset(
            "gemma-4-e2b-shape",
            "Gemma 4 E2B's exact 35-layer structure at reduced width (hidden 512, vocab 32768); for benchmarks",
            _gemma4_e2b_shape_config,
            temper_qk_norm=True,
        ),
        Preset(
            "tiny-gemma-4-multimodal",
            "Gemma 4 E2B's multimodal structure in miniature: tiny-gemma-4's decoder, a 2-layer vision tower "
            "and a 2-layer audio tower",
            _tiny_gemma4_multimodal_config,
            temper_qk_norm=True,
            processor_settings=_TINY_MULTIMODAL_PROCESSOR,
        ),
        Preset("tiny-llama", "4-layer Llama with grouped KV heads", _small(transformers.LlamaConfig)),
        Preset(
            "llama-shape",
            "Llama 3.2 1B's 16-layer structure at reduced width (hidden 512, 8 heads, 2 KV heads, vocab 32768); "
            "for benchmarks",
            _small(transformers.LlamaConfig, hidden_size=512, intermediate_size=2048, num_hidden_layers=16,
                   num_attention_heads=8, vocab_size=32768, max_position_embeddings=4096, tie_word_embeddings=True),
        ),
        Preset("tiny-qwen3", "4-layer Qwen3 (q/k norms)", _small(transformers.Qwen3Config, head_dim=16)),
        Preset(
            "tiny-mistral",
            "4-layer Mistral",
            _small(transformers.MistralConfig, sliding_window=None),
        ),
        Preset("tiny-phi3", "4-layer Phi-3 (fused qkv and gate/up projections)", _small(
            transformers.Phi3Config, num_key_value_heads=4, pad_token_id=PAD_ID)),
        Preset(
            "tiny-gemma2",
            "4-layer Gemma 2 (sliding window 8, attention and final logit soft-capping)",
            _small(transformers.Gemma2Config, head_dim=16, sliding_window=8, tie_word_embeddings=True),
        ),
        Preset(
            "tiny-granite",
            "4-layer Granite (embedding, residual, attention and logit multipliers)",
            _small(
                transformers.GraniteConfig,
                embedding_multiplier=12.0,
                residual_multiplier=0.22,
                attention_multiplier=0.25,
                logits_scaling=8.0,
            ),
        ),
        Preset(
            "tiny-qwen3-moe",
            "4-layer Qwen3-MoE (4 routed experts, top 2, softmax router; layer 3 a dense MLP)",
            _small(transformers.Qwen3MoeConfig, head_dim=16, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, mlp_only_layers=[3], norm_topk_prob=True),
        ),
        Preset(
            "qwen3-moe-shape",
            "Qwen3-MoE's routing (64 experts, top 8, softmax router) in 8 layers at hidden size 512, vocab "
            "32768; for benchmarks",
            _small(transformers.Qwen3MoeConfig, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                   head_dim=64, vocab_size=32768, max_position_embeddings=4096, num_experts=64,
                   num_experts_per_tok=8, moe_intermediate_size=128, norm_topk_prob=True),
        ),
        Preset(
            "tiny-mixtral",
            "4-layer Mixtral (4 routed experts, top 2)",
            _small(transformers.MixtralConfig, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
        ),
        Preset(
            "tiny-gemma-4-moe",
            "Gemma 4 26B-A4B's decoder structure in miniature (a dense MLP and 4 routed experts, top 2, "
            "in every layer)",
            _tiny_gemma4_moe_config,
            temper_qk_norm=True,
        ),
        Preset("tiny-gemma-3n", "Gemma 3n's text decoder in miniature (6 layers, 2 KV-shared; AltUp, Laurel, "
               "per-layer embeddings, activation sparsity)", _tiny_gemma3n_config),
        Preset(
            "tiny-llama4",
            "4-layer Llama 4 text decoder (chunked attention over 8 tokens in 3 layers, a NoPE full-attention "
            "layer, complex rotary, L2-normed q/k, a dense-experts MoE in every second layer)",
            _small(transformers.Llama4TextConfig, head_dim=16, intermediate_size_mlp=128, attention_chunk_size=8,
                   num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
                   no_rope_layers=[1, 1, 1, 0]),
        ),
        Preset(
            "tiny-cohere",
            "4-layer Cohere (parallel attention and MLP, mean-centred norms, interleaved rotary, logit scale)",
            _small(transformers.CohereConfig, logit_scale=0.5, tie_word_embeddings=True),
        ),
        Preset(
            "tiny-phi",
            "4-layer Phi-2 style (parallel block, LayerNorm with bias, half the head rotated, q/k LayerNorms)",
            _small(transformers.PhiConfig, num_key_value_heads=4, partial_rotary_factor=0.5, qk_layernorm=True),
        ),
        Preset(
            "tiny-gpt-neox",
            "4-layer GPT-NeoX (fused per-head qkv, parallel residual, a quarter of the head rotated)",
            _small(transformers.GPTNeoXConfig, num_key_value_heads=None, rotary_pct=0.25),
        ),
        Preset(
            "tiny-gpt-oss",
            "4-layer gpt-oss (learned attention sinks, alternating sliding and full layers, YaRN rotary, 4 routed "
            "experts with biases and a clamped SwiGLU, top 2)",
            # The clamp at 0.5, not gpt-oss's 7: tiny random activations reach it, so the tests see it act.
            _small(transformers.GptOssConfig, head_dim=16, intermediate_size=64, num_local_experts=4,
                   num_experts_per_tok=2, sliding_window=8, swiglu_limit=0.5,
                   layer_types=["sliding_attention", "full_attention"] * 2,
                   rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 64,
                                    "rope_theta": 150000.0}),
        ),
        Preset(
            "tiny-smollm3",
            "4-layer SmolLM3 (every fourth layer without rotary: NoPE)",
            _small(transformers.SmolLM3Config, no_rope_layer_interval=4),
        ),
    )
}

def train_tokenizer(vocab_size: int, extra_special_tokens: tuple[str, ...] = (),
                    special_token_ids: dict[str, int] | None = None) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the built-in text, with Gemma's special-token ids
    (then ``extra_special_tokens``, from id 4, or at the ids ``special_token_ids`` gives them: a
    full-size config's image and audio token ids lie far beyond the trained vocabulary)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *extra_special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    if special_token_ids:
        data = json.loads(tokenizer.to_str())
        for entry in data["added_tokens"]:
            entry["id"] = special_token_ids.get(entry["content"], entry["id"])
        data["model"]["vocab"].update(special_token_ids)
        tokenizer = Tokenizer.from_str(json.dumps(data))
    extra = {"extra_special_tokens": list(extra_special_tokens)} if extra_special_tokens else {}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        **extra,
    )


def marker_ids(config) -> dict[str, int]:
    """A Gemma 4 multimodal config's ids of the image and audio marker strings."""
    return dict(zip(MULTIMODAL_TOKENS, (config.boi_token_id, config.image_token_id, config.eoi_token_id,
                                        config.boa_token_id, config.audio_token_id, config.eoa_token_index,
                                        config.video_token_id), strict=True))


def preset_tokenizer(name: str) -> transformers.PreTrainedTokenizerFast:
    preset = PRESETS[name]
    extra = MULTIMODAL_TOKENS if preset.processor_settings else ()
    return train_tokenizer(min(preset.make_config().get_text_config(decoder=True).vocab_size, 512), extra)


def build_preset(name: str) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerFast]:
    preset = PRESETS[name]
    config = preset.make_config()
    with torch.random.fork_rng():
        torch.manual_seed(preset.seed)
        if preset.processor_settings:
            model = transformers.Gemma4ForConditionalGeneration(config)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config)
    model.eval()
    if preset.temper_qk_norm:
        with torch.no_grad():
            for module_name, module in model.named_modules():
                if module_name.endswith(("q_norm", "k_norm")) and getattr(module, "weight", None) is not None:
                    module.weight.mul_(TEMPERED_QK_NORM_SCALE)
    if preset.processor_settings:
        _clip_like_a_checkpoint(model)
        move_constant_tensors(model, preset.seed)
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    return model, preset_tokenizer(name)


# A constant c becomes c * U(0.75, 1.25) per element; a zero one gets N(0, ZERO_NOISE) noise.
SCALE_RANGE = (0.75, 1.25)
ZERO_NOISE = 0.02


def constant_saved_tensors(model: torch.nn.Module) -> list[str]:
    """Names of floating tensors in ``state_dict()`` (parameters and persistent buffers) whose
    elements are all equal: what a dropped or re-initialised tensor would be indistinguishable from."""
    return [
        name
        for name, tensor in model.state_dict().items()
        if tensor.is_floating_point()
        and tensor.numel() > 0
        and bool(torch.isfinite(tensor.flatten()[0]))  # +-inf clip bounds (no clipping) stay as they are
        and bool((tensor == tensor.flatten()[0]).all())
    ]


@torch.no_grad()
def move_constant_tensors(model: torch.nn.Module, seed: int = 0) -> list[str]:
    """Move every constant saved tensor away from its constant, in place, as training would (a
    dropped or re-initialised tensor then shows); returns their names. Tied tensors (one storage
    under several names) are moved once."""
    generator = torch.Generator().manual_seed(seed)
    state, moved, seen = model.state_dict(keep_vars=True), [], set()
    for name in constant_saved_tensors(model):
        tensor = state[name]
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        value = float(tensor.flatten()[0])
        before = tensor.clone()
        if value == 0.0:
            tensor.add_((torch.randn(tensor.shape, generator=generator) * ZERO_NOISE).to(tensor.dtype))
        else:
            low, high = SCALE_RANGE
            tensor.mul_((low + (high - low) * torch.rand(tensor.shape, generator=generator)).to(tensor.dtype))
        if bool((tensor == before).any()):
            raise RuntimeError(f"{name}: an element kept its init value")
        moved.append(name)
    return moved


@torch.no_grad()
def _clip_like_a_checkpoint(model: torch.nn.Module) -> None:
    """Give Gemma 4's clipped linears finite bounds (init leaves them at +-inf, no clipping; a
    trained checkpoint's clip), so a dropped bound changes the output."""
    for name, buffer in model.named_buffers():
        if name.endswith(("input_min", "input_max", "output_min", "output_max")):
            bound = 2.0 if "input" in name else 0.5
            buffer.fill_(-bound if name.endswith("min") else bound)
