"""fp16, bf16, int4 and int8 packages: structure (L1), logit error against PyTorch fp32 (L3), greedy
continuations against transformers fp32 (L4 on the CPU EP, L5 on WebGPU).

Accuracy is measured on a tiny Gemma 4 trained on the built-in text (``trained_model``): its
greedy continuation of a line of that text is the line, mostly with top-2 logit margins of 4-7.
Training's float order depends on the CPU, so on some machines a step is a near tie (0.48 was
seen on one). The continuations are therefore compared the way ``check --against`` compares
them: transformers is fed the package's tokens, and each token must be its best or within the
precision's near-tie bound of it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import onnxruntime_genai as og
import pytest
import torch
import transformers

from exporter import export
from exporter.load.presets import build_preset
from exporter.precisions import PRECISIONS
from exporter.trace.decoder import GenAIDecoder, input_names, make_inputs
from exporter.verify.check_against import departures, teacher_forced_logits
from tests.helpers.checkpoints import perturb_constant_tensors, save_checkpoint
from tests.helpers.genai_greedy import GREEDY_SCRIPT, greedy
from tests.helpers.trained_model import train_tiny_gemma4

GREEDY = GREEDY_SCRIPT
NEW_TOKENS = 24
PROMPT_STARTS = (100, 300)  # token offsets into the training text
PROMPT_LENGTH = 12

# Max |logit - fp32 logit| at the last position of a 24-token prompt, CPU EP. Measured on the
# trained model (top-2 margins of several units), whose weights differ by host since training's
# float order does: fp16 4.7e-3 (logit std 1.5), 4.3e-3 (std 1.23, an AVX2-only host) and 1.2e-2
# on a third host, where the package of the commit before the unscaled-norm fusion gave the same;
# int4 0.54-0.58 (fp32 activations, accuracy level 4 = int8) and 0.57 (fp16 activations). The
# bounds are about 2x the largest, still far below a margin that decides a token.
# K-quant is worse than round-to-nearest on this tiny model (1.85 and 2.03; its rows are 64 wide),
# better on the real Gemma 3 270M (docs/measurements.md, "int4 and int8 on real weights"): bound 2.5.
# 2026-12-07, after int4's default became asymmetric: int4 0.82 (cpu and webgpu; the symmetric
# former default 0.59-0.60 here, worse on the real checkpoints: docs/measurements.md), with the 8-bit head and
# sensitive layers ("mixed") 0.66 and 0.69, k_quant 1.85 and 2.03; int8 0.081 (cpu, int8
# compute) and 0.080 (webgpu, fp16 activations): bound 0.3.
# HQQ (cpu only, float zero points) 0.78, 2026-12-07: bound 1.5.
# AWQ (scales searched on the built-in prompts, then round-to-nearest) 0.89 (cpu) and 0.85 (webgpu),
# 2026-12-07: bound 1.5.
LOGIT_TOLERANCE = {"fp32": 1e-4, "fp16": 2.5e-2, "int4-cpu": 1.0, "int4-webgpu": 1.0, "int4-k_quant-cpu": 2.5,
                   "int4-k_quant-webgpu": 2.5, "int4-hqq-cpu": 1.5, "int4-awq-cpu": 1.5, "int4-awq-webgpu": 1.5,
                   "int4-mixed-cpu": 1.0, "int4-mixed-webgpu": 1.0, "int8-cpu": 0.3, "int8-webgpu": 0.3}

PACKAGES = {  # name -> (ep, precision)
    "fp32": ("cpu", "fp32"),
    "fp16": ("webgpu", "fp16"),
    "int4-cpu": ("cpu", "int4"),
    "int4-webgpu": ("webgpu", "int4"),
    "int4-k_quant-cpu": ("cpu", "int4"),
    "int4-k_quant-webgpu": ("webgpu", "int4"),
    "int4-hqq-cpu": ("cpu", "int4"),  # float zero points: cpu only
    "int4-awq-cpu": ("cpu", "int4"),  # AWQ's input scales, searched at export time
    "int4-awq-webgpu": ("webgpu", "int4"),
    "int4-mixed-cpu": ("cpu", "int4"),  # the LM head and the sensitive layers at 8 bits
    "int4-mixed-webgpu": ("webgpu", "int4"),
    "int8-cpu": ("cpu", "int8"),
    "int8-webgpu": ("webgpu", "int8"),
}
MIXED = ("lm_head", "sensitive_layers")



def _int4_options(name: str, ep: str):
    from ep_profiles import get_profile
    from exporter.precisions import int4_options

    if "k_quant" in name:
        return dataclasses.replace(int4_options(get_profile(ep), "int4", None), method="k_quant")
    if "hqq" in name:
        return dataclasses.replace(int4_options(get_profile(ep), "int4", None), method="hqq")
    if "awq" in name:
        return dataclasses.replace(int4_options(get_profile(ep), "int4", None), method="awq")
    if "mixed" in name:
        return dataclasses.replace(int4_options(get_profile(ep), "int4", None), eight_bit=MIXED)
    return None


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The trained model as a checkpoint folder (its buffers, which training leaves at 1, moved),
    exported from the folder; the reference is transformers' load of it."""
    trained_model, tokenizer, ids, _ = train_tiny_gemma4()
    root = tmp_path_factory.mktemp("precisions")
    assert "model.layers.0.layer_scalar" in perturb_constant_tensors(trained_model)
    folder = save_checkpoint(trained_model, tokenizer, root / "checkpoint")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    packages = {
        name: export(str(folder), ep=ep, precision=precision, int4=_int4_options(name, ep), output_dir=root / name)
        for name, (ep, precision) in PACKAGES.items()
    }
    prompts = [ids[s : s + PROMPT_LENGTH].tolist() for s in PROMPT_STARTS]
    return model, ids, packages, prompts


