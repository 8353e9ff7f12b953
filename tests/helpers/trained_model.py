"""A tiny Gemma 4 that has learned something: a few hundred AdamW steps on the built-in text, so
its logits are peaked and its greedy continuation of a line from the text is that line. Random
weights give near-flat logits, where any rounding flips the argmax and a precision test measures
nothing; a trained model's margins are what fp16 and int4 packages must keep.
"""

from __future__ import annotations

import torch
import transformers

from exporter.load.presets import _CORPUS, PRESETS, build_preset

TRAIN_STEPS = 300
WINDOW = 48


def corpus_ids(tokenizer) -> torch.Tensor:
    return torch.tensor(tokenizer(_CORPUS.replace("\n", " "))["input_ids"])


def train_tiny_gemma4(steps: int = TRAIN_STEPS, seed: int = 0):
    """tiny-gemma-4's architecture trained on the built-in text; returns (model, tokenizer, ids)."""
    _, tokenizer = build_preset("tiny-gemma-4")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(PRESETS["tiny-gemma-4"].make_config())
        ids = corpus_ids(tokenizer)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        model.train()
        for _ in range(steps):
            starts = torch.randint(0, len(ids) - WINDOW - 1, (8,))
            batch = torch.stack([ids[s : s + WINDOW] for s in starts.tolist()])
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model, tokenizer, ids, float(loss.detach())
