"""L4: ONNX Runtime GenAI greedy tokens == transformers greedy tokens (fp32)."""

from __future__ import annotations

import numpy as np
import onnxruntime_genai as og
import pytest
import torch

from exporter.presets import BOS_ID, EOS_ID, PAD_ID

NEW_TOKENS = 32
# Prompts as token ids (no id is the pad id, so GenAI's pad-derived mask is exact).
SHORT_PROMPT = [BOS_ID, 37, 101, 250, 7, 311]
LONG_PROMPT = [BOS_ID, 12, 99, 415, 260, 48, 77, 301, 5, 188, 64, 402, 90]


def _until_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


def _transformers_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' own batching: left padding with an attention mask."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
        )
    return [_until_eos(row[width:].tolist()) for row in out]


def _genai_greedy(package_dir, prompts: list[list[int]]) -> list[list[int]]:
    model = og.Model(str(package_dir))
    width = max(map(len, prompts))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=width + NEW_TOKENS, do_sample=False, batch_size=len(prompts))
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