def _initializers(package) -> dict[str, ir.Value]:
    return ir.load(str(package.model_path)).graph.initializers


@pytest.mark.l1
def test_fp16_package_computes_in_fp16(trained):
    package = trained[2]["fp16"]
    model = ir.load(str(package.model_path))
    io = [v for v in [*model.graph.inputs, *model.graph.outputs] if v.name.startswith(("past", "present", "logits"))]
    assert {v.dtype for v in io} == {ir.DataType.FLOAT16}
    norms = [n for n in model.graph if "LayerNormalization" in n.op_type]
    assert {n.outputs[0].dtype for n in norms} == {ir.DataType.FLOAT16}
    assert package.report.op_counts["com.microsoft.SkipSimplifiedLayerNormalization"] > 0


@pytest.mark.l1
def test_int4_package_quantizes_every_linear_and_the_tied_embedding_once(trained):
    package = trained[2]["int4-webgpu"]
    counts, quantization = package.report.op_counts, package.report.onnx_pass_changes("quantize_weights")
    assert "com.microsoft.MatMulNBits" in counts and "com.microsoft.GatherBlockQuantized" in counts
    # Per decoder layer: q, k, v (owners), o, gate, up, down, per-layer gate and projection.
    assert quantization["matmuls"] == counts["com.microsoft.MatMulNBits"]
    assert quantization["tables_shared_with_lm_head"] == 1
    graph = ir.load(str(package.model_path)).graph
    lm_head = next(n for n in graph if n.op_type == "MatMulNBits" and n.attributes["N"].value == 512
                   and n.attributes["K"].value == 64)
    blob_users = {user.op_type for user, _ in lm_head.inputs[1].uses()}
    assert blob_users == {"MatMulNBits", "Reshape"}, "the tied embedding reads the LM head's blob"
    floats = [v for v in graph.initializers.values() if v.dtype == ir.DataType.FLOAT16 and v.shape is not None
              and len(v.shape) == 2 and v.shape[0] == 512 and v.shape[1] == 64]
    assert not floats, "no float copy of the embedding is left"


