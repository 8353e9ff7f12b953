"""Greedy generation of the same prompts by transformers and by ONNX Runtime GenAI in this
process, each batching its own way, for L4 comparisons (fp32). ``genai_greedy.py`` is the runner
in a process of its own, on a package's own providers."""

from __future__ import annotations

import numpy as np
import onnxruntime_genai as og
import torch

from exporter.load.presets import BOS_ID, EOS_ID, PAD_ID

NEW_TOKENS = 32
# Prompts as token ids (no id is the pad id, so GenAI's pad-derived mask is exact).
SHORT_PROMPT = [BOS_ID, 37, 101, 250, 7, 311]
LONG_PROMPT = [BOS_ID, 12, 99, 415, 260, 48, 77, 301, 5, 188, 64, 402, 90]
# tiny-gemma-4 slides over 16 tokens: a 24-token prompt is longer than the window.
PROMPT_LONGER_THAN_WINDOW = [BOS_ID] + [(7 * i + 3) % 500 + 3 for i in range(23)]


def until_eos(tokens: list[int]) -> list[int]:
    """The tokens before the first end-of-sequence. ONNX Runtime GenAI leaves the EOS out of a
    lone sequence that ends and keeps it (then pads) in a batch row; transformers keeps it."""
    return tokens[: tokens.index(EOS_ID)] if EOS_ID in tokens else tokens


def transformers_greedy(model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS,
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
    return [until_eos(row[width:].tolist()) for row in out]


def genai_greedy(package_dir, prompts: list[list[int]], new_tokens: int = NEW_TOKENS,
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
    return [until_eos(generator.get_sequence(i)[width:].tolist()) for i in range(len(prompts))]

