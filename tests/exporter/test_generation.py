"""L4: ONNX Runtime GenAI greedy tokens == transformers greedy tokens (fp32)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.generation import (
    LONG_PROMPT,
    PROMPT_LONGER_THAN_WINDOW,
    SHORT_PROMPT,
    genai_greedy,
    transformers_greedy,
)


@pytest.mark.l4
@pytest.mark.parametrize(
    "prompts", [[LONG_PROMPT], [LONG_PROMPT, SHORT_PROMPT]], ids=["one-prompt", "uneven-batch"]
)
def test_genai_greedy_matches_transformers(family_export, prompts):
    expected = transformers_greedy(family_export.model, prompts)
    actual = genai_greedy(family_export.package.path, prompts)
    assert all(len(row) > 1 for row in expected), "degenerate reference: generation ended at once"
    assert actual == expected


# tiny-gemma-4 slides over 16 tokens: PROMPT_LONGER_THAN_WINDOW (24 tokens) is longer than the
# window, and 64 new tokens go four windows past it, through the shared KV buffer.
PAST_WINDOW_TOKENS = 64


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
    expected = transformers_greedy(exported.model, prompts, PAST_WINDOW_TOKENS, no_early_end=True)
    assert all(len(row) == PAST_WINDOW_TOKENS for row in expected), "reference stopped before the window"
    assert genai_greedy(exported.package.path, prompts, PAST_WINDOW_TOKENS, no_early_end=True) == expected