@pytest.mark.l1
def test_k_quant_blocks_are_onnx_runtimes_k_quant_in_matmulnbits_layout():
    """The blob, scales and zero points decode (``scale * (q - zero_point)``, nibbles low first) to
    exactly what ONNX Runtime's K-quant search chose, padding included, a row chunk at a time."""
    from onnxruntime.quantization.neural_compressor.weight_only import quant_tensor_k_quant_cpu

    from exporter.onnx_passes import quantize_weights

    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((40, 200)) * np.linspace(0.1, 2.0, 200)).astype(np.float32)  # [n, k]
    quantize_weights.K_QUANT_ROWS, rows = 16, quantize_weights.K_QUANT_ROWS  # three chunks, the last partial
    try:
        blob, scales, zero_points = quantize_weights.k_quant_blocks(weight, 32)
    finally:
        quantize_weights.K_QUANT_ROWS = rows
    assert blob.shape == (40, 7, 16) and scales.shape == (40, 7) and zero_points.shape == (40, 4)
    q = np.stack([blob & 15, blob >> 4], axis=-1).reshape(40, 7, 32).astype(np.float32)
    zero = np.stack([zero_points & 15, zero_points >> 4], axis=-1).reshape(40, 8)[:, :7, None].astype(np.float32)
    decoded = ((q - zero) * scales[..., None]).reshape(40, -1)
    want_q, want_scale, want_zero = quant_tensor_k_quant_cpu(np.pad(weight, ((0, 0), (0, 24))), 4, 32)
    want = ((want_q - want_zero) * want_scale).reshape(40, -1)
    np.testing.assert_allclose(decoded, want, rtol=1e-6, atol=1e-6)
    assert np.abs(decoded[:, :200] - weight).max() < np.abs(weight).max() / 8  # a 4-bit grid of the weight


@pytest.mark.l1
def test_k_quant_package_has_zero_points_but_where_a_table_cannot(trained):
    """K-quant blocks have zero points, except a gathered table whose rows span an odd number of
    blocks (tiny Gemma 4's per-layer table: 160 wide, 5 blocks), which GatherBlockQuantized
    refuses them for: round-to-nearest without them there, counted in the report."""
    package = trained[2]["int4-k_quant-cpu"]
    graph = ir.load(str(package.model_path)).graph
    quantized = [n for n in graph if n.op_type in ("MatMulNBits", "GatherBlockQuantized")]
    with_zero_points = [n for n in quantized if len(n.inputs) >= 4 and n.inputs[3] is not None]
    without = [n for n in quantized if n not in with_zero_points]
    assert with_zero_points and without and all(n.op_type == "GatherBlockQuantized" for n in without)
    assert package.report.onnx_pass_changes("quantize_weights")["tables_without_zero_points"] == len(without)
    assert "k_quant" in next(p["why"] for p in package.report.plan["sessions"][0]["onnx_passes"]
                             if p["name"] == "quantize_weights")


@pytest.mark.l1
def test_hqq_package_has_finite_float_zero_points_and_integer_ones_on_its_tables(trained):
    """HQQ's MatMulNBits take float zero points (fitted, so not all whole numbers), every one
    finite; the gathered tables, whose GatherBlockQuantized takes integer zero points only, are
    round-to-nearest, counted in the report; the plan line says the CPU runs them slowly."""
    package = trained[2]["int4-hqq-cpu"]
    graph = ir.load(str(package.model_path)).graph
    gathers = [n for n in graph if n.op_type == "GatherBlockQuantized"]
    table_blobs = {id(n.inputs[0].producer().inputs[0]) for n in gathers}  # each table's blob, before its Reshape
    matmuls = [n for n in graph if n.op_type == "MatMulNBits"]
    own = [n for n in matmuls if id(n.inputs[1]) not in table_blobs]  # not the head tied to a table
    assert gathers and own and len(own) == len(matmuls) - 1  # tiny Gemma 4's head reads its table
    for node in own:
        zero_points = node.inputs[3].const_value.numpy()
        assert zero_points.dtype == np.float32 and zero_points.shape == node.inputs[2].shape
        assert np.isfinite(zero_points).all() and np.isfinite(node.inputs[2].const_value.numpy()).all()
    assert any((n.inputs[3].const_value.numpy() % 1 != 0).any() for n in own)
    for node in [*gathers, *(n for n in matmuls if n not in own)]:
        assert len(node.inputs) < 4 or node.inputs[3] is None or node.inputs[3].dtype == ir.DataType.UINT8
    changes = package.report.onnx_pass_changes("quantize_weights")
    assert changes["tables_round_to_nearest"] + changes["tables_without_zero_points"] >= 1
    assert "slow kernel" in next(p["why"] for p in package.report.plan["sessions"][0]["onnx_passes"]
                                 if p["name"] == "quantize_weights")


