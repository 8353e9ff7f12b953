"""gpt-oss: learned attention sinks through GroupQueryAttention's ``head_sink``, alternating sliding
and full layers, YaRN, and routed experts with biases and a clamped SwiGLU through ONNX Runtime's
``MoE`` (``QMoE`` at int4) on cpu; on webgpu ``QMoE`` at int4 (graph captured), and the experts
stay traced at fp16 (WebGPU's float ``MoE`` runs on the CPU).

The checkpoint is the ``tiny-gpt-oss`` preset with its constants moved (``perturb_constant_tensors``)
and, as trained weights have them, sinks of order 1 and biases off zero (init leaves them near zero,
where dropping them would go unseen), saved by ``save_pretrained``; packages are exported from the
folder (streamed) and from transformers' load of it in memory. The biases are drawn at the weights'
own scale (0.02): larger ones swamp this tiny model into repeating one token, where a greedy
comparison could not fail.
"""

from __future__ import annotations

import json
import shutil

import onnx
import pytest
import torch
import transformers
from onnx import helper
from safetensors.torch import load_file, save_file

from ep_profiles import get_profile
from exporter import ExporterError, export
from exporter.load.presets import build_preset
from tests.helpers.checkpoints import perturb_constant_tensors, save_checkpoint
from tests.helpers.generation import (
    LONG_PROMPT,
    PROMPT_LONGER_THAN_WINDOW,
    SHORT_PROMPT,
    genai_greedy,
    transformers_greedy,
)
from tests.helpers.parity import TOLERANCE, check_parity
from tests.helpers.webgpu import require_webgpu

PRESET = "tiny-gpt-oss"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, transformers' load of it, its tokenizer)."""
    model, tokenizer = build_preset(PRESET)
    perturb_constant_tensors(model, seed=3)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("sinks"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 2.0)
            elif "bias" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
    folder = save_checkpoint(model, tokenizer, tmp_path_factory.mktemp("gpt_oss") / "checkpoint")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, reloaded, tokenizer


@pytest.fixture(scope="module")
def packages(checkpoint, tmp_path_factory):
    folder, model, tokenizer = checkpoint
    root = tmp_path_factory.mktemp("gpt_oss_packages")
    return {"folder": export(str(folder), output_dir=root / "folder", strict=True, cache=False),
            "in memory": export(model, tokenizer, output_dir=root / "memory", cache=False)}


@pytest.mark.l1
@pytest.mark.parametrize("dropped", ["sinks", "bias"])
def test_sinks_and_biases_decide_the_logits(checkpoint, dropped):
    """The reference would show a dropped sink or bias: zeroing them moves its logits by far more
    than the parity tolerance (1e-4) that the L3 test holds the package to."""
    model = checkpoint[1]
    ids = torch.tensor([LONG_PROMPT])
    with torch.no_grad():
        want = model(ids).logits
        kept = {n: p.clone() for n, p in model.named_parameters() if n.endswith(dropped)}
        for name, parameter in model.named_parameters():
            if name in kept:
                parameter.zero_()
        without = model(ids).logits
        for name, parameter in model.named_parameters():
            if name in kept:
                parameter.copy_(kept[name])
    assert kept and torch.isfinite(want).all() and torch.isfinite(without).all()
    assert float((want - without).abs().max()) > 100 * TOLERANCE


