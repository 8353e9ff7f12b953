"""fp16 packages of checkpoints whose float32 residual stream passes fp16's range (65504), as a real
Gemma 3 270M's does (104,000): the export measures the peaks, scales the stream by a power of two
(``onnx_passes.scale_residual_stream``) and the package gives transformers fp32's tokens; an fp16
package with non-finite logits on its sample prompt is never written.

Each test checkpoint is a family's preset with its constants moved (``tests.helpers.checkpoints``), then
what each layer writes into the stream multiplied until the float32 stream peaks past 2 x 65504:
Gemma's post-norm scales (its layers end in a norm), other families' value, output, up and down
projections (each weight and each value inside a block stays inside fp16). Its
logits stay finite in float32, since the final norm is scale-free; transformers in fp16 gives NaN.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from exporter import Int4Options, export
from exporter.errors import ExporterError
from exporter.load import activation_ranges
from exporter.load.activation_ranges import FP16_MAX, decoder_layers, measure
from exporter.precisions import PRECISIONS
from exporter.verify.check import check_package
from exporter.verify.check_against import compare_with_source
from tests.helpers.checkpoints import perturbed_preset_checkpoint, save_checkpoint
from tests.helpers.webgpu import WEBGPU, require_webgpu

# Families whose stream the pass scales whole (webgpu packages, graph-captured).
FAMILIES = ("tiny-gemma-4", "tiny-gemma2", "tiny-llama", "tiny-qwen3")
TARGET_PEAK = 2 * FP16_MAX
PROMPT = "The capital of France is"


def _effective_scale(norm: torch.nn.Module, width: int) -> torch.Tensor:
    return norm(torch.ones(1, 1, width)).reshape(-1)


@torch.no_grad()
def _amplify(model, tokenizer) -> float:
    """Multiply what each decoder layer writes into the residual stream until its float32 peak
    passes TARGET_PEAK; returns the peak. Post-norms where a layer has them (their effective scale,
    whether stored as w or 1 + w), else the value and output projections of attention and the up
    and down projections of the MLP."""
    base = model.base_model
    layers = decoder_layers(base)
    writers = []
    for layer in layers:
        children = dict(layer.named_children())
        # Gemma's sandwich: a pre- and a post-norm around each block (Llama's "post_attention_layernorm"
        # is the MLP's input norm).
        post_norms = ([children[n] for n in ("post_attention_layernorm", "post_feedforward_layernorm")]
                      if "pre_feedforward_layernorm" in children else [])
        if post_norms:
            writers += [("norm", m) for m in post_norms]
        else:
            # Spread over two matrices per block, so that each weight and each value inside the block stays
            # well inside fp16 (as in a real checkpoint) and only the stream's sum passes it.
            writers += [("linear", m) for name, m in layer.named_modules()
                        if name.endswith(("v_proj", "o_proj", "up_proj", "down_proj"))]
    assert writers, f"{type(model).__name__}: no layer output to amplify"
    for _ in range(12):
        peak = measure(model, model, tokenizer, None).residual_peak
        if peak > TARGET_PEAK:
            return peak
        for kind, module in writers:
            if kind == "linear":
                module.weight.mul_(2.0)  # two per block: its output times 4
                continue
            factor = 4.0
            width = module.weight.shape[-1]
            before = _effective_scale(module, width)
            module.weight.mul_(factor)
            if not torch.allclose(_effective_scale(module, width), before * factor, rtol=1e-3):
                module.weight.div_(factor).add_(1).mul_(factor).sub_(1)  # stored as 1 + w
            assert torch.allclose(_effective_scale(module, width), before * factor, rtol=1e-3)
    raise AssertionError(f"{type(model).__name__}: the residual peak stayed at {peak}")


@pytest.fixture(scope="module")
def past_fp16(tmp_path_factory):
    """family -> (checkpoint folder, float32 residual peak), built on first use."""
    built = {}

    def get(name: str):
        if name not in built:
            folder = tmp_path_factory.mktemp(f"{name}-past-fp16")
            model, tokenizer = perturbed_preset_checkpoint(name, folder)
            peak = _amplify(model, tokenizer)
            save_checkpoint(model, tokenizer, folder)
            built[name] = folder, peak
        return built[name]

    return get


@pytest.mark.l2
@pytest.mark.parametrize("name", FAMILIES)
def test_transformers_fp16_overflows_on_the_test_checkpoint(past_fp16, name):
    """The checkpoint is a real test: transformers itself is NaN in fp16, finite in float32."""
    folder, peak = past_fp16(name)
    assert peak > TARGET_PEAK
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    logits = {}
    for dtype in (torch.float32, torch.float16):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        with torch.no_grad():
            logits[dtype] = model(ids).logits.float().numpy()
    assert np.isfinite(logits[torch.float32]).all()
    assert not np.isfinite(logits[torch.float16]).all()


@pytest.mark.l4
@pytest.mark.parametrize("name,precision", [*((name, "fp16") for name in FAMILIES), ("tiny-gemma-4", "int4"),
                                            ("tiny-llama", "int4"), ("tiny-llama", "int4-awq"), ("tiny-llama", "int8")])
def test_half_precision_package_past_fp16_range_gives_fp32_tokens(past_fp16, tmp_path, name, precision):
    """webgpu fp16, int4 and int8 (fp16 activations), run by ONNX Runtime GenAI on the CPU EP:
    transformers fp32's tokens and logits within the precision's tolerance (int4, int8: its
    distribution within the precision's bounds), finite. int4-awq: AWQ's inputs divided by their
    scales in fp16, on projections whose inputs the amplification made large."""
    folder, peak = past_fp16(name)
    method = "awq" if precision == "int4-awq" else None
    precision = precision.removesuffix("-awq")
    int4 = Int4Options(method=method) if method else None
    package = export(str(folder), ep="webgpu", precision=precision, int4=int4, output_dir=tmp_path / "pkg")
    if method:
        assert package.report.onnx_pass_changes("quantize_weights")["awq_scaled"] > 0
    ranges = package.report.activation_ranges
    # The export's calibration streams the folder's weights a layer at a time; the fixture measured
    # the whole model in memory.
    assert ranges["residual_peak"] == pytest.approx(peak, rel=1e-3)
    assert ranges["residual_peak"] * 2.0 ** -ranges["residual_exponent"] * activation_ranges.HEADROOM <= FP16_MAX
    changes = package.report.onnx_pass_changes("scale_residual_stream")
    assert changes["exponent"] == ranges["residual_exponent"] >= 2
    assert changes["norms_rescaled"] >= 2 * package.layout.num_layers  # every layer's input norms, and the final
    assert changes.get("unscaled_reads", 0) == 0
    assert not [note for note in package.report.notes if note.startswith("fp16 range")]
    assert np.isfinite(package.report.sample_prefill["max_abs_logit"])
    results = {check: (passed, detail) for check, passed, detail in compare_with_source(package.path, folder,
                                                                                          precision)}
    # A quantized package is judged by its distribution (exporter.verify.check_against).
    first = "source_distribution" if PRECISIONS[precision].distribution else "source_logits"
    assert results[first][0], results[first][1]
    assert results["source_tokens"][0], results["source_tokens"][1]


@pytest.mark.l5
def test_webgpu_runs_the_scaled_package_as_the_cpu_does(past_fp16, tmp_path):
    """On the WebGPU EP (lavapipe), graph captured: every check passes, the EP's tokens are the
    CPU's and transformers fp32's."""
    require_webgpu()
    folder, _ = past_fp16("tiny-gemma-4")
    package = export(str(folder), ep="webgpu", output_dir=tmp_path / "pkg")
    findings = {f.check: f for f in check_package(package.path, WEBGPU, against=str(folder))}
    failed = [f"{f.check}: {f.detail}" for f in findings.values() if not f.passed and not f.skipped]
    assert not failed, failed
    assert not findings["ep_generation"].skipped


@pytest.mark.l4
def test_export_refuses_an_fp16_package_with_nonfinite_logits(past_fp16, tmp_path, monkeypatch):
    """Without the scale (as if calibration had missed the peak) the package's sample prefill is
    NaN: the export fails naming the session, the step and the counts, and writes nothing."""
    folder, _ = past_fp16("tiny-llama")
    monkeypatch.setattr(activation_ranges.ActivationRanges, "residual_exponent", property(lambda self: 0))
    with pytest.raises(ExporterError, match=r"decoder's logits are not finite .* at step 0 \(prefill\).*NaN"):
        export(str(folder), ep="webgpu", output_dir=tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.l4
def test_gemma_3n_past_fp16_range_is_refused_not_written(past_fp16, tmp_path):
    """Gemma 3n's AltUp keeps four streams mixed by computed coefficients and rescaled by their RMS
    (a Pow in the model's dtype): the pass cannot scale them as one stream, so its fp16 package is
    NaN, and the export says so instead of writing it (the limit this test records)."""
    folder, _ = past_fp16("tiny-gemma-3n")
    with pytest.raises(ExporterError, match=r"decoder's logits are not finite .* at step 0 \(prefill\)"):
        export(str(folder), ep="webgpu", output_dir=tmp_path / "pkg", graph_capture=False)
    assert not (tmp_path / "pkg").exists()


@pytest.mark.l1
def test_the_report_says_where_an_fp16_package_may_still_overflow():
    from exporter.load.activation_ranges import ActivationRanges, risk_notes

    def ranges(layer_peak, other_peak):
        return ActivationRanges([layer_peak] * 4, 1.0, other_peak, "layers.3.mlp.act_fn", prompts=4)

    whole = {"exponent": 5, "norms_rescaled": 9}
    assert risk_notes(ranges(138_000, 30_000), whole, num_layers=4) == []
    assert risk_notes(None, {}, num_layers=4) == []  # not fp16 activations
    (note,) = risk_notes("running the decoder ... raised ValueError: x", {}, num_layers=4)
    assert note.startswith("fp16 range not measured")
    (note,) = risk_notes(ranges(138_000, 30_000), {"exponent": 5, "norms_rescaled": 1}, num_layers=4)
    assert "scaled only in part (1 norms for 4 layers" in note
    (note,) = risk_notes(ranges(138_000, 30_000), {**whole, "unscaled_half_reads": 2}, num_layers=4)
    assert "2 half-precision reads left unscaled" in note
    assert risk_notes(ranges(5_000, 30_000), {"exponent": 0}, num_layers=4) == []  # nothing to scale


@pytest.mark.l1
def test_sensitive_layers_are_found_through_the_residual_scale(past_fp16, tmp_path):
    """The residual scale wraps Llama's down projections in a scaled lazy weight; the 8-bit roles
    still find them by their checkpoint names (the first version lost them silently)."""
    from exporter.int4_options import Int4Options

    folder, _ = past_fp16("tiny-llama")
    sensitive = Int4Options(eight_bit=("sensitive_layers",))
    scaled = export(str(folder), ep="webgpu", precision="int4", int4=sensitive, output_dir=tmp_path / "webgpu")
    assert scaled.report.onnx_pass_changes("scale_residual_stream")["exponent"] > 0
    unscaled = export(str(folder), ep="cpu", precision="int4", int4=sensitive, output_dir=tmp_path / "cpu")
    counts = [p.report.onnx_pass_changes("quantize_weights")["eight_bit_sensitive_layers"] for p in (scaled, unscaled)]
    assert counts == [4, 4]  # layers 2 and 3 of 4: value and down projections


@pytest.mark.l1
def test_a_table_whose_padding_row_is_past_the_prompts_rows_is_measured():
    """Qwen2's embedding keeps ``padding_idx`` (the real 0.5B's pad token, 151643). The run swaps in
    only the prompts' rows, and torch asserts the padding index lies within the table, so the
    index is lifted for the lookup (it only stops gradients) and put back after: the peaks equal
    those of the model without a padding row."""
    from exporter.load.presets import build_preset

    model, tokenizer = build_preset("tiny-qwen3")
    embedding = model.get_input_embeddings()
    plain = measure(model, model, tokenizer, None)
    embedding.padding_idx = embedding.num_embeddings - 1
    padded = measure(model, model, tokenizer, None)
    assert embedding.padding_idx == embedding.num_embeddings - 1
    assert padded.layer_peaks == plain.layer_peaks and np.isfinite(padded.layer_peaks).all()
