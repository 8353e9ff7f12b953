"""Test checkpoints that cannot hide a dropped tensor.

A model fresh from init holds many saved tensors at a constant (norm weights at 1 or 0, biases at 0,
Gemma 4's ``layer_scalar`` at 1). An exporter that drops or re-initialises such a tensor gets the
same constant back and passes every test. So every checkpoint the suite builds moves each saved
tensor that init left constant away from that constant, then goes through ``save_pretrained`` and
is read back the way a user's is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from exporter.load.presets import (  # noqa: F401  (re-exported for tests)
    PRESETS,
    SCALE_RANGE,
    ZERO_NOISE,
    build_preset,
    constant_saved_tensors,
    move_constant_tensors,
)

# The presets' own constant-moving, under the name the tests use.
perturb_constant_tensors = move_constant_tensors


def save_checkpoint(model, tokenizer, folder: Path) -> Path:
    """``save_pretrained`` of model and tokenizer, as a user's checkpoint folder."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


MULTIMODAL_PRESET = "tiny-gemma-4-multimodal"


def save_multimodal_checkpoint(folder: Path, tokenizer=None) -> Path:
    """The multimodal preset saved as a user's checkpoint folder, with its processor settings laid
    out like Google's (one ``processor_config.json``); ``tokenizer`` in place of the preset's."""
    model, preset_tokenizer = build_preset(MULTIMODAL_PRESET)
    save_checkpoint(model, tokenizer or preset_tokenizer, folder)
    (folder / "processor_config.json").write_text(json.dumps(PRESETS[MULTIMODAL_PRESET].processor_settings, indent=1))
    return folder


def perturbed_preset_checkpoint(name: str, folder: Path, seed: int = 0):
    """A preset's model with every constant saved tensor moved, saved to ``folder``; returns the
    model transformers loads back from it (the reference a user would compare with) and the
    tokenizer."""
    model, tokenizer = build_preset(name)
    moved = perturb_constant_tensors(model, seed)
    assert moved, f"{name}: init left no constant tensor to move?"
    save_checkpoint(model, tokenizer, folder)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return reloaded, tokenizer


@torch.no_grad()
def training_run_checkpoint(name: str, seed: int):
    """A preset's model as a checkpoint of a training run: every constant saved tensor moved (by
    ``seed``) and every parameter, matrices too, nudged by ``seed``'s noise."""
    model, tokenizer = build_preset(name)
    perturb_constant_tensors(model, seed)
    take_training_step(model, seed)
    return model, tokenizer


@torch.no_grad()
def take_training_step(model, seed: int) -> None:
    """What an optimizer step changes: every parameter (buffers, such as Gemma 4's layer_scalar, are
    not trained)."""
    generator = torch.Generator().manual_seed(1000 + seed)
    seen = set()
    for tensor in model.parameters():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            tensor.add_(torch.randn(tensor.shape, generator=generator) * 1e-2 * (tensor.std() if tensor.numel() > 1 else 1))