@pytest.mark.l1
@pytest.mark.parametrize("source", ["folder", "in memory"])
def test_sinks_go_to_head_sink_and_experts_to_moe(packages, checkpoint, source):
    package = packages[source]
    attention = next(r for r in package.report.fx_passes if r["name"] == "substitute_group_query_attention")
    assert attention["changes"]["plain_layers"] == {} and attention["changes"]["attention_sink_layers"] == 4
    experts = next(r for r in package.report.fx_passes if r["name"] == "substitute_mixture_of_experts")
    assert experts["changes"]["substituted_layers"] == [0, 1, 2, 3] and experts["changes"]["plain_blocks"] == {}
    graph = onnx.load(str(package.model_path), load_external_data=False).graph
    attentions = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attentions) == 4 and all(len(n.input) == 12 and n.input[11] for n in attentions)  # head_sink
    assert len({n.input[11] for n in attentions}) == 4  # each layer's own sinks
    moe = [n for n in graph.node if n.op_type == "MoE"]
    assert len(moe) == 4 and all(len(n.input) == 6 and n.input[3] and n.input[5] for n in moe)  # both biases
    assert package.report.op_counts["com.microsoft.GroupQueryAttention"] == package.report.op_counts["com.microsoft.MoE"] == 4
    swiglu = {a.name: helper.get_attribute_value(a) for a in moe[0].attribute}
    assert swiglu["activation_type"] == b"swiglu" and swiglu["swiglu_fusion"] == 1
    assert swiglu["swiglu_limit"] == pytest.approx(checkpoint[1].config.swiglu_limit)
    assert (swiglu["activation_alpha"], swiglu["activation_beta"]) == (pytest.approx(1.702), 1.0)
    genai = json.loads((package.path / "genai_config.json").read_text())
    assert genai["model"]["type"] == "gptoss"  # the name ONNX Runtime GenAI lists (its builder's)
    assert genai["search"]["past_present_share_buffer"] is True  # every present written in place
    assert not any("does not list model type" in note for note in package.report.notes)


@pytest.mark.l3
@pytest.mark.parametrize("source", ["folder", "in memory"])
def test_logits_and_presents_match_transformers(packages, checkpoint, source):
    check_parity(packages[source], checkpoint[1])  # logits and every present within 1e-4, NaN failing


@pytest.mark.l4
@pytest.mark.parametrize("source", ["folder", "in memory"])
@pytest.mark.parametrize("prompts", [[PROMPT_LONGER_THAN_WINDOW], [LONG_PROMPT, SHORT_PROMPT]],
                         ids=["past-the-window", "uneven-batch"])
def test_genai_greedy_matches_transformers(packages, checkpoint, source, prompts):
    """The 8-token sliding layers: the prompt and the 32 new tokens go past the window."""
    expected = transformers_greedy(checkpoint[1], prompts, no_early_end=True)
    assert all(len(set(row)) > 2 for row in expected)  # tokens that a wrong package would not repeat
    assert genai_greedy(packages[source].path, prompts, no_early_end=True) == expected


