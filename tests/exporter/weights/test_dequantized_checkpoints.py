"""Pre-quantized checkpoints transformers dequantizes on load: the store runs transformers' own
quantizer converters one tensor group at a time (gpt-oss's MXFP4 experts: tests/exporter/test_gpt_oss.py)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from exporter import export
from exporter.load.presets import build_preset, move_constant_tensors
from tests.helpers.checkpoints import save_checkpoint
from tests.helpers.parity import check_parity

BLOCK = 16  # the tiny model's widths (64, 128) are multiples of it; real checkpoints use 128


def _fine_grained_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' fine-grained FP8 form (DeepSeek-V3's, Qwen3's FP8 releases): float8_e4m3fn
    values and, per BLOCK x BLOCK tile, the float32 scale that multiplies them back
    (``weight_scale_inv``)."""
    rows, columns = weight.shape
    tiles = weight.float().reshape(rows // BLOCK, BLOCK, columns // BLOCK, BLOCK)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    values = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(rows, columns)
    return values, scale


@pytest.mark.l3
def test_a_fine_grained_fp8_checkpoint_matches_transformers_load_of_it(tmp_path):
    model, tokenizer = build_preset("tiny-llama")
    move_constant_tensors(model, 3)
    folder = save_checkpoint(model, tokenizer, tmp_path / "checkpoint")
    tensors = load_file(str(folder / "model.safetensors"))
    projections = [key for key in tensors if key.endswith("proj.weight")]
    for key in projections:
        tensors[key], tensors[key.removesuffix("weight") + "weight_scale_inv"] = _fine_grained_fp8(tensors[key])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK],
                                     "activation_scheme": "dynamic"}
    (folder / "config.json").write_text(json.dumps(config))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    original, dequantized = model.model.layers[0].self_attn.q_proj.weight, reloaded.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(dequantized, original)  # FP8's rounding shows: the package must read values and scales
    # e4m3 keeps 3 mantissa bits: within 1/16 of each tile's largest magnitude (a misread scale is far off)
    assert (dequantized - original).abs().max() <= original.abs().max() / 16
    package = export(str(folder), output_dir=tmp_path / "out", strict=True, cache=False)
    assert any(note.startswith(f"{len(projections)} weights (") and "from the checkpoint's fp8 blocks" in note
               for note in package.report.notes), package.report.notes
    check_parity(package, reloaded)
