"""Weights over the profile's buffer limit are split; results stay identical (L2 in PyTorch, L3/L4
through the package)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime_genai as og
import pytest
import torch

from ep_profiles import get_profile
from exporter import export
from exporter.load.layout import derive_layout
from exporter.load.presets import build_preset
from exporter.trace.decoder import make_inputs, trace
from exporter.verify.check import check_package
from fx_passes import FX_PASSES, run_fx_passes
from fx_passes.analyses.graph_facts import PassDidNotApply
from fx_passes.split_oversized_weights import piece_bounds
from tests.helpers.plan_settings import DECODER, pass_settings

LIMIT = 64 * 1024  # tiny-gemma-4's per-layer table is 320 KiB in fp32, its tied embedding 128 KiB
PROFILE = dataclasses.replace(get_profile("cpu"), name="cpu-64k", max_buffer_size=LIMIT)


@pytest.mark.l1
def test_piece_bounds_prefer_layer_boundaries():
    # 10 layers x 16 columns, 512 rows of 4 bytes: 32 columns fit, i.e. two layers a piece
    assert piece_bounds(160, 512, 4, LIMIT, multiple_of=16) == [(0, 32), (32, 64), (64, 96), (96, 128), (128, 160)]
    assert piece_bounds(512, 64, 4, LIMIT) == [(0, 256), (256, 512)]
    with pytest.raises(PassDidNotApply, match="already exceeds"):
        piece_bounds(10, 100_000, 4, LIMIT)


@pytest.mark.l2
def test_split_keeps_results_exactly():
    model, _ = build_preset("tiny-gemma-4")
    layout = derive_layout(model)
    program, _ = trace(model, layout)
    generator = torch.Generator().manual_seed(0)
    cases = [make_inputs(layout, 2, 5, 3, generator=generator), make_inputs(layout, 1, 1, 9, generator=generator)]
    with torch.no_grad():
        before = [program.module()(*inputs) for inputs in cases]
    settings = pass_settings(PROFILE, layout)
    program, records = run_fx_passes(program, [FX_PASSES["split_oversized_weights"]], settings, DECODER)
    # tied embedding / LM head (one parameter, two uses) and the per-layer table
    assert records[0].changes == {"weights_split": 2, "pieces": 2 + 2 + 5}
    assert max(t.numel() * 4 for t in program.state_dict.values()) <= LIMIT
    with torch.no_grad():
        for inputs, expected in zip(cases, before, strict=True):
            for got, want in zip(program.module()(*inputs), expected, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.l3
@pytest.mark.l4
def test_split_package_fits_and_generates_the_same(preset_exports, tmp_path):
    reference = preset_exports.get("tiny-gemma-4")
    package = export(reference.model, reference.tokenizer, ep=PROFILE, output_dir=tmp_path / "split")
    initializers = onnx.load(str(package.model_path)).graph.initializer
    assert max(onnx.numpy_helper.to_array(t).nbytes for t in initializers) <= LIMIT
    findings = {f.check: f for f in check_package(package.path, PROFILE)}
    assert all(f.passed for f in findings.values()), findings
    assert findings["buffer_limit"].detail.endswith("(limit 64.0 KiB)")

    def greedy(path):
        model = og.Model(str(path))
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=40, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(np.array([[2, 37, 101, 250, 7, 311]], dtype=np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        return generator.get_sequence(0).tolist()

    assert greedy(package.path) == greedy(reference.package.path)
