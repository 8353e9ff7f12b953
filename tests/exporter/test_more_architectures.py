"""What the newer families needed from the exporter, beyond the L3/L4 family tests: checkpoints in
the form transformers converts on load, experts switched to a traceable implementation and back,
Gemma 3n's in-place AltUp writes and constant erfinv, and errors that name the exporter's step."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from test_parity import check_parity

from ep_profiles import get_profile
from exporter import ExporterError, export
from exporter.cli import main
from exporter.presets import build_preset
from exporter.trace import input_names, make_inputs

pytestmark = pytest.mark.l1


def test_a_mixtral_checkpoint_is_read_through_transformers_conversions(preset_exports, tmp_path):
    """save_pretrained writes Mixtral's experts one tensor per expert under ``block_sparse_moe``;
    the model holds them fused (``mlp.experts.gate_up_proj``). Every key is read, none is left over."""
    checkpoint = preset_exports.checkpoint("tiny-mixtral")
    with safe_open(str(checkpoint.folder / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in keys
    assert not any(".mlp.experts.gate_up_proj" in key for key in keys)
    package = export(str(checkpoint.folder), output_dir=tmp_path / "out", strict=True)
    assert not any(note.startswith("checkpoint tensors") for note in package.report.notes), package.report.notes


def test_a_misshapen_tensor_of_a_converted_group_is_an_error_before_tracing(preset_exports, tmp_path, monkeypatch):
    checkpoint = preset_exports.checkpoint("tiny-qwen3-moe")
    folder = tmp_path / "edited"
    shutil.copytree(checkpoint.folder, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    key = "model.layers.1.mlp.experts.2.up_proj.weight"
    tensors[key] = tensors[key][:16]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setattr("exporter.pipeline._export_session", lambda *a, **k: pytest.fail("traced"))
    with pytest.raises(ExporterError, match=r"transformers' conversion of checkpoint tensors \[.*\] \.\.\. into "
                                            r"'model.layers.1.mlp.experts.gate_up_proj' failed \(stack expects"):
        export(str(folder), output_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_in_memory_model_keeps_its_experts_implementation(tmp_path):
    model, tokenizer = build_preset("tiny-qwen3-moe")
    before = model.get_experts_implementation()
    export(model, tokenizer, output_dir=tmp_path / "out")
    assert model.get_experts_implementation() == before


def test_gemma_3n_is_truncated_and_its_constant_erfinv_folded(preset_exports):
    report = preset_exports.get("tiny-gemma-3n").package.report
    truncation = _fx_changes(report, "truncate_shared_kv_layers")
    assert truncation["layers_on_last_token"] == 2 and truncation["first_truncated_layer"] <= 4
    # Activation sparsity in the first two layers: one normal quantile each, computed at export.
    assert _fx_changes(report, "fold_untranslatable_constants")["folded"] == 2
    assert "Erf" not in report.op_counts


def test_a_failing_layout_probe_names_the_exporter_step_not_the_model(monkeypatch, tmp_path, capsys):
    def broken(model):
        raise RuntimeError("Expected inputs of BF16 type")

    monkeypatch.setattr("exporter.prepare.derive_layout", broken)
    assert main(["tiny-llama", "-o", str(tmp_path / "out")]) == 1
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "the exporter's layout probe failed" in message and "Expected inputs of BF16 type" in message
    assert "only decoder" not in message and "please report" in message
    assert not (tmp_path / "out").exists()


@torch.no_grad()
def test_the_shared_kv_region_sees_in_place_writes():
    """Gemma 3n's decoder layer writes into a slice of its AltUp stack (``copy_`` with no users):
    the truncation's dataflow must count such a write as feeding whatever reads the stack."""
    from exporter.layout import derive_layout
    from exporter.trace import trace
    from fx_passes.graph_facts import ancestors, graph_outputs

    model, _ = build_preset("tiny-gemma-3n")
    program, _ = trace(model, derive_layout(model))
    writes = [n for n in program.graph.nodes if n.target is torch.ops.aten.copy_.default]
    assert writes and all(not n.users for n in writes)
    logits_ancestors = ancestors(graph_outputs(program)[:1])
    assert all(n in logits_ancestors for n in writes)


@pytest.mark.l3
@pytest.mark.l4
@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_fused_and_plain_packages_agree(preset_exports, tmp_path, precision):
    """ONNX Runtime's MoE against the plain form (a CPU profile without it): at fp32 both match
    PyTorch (L3); at int4, where the other linear layers are 4-bit and the experts fp32 in both,
    they match each other to fp32 tolerance, and the fused package's greedy tokens follow
    transformers' (L4)."""
    exported = preset_exports.get("tiny-qwen3-moe")
    plain_cpu = dataclasses.replace(get_profile("cpu"), mixture_of_experts_precisions=())
    packages = {}
    for fused, profile in ((True, get_profile("cpu")), (False, plain_cpu)):
        package = export(str(exported.checkpoint), ep=profile, precision=precision,
                         output_dir=tmp_path / f"{precision}-{'fused' if fused else 'plain'}")
        assert package.report.op_counts.get("com.microsoft.MoE", 0) == (3 if fused else 0)
        packages[fused] = package
        if precision == "fp32":
            check_parity(package, exported.model)
    if precision == "int4":
        layout = packages[True].layout
        generator = torch.Generator().manual_seed(0)
        for batch, seq, past in ((1, 7, 0), (2, 1, 9)):
            inputs = make_inputs(layout, batch, seq, past, generator=generator)
            feeds = dict(zip(input_names(layout), [t.numpy() for t in (*inputs[:3], *inputs[3])], strict=True))
            fused_out, plain_out = (ort.InferenceSession(str(packages[f].model_path)).run(None, feeds)
                                    for f in (True, False))
            for got, want in zip(fused_out, plain_out, strict=True):
                np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
        # L4 for the int4 package with the MoE op: check's greedy comparison with transformers fp32
        # (every token transformers' best, or within int4's near-tie bound of it).
        assert main(["check", str(packages[True].path), "--against", str(exported.checkpoint)]) == 0


def _fx_changes(report, name: str) -> dict:
    return next(p["changes"] for p in report.fx_passes if p["name"] == name)


def test_a_captured_export_with_a_layer_group_query_attention_cannot_take_is_refused(tmp_path, capsys):
    """Llama 4's chunked layers keep plain attention; WebGPU captures the decoder, which needs
    GroupQueryAttention writing every present in place: a one-line error naming the layers and the way out."""
    assert main(["tiny-llama4", "--ep", "webgpu", "-o", str(tmp_path / "out")]) == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("error: EP 'webgpu' captures the decoder's graph")
    assert "layers 0, 1, 2: mask" in message and "--no-graph-capture" in message
    assert not (tmp_path / "out").exists()