# OCP microscaling FP4 (e2m1): the 16 codes' values, as gpt-oss's checkpoints store their experts.
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's MXFP4 form of an experts weight stored [experts, in, out]: per output row, blocks of
    32 inputs, each a power-of-two scale (uint8, exponent + 127) and 32 e2m1 codes, two per byte
    (low nibble first): blocks [experts, out, in / 32, 16], scales [experts, out, in / 32]."""
    rows = weight.transpose(1, 2).float()
    groups = rows.reshape(*rows.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-126) / 6.0))  # 6: e2m1's largest
    codes = ((groups / torch.exp2(exponent)[..., None])[..., None] - _E2M1).abs().argmin(-1).to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), (exponent + 127).to(torch.uint8).contiguous()


@pytest.mark.l3
def test_an_mxfp4_checkpoint_is_dequantized_by_transformers_quantizer_as_it_streams(checkpoint, tmp_path):
    """gpt-oss-20b's experts are saved as MXFP4 blocks and scales (``quantization_config``
    ``mxfp4``): the store runs transformers' own dequantizing converter per layer, as
    ``from_pretrained`` does on a machine without MXFP4 kernels, and the package computes what
    transformers' load of the folder computes."""
    folder = tmp_path / "mxfp4"
    shutil.copytree(checkpoint[0], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    experts = [key for key in tensors if key.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    for key in experts:
        tensors[key + "_blocks"], tensors[key + "_scales"] = _mxfp4(tensors.pop(key))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    dequantized = reloaded.model.layers[0].mlp.experts.gate_up_proj
    original = checkpoint[1].model.layers[0].mlp.experts.gate_up_proj
    assert not torch.equal(dequantized, original)  # FP4 rounding: the package must read the blocks
    assert torch.corrcoef(torch.stack([dequantized.flatten(), original.flatten()]))[0, 1] > 0.98  # the layout
    package = export(str(folder), output_dir=tmp_path / "out", strict=True, cache=False)
    assert any(note.startswith(f"{len(experts)} weights (") and "dequantized from the checkpoint's mxfp4 blocks"
               in note for note in package.report.notes), package.report.notes
    check_parity(package, reloaded)


@pytest.mark.l3
@pytest.mark.parametrize("source", ["folder", "in memory"])
def test_int4_experts_are_qmoe_with_their_biases_and_pass_check_against(checkpoint, source, tmp_path):
    """int4: the experts quantized into QMoE (their biases kept in float), and ``check --against``'s
    distribution check (KL, top-1, perplexity on prose against transformers fp32) passes."""
    from exporter.verify.check import check_package

    folder, model, tokenizer = checkpoint
    given = (str(folder),) if source == "folder" else (model, tokenizer)
    package = export(*given, precision="int4", output_dir=tmp_path / "int4", cache=False)
    graph = onnx.load(str(package.model_path), load_external_data=False).graph
    qmoe = [n for n in graph.node if n.op_type == "QMoE"]
    assert len(qmoe) == 4 and not any(n.op_type == "MoE" for n in graph.node)
    assert package.report.op_counts["com.microsoft.QMoE"] == package.report.op_counts[
        "com.microsoft.GroupQueryAttention"] == 4
    assert all(n.input[4] and n.input[7] for n in qmoe)  # fc1 and fc2 biases
    findings = {f.check: f for f in check_package(package.path, get_profile("cpu"), against=str(folder))}
    assert findings["source_distribution"].passed, findings["source_distribution"].detail


@pytest.mark.l1
def test_a_captured_webgpu_export_is_refused_in_one_line(checkpoint, tmp_path):
    """webgpu's float MoE runs on the CPU, so at fp16 (the default) the experts stay traced, and
    their routing reads shapes on the CPU, which graph capture cannot have. The refusal names the
    way out."""
    with pytest.raises(ExporterError, match=r"captures the decoder's graph, but \d+ nodes would run on the CPU .*"
                                            r"--no-graph-capture"):
        export(str(checkpoint[0]), ep="webgpu", output_dir=tmp_path / "out", cache=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.l5
def test_webgpu_fp16_matches_transformers_on_the_ep(checkpoint, tmp_path):
    """fp16 on ONNX Runtime's WebGPU EP (lavapipe), graph capture off: sinks through head_sink in
    the full layers and through the window attention in the sliding ones; ``check --ep webgpu
    --against`` compares the EP's logits and greedy tokens with transformers'."""
    from exporter.verify.check import check_package

    require_webgpu()
    folder = checkpoint[0]
    package = export(str(folder), ep="webgpu", precision="fp16", graph_capture=False, output_dir=tmp_path / "webgpu",
                     cache=False)
    attention = next(r for r in package.report.fx_passes if r["name"] == "substitute_group_query_attention")
    assert attention["changes"]["attention_sink_layers"] == 4 and attention["changes"]["window_mask_layers"] == 2
    findings = {f.check: f for f in check_package(package.path, get_profile("webgpu"), against=str(folder))}
    for name in ("ep_generation", "ep_source_logits", "ep_source_tokens"):
        assert findings[name].passed and not findings[name].skipped, findings[name].detail


@pytest.mark.l5
def test_webgpu_int4_runs_qmoe_on_the_ep_with_the_graph_captured(checkpoint, tmp_path):
    """int4 on WebGPU (lavapipe): the experts become QMoE, which the WebGPU plugin runs (biases and
    the clamped SwiGLU included), taking [batch, seq, hidden] so no shape work is left on the CPU:
    every node on the EP, the graph captured, and ``check --against`` holds the EP's distribution
    to transformers' (the int4 rule)."""
    from exporter.verify.check import check_package

    require_webgpu()
    folder = checkpoint[0]
    package = export(str(folder), ep="webgpu", precision="int4", output_dir=tmp_path / "webgpu", cache=False)
    assert package.report.op_counts.get("com.microsoft.QMoE") == package.layout.experts_modules > 0
    assert json.loads((package.path / "genai_config.json").read_text())["model"]["decoder"]["session_options"][
        "provider_options"][0]["webgpu"]["enableGraphCapture"] == "1"
    findings = {f.check: f for f in check_package(package.path, get_profile("webgpu"), against=str(folder))}
    assert "all" in findings["session"].detail and "WebGpuExecutionProvider" in findings["session"].detail
    for name in ("graph_capture", "ep_generation", "ep_source_distribution", "ep_source_tokens"):
        assert findings[name].passed and not findings[name].skipped, findings[name].detail
