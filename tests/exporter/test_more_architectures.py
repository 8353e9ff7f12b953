"""What the newer families needed from the exporter, beyond the L3/L4 family tests: checkpoints in
the form transformers converts on load, experts switched to a traceable implementation and back,
Gemma 3n's in-place AltUp writes and constant erfinv, and errors that name the exporter's step."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ep_profiles import get_profile
from exporter import ExporterError, export
from exporter.cli import main
from exporter.load.presets import build_preset, move_constant_tensors
from tests.helpers.checkpoints import save_checkpoint
from tests.helpers.parity import check_parity

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


def test_a_failing_layout_probe_names_the_exporter_step_not_the_model(monkeypatch, tmp_path, capsys):
    def broken(model):
        raise RuntimeError("Expected inputs of BF16 type")

    monkeypatch.setattr("exporter.load.prepare.derive_layout", broken)
    assert main(["tiny-llama", "-o", str(tmp_path / "out")]) == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "the exporter's layout probe failed" in message and "Expected inputs of BF16 type" in message
    assert "only decoder" not in message and "exporter's limit" in message
    assert not (tmp_path / "out").exists()


@torch.no_grad()
def test_the_shared_kv_region_sees_in_place_writes():
    """Gemma 3n's decoder layer writes into a slice of its AltUp stack (``copy_`` with no users):
    the truncation's dataflow must count such a write as feeding whatever reads the stack."""
    from exporter.load.layout import derive_layout
    from exporter.trace.decoder import trace
    from fx_passes.analyses.graph_facts import ancestors, graph_outputs

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
    PyTorch (L3); at int4 the fused experts are 4-bit (QMoE), both packages' greedy tokens follow
    transformers' (L4), and QMoE computes exactly MoE over its dequantized experts, which are the
    checkpoint's to within a quantization step."""
    exported = preset_exports.get("tiny-qwen3-moe")
    plain_cpu = dataclasses.replace(get_profile("cpu"), mixture_of_experts_precisions=())
    packages = {}
    fused_op = "com.microsoft.QMoE" if precision == "int4" else "com.microsoft.MoE"
    for fused, profile in ((True, get_profile("cpu")), (False, plain_cpu)):
        package = export(str(exported.checkpoint), ep=profile, precision=precision,
                         output_dir=tmp_path / f"{precision}-{'fused' if fused else 'plain'}")
        assert package.report.op_counts.get(fused_op, 0) == (3 if fused else 0)
        packages[fused] = package
        if precision == "fp32":
            check_parity(package, exported.model)
        else:
            # L4: check's greedy comparison with transformers fp32 (every token transformers' best,
            # or within int4's near-tie bound of it).
            assert main(["check", str(package.path), "--against", str(exported.checkpoint)]) == 0
    if precision == "int4":
        _assert_qmoe_is_moe_over_its_dequantized_experts(packages[True], exported.checkpoint)


def _assert_qmoe_is_moe_over_its_dequantized_experts(int4_package, checkpoint):
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    graph = ir.load(str(int4_package.model_path)).graph
    node = next(n for n in graph if n.op_type == "QMoE")  # layer 0's
    block = node.attributes["block_size"].value
    # Layer 0's experts as the checkpoint stores them, one tensor per expert and projection.
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as handle:
        def stacked(projection):
            return np.stack([handle.get_tensor(f"model.layers.0.mlp.experts.{e}.{projection}.weight").numpy()
                             for e in range(4)])
        gate, up, down = stacked("gate_proj"), stacked("up_proj"), stacked("down_proj")
    experts, inner, width = gate.shape
    # ONNX Runtime's layout: gate and up rows interleaved.
    interleaved = np.stack([gate, up], axis=2).reshape(experts, 2 * inner, width)
    dequantized = []
    for (blob, scales), original in zip(((node.inputs[2], node.inputs[3]), (node.inputs[5], node.inputs[6])),
                                        (interleaved, down), strict=True):
        packed, scale = blob.const_value.numpy(), scales.const_value.numpy()
        q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1).astype(np.float32)
        values = (q - 8) * np.repeat(scale, block, axis=-1)
        # ONNX Runtime's symmetric quantizer maps each block's largest magnitude to -8 (its scale
        # takes the sign), so values on the other side may clip at 7: within one step everywhere,
        # within half a step nearly everywhere.
        error = np.abs(values - original) / np.abs(np.repeat(scale, block, axis=-1))
        assert error.max() <= 1.0 + 1e-4 and (error <= 0.5 + 1e-4).mean() > 0.99
        dequantized.append(values.astype(np.float32))
    tokens, hidden = 5, width
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((tokens, hidden)).astype(np.float32),
             "logits": rng.standard_normal((tokens, experts)).astype(np.float32)}
    attributes = {a.name: a.value for a in node.attributes.values() if a.name not in ("expert_weight_bits", "block_size")}
    outputs = []
    for op, initializers, names in (
        ("QMoE", [node.inputs[i].const_value.numpy() for i in (2, 3, 5, 6)], ["fc1", "s1", "", "fc2", "s2"]),
        ("MoE", dequantized, ["fc1", "", "fc2"]),
    ):
        extra = {"expert_weight_bits": 4, "block_size": block} if op == "QMoE" else {}
        moe = helper.make_node(op, ["x", "logits", *names], ["y"], domain="com.microsoft", **attributes, **extra)
        inits = [numpy_helper.from_array(a, n) for a, n in zip(initializers, [n for n in names if n], strict=True)]
        model = helper.make_model(
            helper.make_graph([moe], "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape)
                                           for k, v in feeds.items()],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits),
            opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
        outputs.append(ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0])
    np.testing.assert_allclose(outputs[0], outputs[1], atol=1e-5, rtol=1e-5, equal_nan=False)


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


