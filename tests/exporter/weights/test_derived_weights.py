"""A replay makes converted, cut and transposed weights with numpy: its bytes must be torch's for
every value but a NaN (subnormals, values past fp16's range, signed zeros, infinities), and a NaN
converted, where torch's bytes are not numpy's (nor one thing), must be refused, except from bf16
to fp32, which shifts the bits in both."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from exporter.weights.derived_weights import NotRepeatable, derived_chunks, derived_length
from exporter.weights.safetensors_header import read_header

pytestmark = [pytest.mark.l1, pytest.mark.unit]

SAFETENSORS_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def awkward_values(count: int) -> torch.Tensor:
    """``count`` fp32 values over fp32's exponent range, the edges of fp16's and bf16's among them."""
    edges = torch.tensor([65504.0, 65519.99, 65520.0, -65536.0, 6e-8, 3e-8, 2.9e-8, 1e-8, 0.0, -0.0,
                          float("inf"), float("-inf"), 1e-40, -3e38, 3.4e38])
    generator = torch.Generator().manual_seed(0)
    scales = torch.pow(10.0, torch.randint(-12, 10, (count - len(edges),), generator=generator).float())
    return torch.cat([torch.randn(count - len(edges), generator=generator) * scales, edges])


def made(tmp_path, stored: torch.Tensor, derive: dict) -> bytes:
    save_file({"w": stored.contiguous()}, tmp_path / "w.safetensors")
    data_start, header = read_header(tmp_path / "w.safetensors")
    entry = header["w"]
    with open(tmp_path / "w.safetensors", "rb") as file:
        data = b"".join(chunk.tobytes() for chunk in derived_chunks(file, data_start, entry, derive))
    assert len(data) == derived_length(entry, derive)
    return data


@pytest.mark.parametrize("stored_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("made_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_conversions_are_torchs_bit_for_bit(tmp_path, stored_dtype, made_dtype):
    stored = awkward_values(1 << 16).to(stored_dtype).reshape(256, 256)
    derive = {"index": None, "to": SAFETENSORS_NAMES[made_dtype], "steps": []}
    assert made(tmp_path, stored, derive) == stored.to(made_dtype).contiguous().view(torch.uint8).numpy().tobytes()


def test_a_cut_a_transpose_and_casts_are_applied_in_order(tmp_path):
    """The pieces a split makes (a cut along any axis), a folded transpose and the casts
    ``onnx_passes.weight_folds`` folds: fp32 stored, fp16 in the package, cast to fp32 (the
    fp16 rounding stays), then a reshape."""
    stored = awkward_values(96 * 40).reshape(96, 40)
    derive = {"index": [[0, 96], [8, 24]], "to": "F16", "steps": [["transpose", [1, 0]], ["cast", "F32"],
                                                                    ["reshape", [4, 4, 96]]]}
    expected = stored[:, 8:24].to(torch.float16).T.to(torch.float32).reshape(4, 4, 96)
    assert made(tmp_path, stored, derive) == expected.contiguous().view(torch.uint8).numpy().tobytes()


def test_a_table_larger_than_a_chunk_is_made_in_pieces(tmp_path, monkeypatch):
    from exporter.weights import derived_weights

    monkeypatch.setattr(derived_weights, "_CHUNK_BYTES", 1000)
    stored = awkward_values(300 * 7).reshape(300, 7).to(torch.bfloat16)
    derive = {"index": [[13, 290]], "to": "F32", "steps": []}
    assert made(tmp_path, stored, derive) == stored[13:290].to(torch.float32).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(("stored_dtype", "made_dtype"), [
    (torch.float32, torch.float16), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16),
    (torch.float16, torch.bfloat16), (torch.float16, torch.float32)])
def test_a_nan_converted_is_refused(tmp_path, stored_dtype, made_dtype):
    """fp16 to fp32 too: torch's scalar path makes 0x7fffffff of fp16's 0x7e00, numpy 0x7fc00000."""
    stored = torch.tensor([1.0, float("nan"), 2.0]).to(stored_dtype)
    with pytest.raises(NotRepeatable, match="NaN"):
        made(tmp_path, stored, {"index": None, "to": SAFETENSORS_NAMES[made_dtype], "steps": []})


def test_a_nan_kept_or_shifted_from_bf16_to_fp32_is_torchs(tmp_path):
    stored = torch.tensor([1.0, float("nan"), -float("nan"), 2.0] * 5).to(torch.bfloat16)
    for made_dtype in (torch.bfloat16, torch.float32):
        derive = {"index": None, "to": SAFETENSORS_NAMES[made_dtype], "steps": []}
        assert made(tmp_path, stored, derive) == stored.to(made_dtype).view(torch.uint8).numpy().tobytes()


def test_a_cut_outside_the_tensor_has_no_length():
    entry = {"dtype": "F32", "shape": [4, 6], "data_offsets": [0, 96]}
    assert derived_length(entry, {"index": [[1, 3], [0, 6]], "to": "F16", "steps": [["cast", "F32"]]}) == 2 * 6 * 4
    with pytest.raises(ValueError):
        derived_length(entry, {"index": [[0, 5]], "to": "F16", "steps": []})
