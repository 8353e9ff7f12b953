"""The 35-layer gemma-4-e2b-shape preset end to end, from its test checkpoint folder (slow: about
2 minutes on 2 cores)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from exporter.trace.decoder import GenAIDecoder, input_names, make_inputs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def e2b_shape(preset_exports):
    return preset_exports.get("gemma-4-e2b-shape")


@pytest.mark.l1
def test_report_shows_truncation_at_layer_15(e2b_shape):
    assert (
        "prefill truncation at layer 15 of 35: 20 layers (15-34, KV-shared) run on the last token only, "
        "saving 20 layer-rows for every prompt token but the last (10220 for a 512-token prompt); "
        "the part of layer 14 that feeds no KV cache runs on it too"
    ) in e2b_shape.package.report.notes
    # cpu: the 15 cache owners keep GroupQueryAttention; the 20 KV-shared layers, on one query per
    # row, are MatMul/Softmax over their owner's cache.
    report = e2b_shape.package.report
    assert report.op_counts["com.microsoft.GroupQueryAttention"] == 15
    assert report.onnx_pass_changes("matmul_kv_shared_attention") == {"layers": 20}


@pytest.mark.l1
def test_layout_matches_e2b_kv_sharing(e2b_shape):
    layout = e2b_shape.package.layout
    assert layout.num_layers == 35
    assert layout.kv_layer_indices == tuple(range(15))
    assert layout.shared_layer_indices == tuple(range(15, 35))
    full_layers = {4, 9, 14}
    assert all(k.head_dim == (512 if k.index in full_layers else 256) for k in layout.kv_layers)
    assert all(k.num_kv_heads == 1 for k in layout.kv_layers)


@pytest.mark.l3
def test_onnx_runtime_matches_pytorch(e2b_shape):
    layout = e2b_shape.package.layout
    session = ort.InferenceSession(str(e2b_shape.package.model_path), providers=["CPUExecutionProvider"])
    reference = GenAIDecoder(e2b_shape.model, layout).eval()
    generator = torch.Generator().manual_seed(0)
    for batch, seq, past in [(1, 16, 0), (2, 1, 24)]:
        inputs = make_inputs(layout, batch, seq, past, generator=generator)
        with torch.no_grad():
            expected = [t.numpy() for t in reference(*inputs)]
        expected[0] = expected[0][:, -1:]  # generation package: the last token's logits (no padding here)
        feeds = dict(zip(input_names(layout), [t.numpy() for t in (*inputs[:3], *inputs[3])], strict=True))
        for got, want in zip(session.run(None, feeds), expected, strict=True):
            assert got.shape == want.shape
            assert float(np.max(np.abs(got - want))) <= 1e-4


@pytest.mark.l3
@pytest.mark.l4
def test_check_against_its_checkpoint(e2b_shape, capsys):
    """`check --against` at 35 layers: the package (from the checkpoint folder) against
    transformers' load of the folder."""
    from exporter.cli import main

    assert main(["check", str(e2b_shape.package.path), "--against", str(e2b_shape.checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "PASS  source_logits" in out and "PASS  source_tokens" in out


@pytest.mark.l5
@pytest.mark.xdist_group("webgpu")
def test_random_weights_int4_webgpu_package_passes_check(tmp_path, capsys):
    """The full-size path (`gemma-4-e2b --random-weights --precision int4 --ep webgpu`) at reduced
    width: empty parameters traced, weights drawn as the package is written, 4-bit weights, then
    `check --ep webgpu` (buffer limit, placement under graph capture, generation)."""
    import json

    from exporter.cli import main
    from tests.helpers.webgpu import require_webgpu

    require_webgpu()
    out = tmp_path / "e2b-shape-int4"
    assert main(["gemma-4-e2b-shape", "--random-weights", "--ep", "webgpu", "--precision", "int4", "-o", str(out)]) == 0
    report = json.loads((out / "export_report.json").read_text())
    assert any(note.startswith("prefill truncation at layer 15 of 35") for note in report["notes"])
    assert any("written one at a time (never all in memory) from random weights" in note for note in report["notes"])
    # Sliding layers' attention is the windowed marker on WebGPU (its GroupQueryAttention ignores
    # the window); GroupQueryAttention writes the 15 caches and runs the full layers.
    decoder = report["sessions"]["decoder"]
    assert decoder["op_counts"]["com.microsoft.GroupQueryAttention"] == 19
    quantization = next(p["changes"] for p in decoder["onnx_passes"] if p["name"] == "quantize_weights")
    assert quantization["tables_shared_with_lm_head"] == 1
    capsys.readouterr()
    assert main(["check", str(out), "--ep", "webgpu"]) == 0
    assert "nodes run on WebGpuExecutionProvider" in capsys.readouterr().out