@pytest.mark.l3
def test_unnormalised_routing_reaches_onnx_runtime_unnormalised(tmp_path):
    """Qwen3-MoE with norm_topk_prob off keeps the top-k softmax weights as they are: the MoE op
    must not renormalise them (every preset renormalises, so this is its only check)."""
    import onnx

    model, tokenizer = build_preset("tiny-qwen3-moe")
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    assert routers
    for router in routers:
        router.norm_topk_prob = False
    model.config.norm_topk_prob = False
    assert move_constant_tensors(model)  # norm weights off 1, so a dropped one shows
    # Saved and streamed back, as a user's checkpoint (the config carries the unnormalised routing).
    folder = save_checkpoint(model, tokenizer, tmp_path / "checkpoint")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert not any(r.norm_topk_prob for r in model.modules() if type(r).__name__.endswith("TopKRouter"))
    package = export(str(folder), output_dir=tmp_path / "out")
    graph = onnx.load(str(package.model_path), load_external_data=False).graph
    moes = [n for n in graph.node if n.op_type == "MoE"]
    assert len(moes) == 3
    assert all(a.i == 0 for n in moes for a in n.attribute if a.name == "normalize_routing_weights")
    check_parity(package, model)


@pytest.mark.parametrize("config", [
    transformers.Lfm2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2,
                            layer_types=["conv", "full_attention", "conv", "full_attention"]),
    transformers.Qwen3NextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
                                 linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
], ids=["lfm2-convolution", "qwen3-next-linear-attention"])
def test_a_hybrid_with_a_non_kv_state_is_refused_in_one_specific_line(config, tmp_path, capsys):
    """A convolution or recurrent layer state is not a KV cache, which is all GenAI's decoder
    carries: exit 2, one line saying so (not the layout probe's "please report it"), nothing written."""
    model = transformers.AutoModelForCausalLM.from_config(config)
    _, tokenizer = build_preset("tiny-llama")
    folder = save_checkpoint(model, tokenizer, tmp_path / "checkpoint")
    assert main([str(folder), "-o", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert "keeps a state that is not a key/value cache (LinearAttentionLayer" in lines[-1]
    assert "carries key/value caches only" in lines[-1] and "report it" not in lines[-1]
    assert not (tmp_path / "out").exists()


def _glm4_moe_config():
    return transformers.Glm4MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, max_position_embeddings=256, eos_token_id=1, bos_token_id=2,
        pad_token_id=0)  # the ids the tests pad with (exporter.load.presets: PAD_ID, EOS_ID, BOS_ID)


@pytest.mark.l4
def test_a_router_with_a_score_correction_buffer_exports_from_a_folder(tmp_path):
    """GLM-4-MoE's router adds a saved buffer (``e_score_correction_bias``) to the product of a
    parameter: built on the meta device, the layout probe mixed devices there ("expected device
    meta!"). The probe now runs with the buffers on the meta device too; GenAI's greedy tokens equal
    transformers' on the folder's weights, the buffer moved off its zeros."""
    from tests.helpers.generation import genai_greedy, transformers_greedy

    model = transformers.AutoModelForCausalLM.from_config(_glm4_moe_config())
    assert "e_score_correction_bias" in " ".join(move_constant_tensors(model, 5))
    _, tokenizer = build_preset("tiny-llama")
    folder = save_checkpoint(model, tokenizer, tmp_path / "checkpoint")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    package = export(str(folder), output_dir=tmp_path / "out", strict=True, cache=False)
    prompts = [[2, 12, 99, 415, 260, 48, 77, 301, 5, 188], [2, 37, 101]]
    expected = transformers_greedy(reloaded, prompts, no_early_end=True)
    assert genai_greedy(package.path, prompts, no_early_end=True) == expected


def _latent_attention_config(config_class, **extra):
    """Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash, MiniCPM3, ...), with the rotary
    key (8) narrower than the latent (16) as in the real models (64 against 512)."""
    return config_class(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256,
        eos_token_id=1, bos_token_id=2, pad_token_id=0, **extra)  # the ids the tests pad with


@pytest.mark.l3
@pytest.mark.l4
@pytest.mark.parametrize("config_class", [transformers.DeepseekV3Config, transformers.DeepseekV2Config,
                                          transformers.MiniCPM3Config], ids=lambda c: c.model_type)
def test_latent_attention_exports_its_compressed_cache_with_the_rotary_key_padded(config_class, tmp_path):
    """transformers caches latent attention compressed: one "head" of the normalised latent as keys,
    the rotary key (narrower) as values. The package caches the same, values zero-padded to GenAI's
    one head size, and the attention runs plain over what each step expands from the cache."""
    from tests.helpers.generation import genai_greedy, transformers_greedy

    model = transformers.AutoModelForCausalLM.from_config(_latent_attention_config(config_class))
    move_constant_tensors(model, 5)
    _, tokenizer = build_preset("tiny-llama")
    folder = save_checkpoint(model, tokenizer, tmp_path / "checkpoint")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    package = export(str(folder), output_dir=tmp_path / "out", strict=True, cache=False)
    assert [(layer.num_kv_heads, layer.head_dim, layer.value_head_dim) for layer in package.layout.kv_layers] == [
        (1, 16, 8)] * 3
    decoder = json.loads((package.path / "genai_config.json").read_text())["model"]["decoder"]
    assert (decoder["head_size"], decoder["num_key_value_heads"]) == (16, 1)
    assert any("values are zero-padded to it, 25% of the cache's bytes" in note for note in package.report.notes)
    check_parity(package, reloaded)
    prompts = [[2, 12, 99, 415, 260, 48, 77, 301, 5, 188], [2, 37, 101]]  # a short row: right padding, a hole
    assert genai_greedy(package.path, prompts, no_early_end=True) == transformers_greedy(
        reloaded, prompts, no_early_end=True)


@pytest.mark.l4
def test_an_in_memory_latent_attention_model_matches_transformers(tmp_path):
    """GLM-4.7-Flash's latent attention, exported from memory."""
    from tests.helpers.generation import genai_greedy, transformers_greedy

    model = transformers.AutoModelForCausalLM.from_config(
        _latent_attention_config(transformers.Glm4MoeLiteConfig)).eval()
    move_constant_tensors(model, 6)
    _, tokenizer = build_preset("tiny-llama")
    package = export(model, tokenizer, output_dir=tmp_path / "out", cache=False)
    check_parity(package, model)
    prompts = [[2, 12, 99, 415, 260, 48, 77, 301, 5, 188], [2, 37, 101]]
    assert genai_greedy(package.path, prompts, no_early_end=True) == transformers_greedy(
        model, prompts, no_early_end=True)


class _WideValuesAttention(torch.nn.Module):
    """Caches values wider than keys, which no padding of values can give one head size."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx, self.project = layer_idx, torch.nn.Linear(8, 8)

    def forward(self, hidden_states, cache):
        batch, seq, _ = hidden_states.shape
        keys = self.project(hidden_states).view(batch, 1, seq, 8)
        cache.update(keys, torch.cat([keys, keys], dim=-1), self.layer_idx)
        return hidden_states


class _WideValuesModel(transformers.PreTrainedModel):
    config_class = transformers.LlamaConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = torch.nn.Embedding(config.vocab_size, 8)
        self.layers = torch.nn.ModuleList(_WideValuesAttention(i) for i in range(config.num_hidden_layers))

    def forward(self, input_ids, cache, use_cache):
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, cache)
        return hidden


def test_values_wider_than_keys_are_refused_in_one_line():
    from exporter.load.layout import derive_layout

    model = _WideValuesModel(transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1))
    with pytest.raises(ExporterError, match=r"^llama caches values of 16 per head, wider than its keys' 8 \(layer 0\): "
                                            r"ONNX Runtime GenAI's decoder takes one head size for both.*refuses"):
        derive_layout(model)