@pytest.mark.l1
@pytest.mark.parametrize("name", ["int4-awq-cpu", "int4-awq-webgpu"])
def test_awq_package_feeds_each_decoder_linear_layer_its_input_over_its_measured_scale(trained, name):
    """Under AWQ every decoder linear layer searched is scaled in the graph (its checkpoint name
    found); the layers reading one input share one Div, and each Div is folded into the norm or
    up projection before it where nothing else reads its input (Gemma 4's per-layer gate reads
    the residual stream itself: its Div stays). What is left divides by a finite, positive s that
    the search moved, in the activation dtype; the LM head is plain round-to-nearest."""
    package = trained[2][name]
    graph = ir.load(str(package.model_path)).graph
    matmuls = [n for n in graph if n.op_type == "MatMulNBits"]
    divided = [n for n in matmuls if n.inputs[0].producer() is not None and n.inputs[0].producer().op_type == "Div"
               and n.inputs[0].producer().name.endswith(".awq")]
    changes = package.report.onnx_pass_changes("quantize_weights")
    folds = package.report.onnx_pass_changes("fold_awq_divisions")
    measured = package.report.activation_aware_scales
    assert changes["awq_scaled"] == measured["weights"] and changes["awq_scales_not_applied"] == 0
    assert changes["awq_unscaled"] >= 1 and measured["tokens"] > 0  # the head, at least
    assert measured["unscaled"] < measured["weights"]
    layers = trained[0].config.num_hidden_layers
    assert changes["awq_divisions"] < changes["awq_scaled"]  # shared by the layers reading one input
    # Both norms of each layer take their s (on webgpu the last layer's attention norm output also
    # feeds the last-token gather, so its Div stays, and the gathered rows get their own); fp16
    # block scales are not divided (they could leave fp16's normal range): webgpu keeps the down
    # projections' Divs.
    webgpu = name.endswith("webgpu")
    assert folds["into_norms"] == 2 * layers - webgpu and folds["into_up_projections"] == (0 if webgpu else layers)
    assert folds["into_norms"] + folds["into_up_projections"] + folds["divisions_left"] == changes["awq_divisions"]
    divisions = {n.inputs[0].producer() for n in divided}
    assert len(divisions) == folds["divisions_left"] and divisions
    activation = ir.DataType.FLOAT16 if name.endswith("webgpu") else ir.DataType.FLOAT
    moved = False
    for division in divisions:
        divisor = division.inputs[1]
        s = divisor.const_value.numpy().astype(np.float64)
        assert divisor.dtype == activation and s.shape == (division.inputs[0].shape[-1],)
        assert np.isfinite(s).all() and (s > 0).all()
        moved |= bool(np.abs(s - 1).max() > 1e-3)
    assert moved
    lm_head = next(n for n in matmuls if n.attributes["N"].value == 512)
    assert lm_head not in divided


