"""Test checkpoints that cannot hide a dropped tensor.

A model fresh from init holds many saved tensors at a constant (norm weights at 1 or 0, biases at 0,
Gemma 4's ``layer_scalar`` at 1). An exporter that drops or re-initialises such a tensor gets the
same constant back and passes every test. So every checkpoint the suite builds moves each saved
tensor that init left constant away from that constant, then goes through ``save_pretrained`` and
is read back the way a user's is.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from exporter.presets import build_preset

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
def perturb_constant_tensors(model: torch.nn.Module, seed: int = 0) -> list[str]:
    """Move every constant saved tensor away from its constant, in place; returns their names.
    Tied tensors (one storage under several names) are moved once."""
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
            noise = torch.randn(tensor.shape, generator=generator) * ZERO_NOISE
            tensor.add_(noise.to(tensor.dtype))
        else:
            low, high = SCALE_RANGE
            factor = low + (high - low) * torch.rand(tensor.shape, generator=generator)
            tensor.mul_(factor.to(tensor.dtype))
        assert not bool((tensor == before).any()), f"{name}: an element kept its init value"
        moved.append(name)
    return moved


def save_checkpoint(model, tokenizer, folder: Path) -> Path:
    """``save_pretrained`` of model and tokenizer, as a user's checkpoint folder."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
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
