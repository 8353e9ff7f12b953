"""Built-in models made locally: random weights from a fixed seed and a tokenizer trained on a
short built-in text, so the whole pipeline runs offline and in tests.

Each preset is a transformers config plus a seed; ``build_preset`` makes the model and tokenizer.
Gemma 4 presets temper the q/k RMSNorm weights (x0.25): random-init Gemma 4 has attention logits
with std ~ sqrt(head_dim) and scaling 1.0, so softmax is nearly argmax and fp32 itself is not a
stable reference; tempered, fp32 vs fp64 agree to ~1e-6 (measured on tiny-gemma-4).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2

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
    )
}

DEFAULT_PRESET = "tiny-gemma-4"


def train_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the built-in text, with Gemma's special-token ids."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
    )


def build_preset(name: str) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerFast]:
    preset = PRESETS[name]
    config = preset.make_config()
    with torch.random.fork_rng():
        torch.manual_seed(preset.seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.eval()
    if preset.temper_qk_norm:
        with torch.no_grad():
            for module_name, module in model.named_modules():
                if module_name.endswith(("q_norm", "k_norm")) and getattr(module, "weight", None) is not None:
                    module.weight.mul_(0.25)
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    tokenizer = train_tokenizer(min(config.vocab_size, 512))
    return model, tokenizer