@pytest.mark.l1
def test_awq_searches_each_decoder_linear_layer_but_the_attention_output_projections(trained):
    """The search hooks every linear layer the decoder's layers run on the prompts (KV-shared
    layers compute no keys or values) and skips each attention block's output projection; the
    query, key and value projections share one s, and the gate and up projections another."""
    import types

    from exporter.int4_options import Int4Options
    from exporter.load.activation_aware_scales import measure_scales
    from exporter.load.activation_ranges import decoder_layers

    model = trained[0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(trained[2]["int4-awq-cpu"].path)
    loaded = types.SimpleNamespace(model=model, tokenizer=tokenizer, weights=None, multimodal=False)
    def hooks():
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    before = hooks()
    found = measure_scales(loaded, Int4Options(method="awq"))
    assert hooks() == before  # all removed
    layers = decoder_layers(model.base_model)
    shared = model.config.num_kv_shared_layers
    assert shared > 0
    for index in range(len(layers)):
        searched = {name.split(".")[-2] for name in found.scales if f".layers.{index}." in f".{name}"}
        kv = set() if index >= len(layers) - shared else {"k_proj", "v_proj"}
        assert {"q_proj", "gate_proj", "up_proj", "down_proj"} | kv <= searched, (index, searched)
        assert "o_proj" not in searched
        # The layers reading one input share one s (one Div, or one folded weight, in the graph).
        def scale(module, index=index):
            return next(s for n, s in found.scales.items() if f".layers.{index}." in f".{n}" and f".{module}." in n)
        assert scale("gate_proj") is scale("up_proj") and scale("down_proj") is not scale("up_proj")
        for projection in kv:
            assert scale(projection) is scale("q_proj")
    for s in found.scales.values():
        assert np.isfinite(s).all() and (s > 0).all()


def _bits(package) -> dict[str, list[int]]:
    graph = ir.load(str(package.model_path)).graph
    found = {"MatMulNBits": [], "GatherBlockQuantized": []}
    for node in graph:
        if node.op_type in found:
            found[node.op_type].append(node.attributes["bits"].value)
    return found


@pytest.mark.l1
@pytest.mark.parametrize("name", ["int8-cpu", "int8-webgpu"])
def test_int8_package_stores_every_weight_in_8_bits_and_the_tied_table_once(trained, name):
    package = trained[2][name]
    bits = _bits(package)
    assert bits["MatMulNBits"] and set(bits["MatMulNBits"]) == {8}
    assert bits["GatherBlockQuantized"] and set(bits["GatherBlockQuantized"]) == {8}
    changes = package.report.onnx_pass_changes("quantize_weights")
    assert changes["tables_shared_with_lm_head"] == 1 and not any(k.startswith("eight_bit_") for k in changes)
    graph = ir.load(str(package.model_path)).graph
    quantized = [n for n in graph if n.op_type in ("MatMulNBits", "GatherBlockQuantized")]
    assert all(len(n.inputs) < 4 or n.inputs[3] is None for n in quantized), "int8 blocks are symmetric"


@pytest.mark.l1
def test_default_int4_is_asymmetric_and_every_weight_4_bit(trained):
    package = trained[2]["int4-webgpu"]
    bits = _bits(package)
    assert set(bits["MatMulNBits"]) == {4} and set(bits["GatherBlockQuantized"]) == {4}
    graph = ir.load(str(package.model_path)).graph
    matmuls = [n for n in graph if n.op_type == "MatMulNBits"]
    assert all(len(n.inputs) >= 4 and n.inputs[3] is not None for n in matmuls), "zero points on every MatMulNBits"
    assert not any(k.startswith("eight_bit_") for k in package.report.onnx_pass_changes("quantize_weights"))


@pytest.mark.l1
def test_mixed_int4_stores_the_lm_head_and_the_sensitive_layers_in_8_bits(trained):
    """``eight_bit=("lm_head", "sensitive_layers")`` on tiny Gemma 4 (10 layers, the last 4 reading earlier layers' KV and so without a value
    projection): the sensitive layers are 0, 8 and 9 (the first and last eighth) and 3 and 6
    (every third between); each has a down projection, 0 and 3 a value projection too. The tied
    head takes its embedding table to 8 bits with it: stored once."""
    package = trained[2]["int4-mixed-webgpu"]
    changes = package.report.onnx_pass_changes("quantize_weights")
    assert changes["eight_bit_lm_head"] == 1
    assert changes["eight_bit_sensitive_layers"] == 5 + 2
    bits = _bits(package)
    assert bits["MatMulNBits"].count(8) == 1 + 7 and bits["MatMulNBits"].count(4) > 0
    assert sorted(bits["GatherBlockQuantized"]).count(8) == 1, "the tied table is the head's 8-bit blob"
    assert changes["tables_shared_with_lm_head"] == 1


@pytest.mark.l1
def test_sensitive_layers_are_llama_cpps_more_bits_layers():
    """llama.cpp's use_more_bits(i, n), in integer division: i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2."""
    from exporter.onnx_passes.quantize_weights import sensitive_layer

    assert [i for i in range(35) if sensitive_layer(i, 35)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31,
                                                                 32, 33, 34]
    assert [i for i in range(18) if sensitive_layer(i, 18)] == [0, 1, 4, 7, 10, 13, 15, 16, 17]


@pytest.mark.l1
def test_int4_cpu_package_keeps_matmuls_for_its_quantizer(trained):
    """On cpu a float weight is read as stored by FusedMatMul; at int4 every linear stays a MatMul
    that the quantizer turns into MatMulNBits (none is left in float)."""
    package = trained[2]["int4-cpu"]
    counts, quantization = package.report.op_counts, package.report.onnx_pass_changes("quantize_weights")
    assert "com.microsoft.FusedMatMul" not in counts
    assert quantization["matmuls"] == counts["com.microsoft.MatMulNBits"] > 0


@pytest.mark.l1
def test_bf16_package_for_cuda_builds_in_bf16(tmp_path):
    model, tokenizer = build_preset("tiny-llama")
    package = export(model, tokenizer, ep="cuda", precision="bf16", output_dir=tmp_path / "bf16")
    graph = ir.load(str(package.model_path)).graph
    assert {v.dtype for v in graph.outputs} == {ir.DataType.BFLOAT16}
    assert package.report.op_counts["com.microsoft.GroupQueryAttention"] == 4
    assert next(model.parameters()).dtype == torch.float32, "the caller's model keeps its dtype"


@pytest.mark.l1
@pytest.mark.parametrize("preset", ["tiny-llama4", "tiny-qwen3-moe"])
def test_bf16_decoders_give_every_op_a_type_its_schema_allows(tmp_path, preset):
    """Llama 4's router TopK has no bf16 at opset 21 (the package was refused by ONNX Runtime on
    every EP) and now runs in float32; a MoE decoder's expert Split, which an earlier widening
    broke, keeps one dtype. ONNX Runtime resolves each graph: its CPU EP then lacks bf16 kernels
    (NOT_IMPLEMENTED), never a type error."""
    from exporter.onnx_passes.schema_types import dtype_refusals

    model, tokenizer = build_preset(preset)
    package = export(model, tokenizer, ep="cuda", precision="bf16", output_dir=tmp_path / "bf16")
    assert dtype_refusals(ir.load(str(package.model_path))) == []
    with pytest.raises(Exception, match="NOT_IMPLEMENTED"):
        ort.InferenceSession(str(package.model_path), providers=["CPUExecutionProvider"])


def _session_logits(package, inputs) -> np.ndarray:
    session = ort.InferenceSession(str(package.model_path), providers=["CPUExecutionProvider"])
    dtype = np.float16 if session.get_inputs()[3].type == "tensor(float16)" else np.float32
    arrays = [t.numpy() for t in (*inputs[:3], *inputs[3])]
    feeds = {name: (a.astype(dtype) if a.dtype == np.float32 else a) for name, a in zip(input_names(package.layout), arrays, strict=True)}
    return session.run(["logits"], feeds)[0].astype(np.float32)


@pytest.mark.l3
@pytest.mark.parametrize("name", list(PACKAGES))
def test_logit_error_against_pytorch_fp32(trained, name):
    model, ids, packages, _ = trained
    package = packages[name]
    layout = package.layout
    inputs = list(make_inputs(layout, 1, 24, 0))
    inputs[0] = ids[None, 40:64]
    inputs[2] = torch.arange(24)[None]
    with torch.no_grad():
        want = GenAIDecoder(model, layout)(*inputs)[0][:, -1:].numpy()
    got = _session_logits(package, inputs)
    error = float(np.abs(got - want).max())
    print(f"{name}: max |logit error| {error:.2e} (logit std {want.std():.2f})")
    assert error <= LOGIT_TOLERANCE[name]
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def _cpu_model(package) -> og.Model:
    config = og.Config(str(package.path))
    config.clear_providers()
    return og.Model(config)


def _assert_follows_transformers(model, prompts, got, name):
    """Every token is transformers' best, fed the package's own tokens, or a near tie for it."""
    bound = PRECISIONS[PACKAGES[name][1]].source_near_tie
    for prompt, tokens in zip(prompts, got, strict=True):
        assert len(tokens) == NEW_TOKENS
        parted = departures(teacher_forced_logits(model, prompt, tokens), tokens)
        assert all(d.margin <= bound for d in parted), f"{name}: {parted} (near-tie bound {bound})"


@pytest.mark.l4
@pytest.mark.parametrize("name", list(PACKAGES))
def test_greedy_continuation_matches_transformers_fp32(trained, name):
    model, _, packages, prompts = trained
    _assert_follows_transformers(model, prompts, greedy(_cpu_model(packages[name]), prompts, NEW_TOKENS), name)


@pytest.mark.l5
@pytest.mark.xdist_group("webgpu")
@pytest.mark.parametrize("name", ["fp16", "int4-webgpu", "int4-k_quant-webgpu", "int4-awq-webgpu", "int4-mixed-webgpu",
                                  "int8-webgpu"])
def test_webgpu_greedy_continuation_matches_transformers_fp32(trained, name):
    from tests.helpers.webgpu import require_webgpu

    require_webgpu()
    model, _, packages, prompts = trained
    done = subprocess.run(
        [sys.executable, str(GREEDY), str(packages[name].path), "webgpu", json.dumps(prompts), str(NEW_TOKENS)],
        check=False, capture_output=True, text=True, env=dict(os.environ), timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_follows_transformers(model, prompts, json.loads(done.stdout.strip().splitlines()[-1]), name)
