"""L4: ONNX Runtime GenAI greedy tokens == transformers greedy tokens (fp32)."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime_genai as og
import pytest
import torch

from exporter.load.presets import BOS_ID, EOS_ID, PAD_ID

NEW_TOKENS = 32
# Prompts as token ids (no id is the pad id, so GenAI's pad-derived mask is exact).
SHORT_PROMPT = [BOS_ID, 37, 101, 250, 7, 311]
LONG_PROMPT = [BOS_ID, 12, 99, 415, 260, 48, 77, 301, 5, 188, 64, 402, 90]


def _until_eos(tokens: list[int]) -> list[int]:
    """The tokens before the first end-of-sequence. ONNX Runtime GenAI leaves the EOS out of a
    lone sequence that ends and keeps it (then pads) in a batch row; transformers keeps it."""
    return tokens[: tokens.index(EOS_ID)] if EOS_ID in tokens else tokens


def _transformers_greedy(model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS,
                         no_early_end: bool = False) -> list[list[int]]:
    """transformers' own batching: left padding with an attention mask. ``no_early_end``: the
    end-of-sequence token is barred until ``new_tokens`` are out (min_new_tokens)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens if no_early_end else 0,
            do_sample=False,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
        )
    return [_until_eos(row[width:].tolist()) for row in out]


def _genai_greedy(package_dir, prompts: list[list[int]], new_tokens: int = NEW_TOKENS,
                  no_early_end: bool = False) -> list[list[int]]:
    model = og.Model(str(package_dir))
    width = max(map(len, prompts))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=width + new_tokens, min_length=width + new_tokens if no_early_end else 0,
                              do_sample=False, batch_size=len(prompts))
    generator = og.Generator(model, params)
    # ONNX Runtime GenAI pads batches on the right: it masks trailing pad tokens, feeds each new
    # token after the padding, and reads each row's logits at its last real token.
    generator.append_tokens(np.array([p + [PAD_ID] * (width - len(p)) for p in prompts], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [_until_eos(generator.get_sequence(i)[width:].tolist()) for i in range(len(prompts))]


@pytest.mark.l4
@pytest.mark.parametrize(
    "prompts", [[LONG_PROMPT], [LONG_PROMPT, SHORT_PROMPT]], ids=["one-prompt", "uneven-batch"]
)
def test_genai_greedy_matches_transformers(family_export, prompts):
    expected = _transformers_greedy(family_export.model, prompts)
    actual = _genai_greedy(family_export.package.path, prompts)
    assert all(len(row) > 1 for row in expected), "degenerate reference: generation ended at once"
    assert actual == expected


# tiny-gemma-4 slides over 16 tokens: a 24-token prompt is longer than the window, and 64 new
# tokens go four windows past it, through the shared KV buffer.
PAST_WINDOW_TOKENS = 64
PROMPT_LONGER_THAN_WINDOW = [BOS_ID] + [(7 * i + 3) % 500 + 3 for i in range(23)]


@pytest.mark.l4
@pytest.mark.parametrize("plain_attention", [False, True], ids=["group-query-attention", "plain-attention"])
@pytest.mark.parametrize(
    "prompts",
    [[PROMPT_LONGER_THAN_WINDOW], [SHORT_PROMPT], [PROMPT_LONGER_THAN_WINDOW, SHORT_PROMPT]],
    ids=["prompt-longer-than-window", "prompt-shorter-than-window", "uneven-batch"],
)
def test_generation_past_the_sliding_window(preset_exports, prompts, plain_attention):
    exported = preset_exports.get("tiny-gemma-4", plain_attention=plain_attention)
    config = json.loads((exported.package.path / "genai_config.json").read_text())
    assert config["search"]["past_present_share_buffer"] is not plain_attention
    # The end-of-sequence token is barred on both sides, so every row goes four windows past.
    expected = _transformers_greedy(exported.model, prompts, PAST_WINDOW_TOKENS, no_early_end=True)
    assert all(len(row) == PAST_WINDOW_TOKENS for row in expected), "reference stopped before the window"
    assert _genai_greedy(exported.package.path, prompts, PAST_WINDOW_TOKENS, no_early_end=True) == expected
