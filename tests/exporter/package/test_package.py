"""The package: genai_config consistent with the graph, report contents, determinism, CLI."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import onnx
import onnx.numpy_helper
import onnxruntime_genai as og
import pytest

from exporter.trace.decoder import input_names, output_names
from tests.helpers.families import (
    LAYER_NORM_FAMILIES,
    MIXTURE_OF_EXPERTS_FAMILIES,
    PLAIN_ATTENTION_LAYERS,
    PLAIN_RMS_NORM_FAMILIES,
)


@pytest.mark.l1
def test_genai_config_matches_graph(family_export):
    package, layout = family_export.package, family_export.package.layout
    config = json.loads((package.path / "genai_config.json").read_text())
    og.Config(str(package.path))  # ONNX Runtime GenAI parses it
    graph = onnx.load(str(package.model_path), load_external_data=False).graph
    decoder = config["model"]["decoder"]
    graph_inputs = {i.name: i for i in graph.input}
    assert list(graph_inputs) == input_names(layout)
    assert [o.name for o in graph.output] == output_names(layout)
    for index in layout.kv_layer_indices:
        dims = graph_inputs[f"past_key_values.{index}.key"].type.tensor_type.shape.dim
        assert [d.dim_param or d.dim_value for d in dims] == [
            "batch_size", layout.kv_layers[layout.kv_layer_indices.index(index)].num_kv_heads,
            "past_sequence_length", layout.kv_layers[layout.kv_layer_indices.index(index)].head_dim,
        ]
    assert decoder["head_size"] == layout.kv_layers[0].head_dim
    assert decoder["num_key_value_heads"] == layout.kv_layers[0].num_kv_heads
    assert decoder["num_hidden_layers"] == layout.num_layers
    assert config["model"]["vocab_size"] == layout.vocab_size
    assert config["model"]["eos_token_id"] == 1 and config["model"]["pad_token_id"] == 0
    assert config["search"]["max_length"] == config["model"]["context_length"]


@pytest.mark.l1
def test_norms_are_fused(family_export):
    report, name = family_export.package.report, family_export.name
    if name in LAYER_NORM_FAMILIES:
        assert report.op_counts.get("LayerNormalization", 0) > 0
        assert "ReduceMean" not in report.op_counts
        return
    norms = report.onnx_pass_changes("fuse_rms_norms")
    assert norms["fused"] > 0
    if name == "tiny-cohere":  # parallel attention and MLP: no residual add between two norms
        return
    assert report.onnx_pass_changes("fuse_skip_rms_norms")["fused"] > 0
    if name in PLAIN_RMS_NORM_FAMILIES:
        assert "Pow" not in report.op_counts and "ReduceMean" not in report.op_counts
        assert norms["mean_of_squares_left"] == 0
    else:
        assert norms["mean_of_squares_left"] > 0, f"{name} now fuses every norm: list it in PLAIN_RMS_NORM_FAMILIES"
    if name == "tiny-gemma-4":  # the value norm, which has no scale: one per KV-owning layer
        assert norms["without_scale"] == len(family_export.package.layout.kv_layers)


@pytest.mark.l1
def test_every_layer_is_group_query_attention(family_export):
    """One GroupQueryAttention per layer but the KV-shared ones (cpu writes those as MatMul/Softmax
    over their owner's cache: two activation MatMuls and a Softmax each), no other attention
    Softmax and no other activation-by-activation MatMul left (every MatMul multiplies by a
    weight, or an expert's weights gathered for the tokens routed to it), and the shared KV buffer
    that needs them on."""
    package, layout = family_export.package, family_export.package.layout
    graph = onnx.load(str(package.model_path), load_external_data=False).graph
    weights = {i.name for i in graph.initializer}
    # A tied LM head reads the embedding table through a Transpose; experts' weights are gathered
    # for the routed tokens (and transposed). Nodes are in topological order.
    for node in graph.node:
        if node.op_type in ("Transpose", "Gather", "GatherND") and node.input[0] in weights:
            weights.add(node.output[0])
    counts = package.report.op_counts
    plain_layers = PLAIN_ATTENTION_LAYERS.get(family_export.name, [])
    shared = len(layout.shared_layer_indices)
    assert counts["com.microsoft.GroupQueryAttention"] == layout.num_layers - len(plain_layers) - shared
    if family_export.name in MIXTURE_OF_EXPERTS_FAMILIES:
        # Each experts block is ONNX Runtime's MoE, or stays plain behind its router's Softmax,
        # which feeds a TopK (through a Cast to the compute dtype or not).
        record = next(r for r in package.report.fx_passes if r["name"] == "substitute_mixture_of_experts")
        fused, plain = record["changes"]["substituted_layers"], record["changes"]["plain_blocks"]
        assert counts.get("com.microsoft.MoE", 0) == len(fused) and len(fused) + len(plain) > 0
        consumers = {i: n for n in graph.node for i in n.input}
        softmaxes = [n for n in graph.node if n.op_type == "Softmax"]
        assert shared == 0, "a family with experts and KV-shared layers: count their attention Softmaxes here"
        assert len(softmaxes) == len(plain)
        for softmax in softmaxes:
            after = consumers[softmax.output[0]]
            after = consumers[after.output[0]] if after.op_type == "Cast" else after
            assert after.op_type == "TopK"
    else:
        # A layer that keeps transformers' attention keeps its Softmax.
        assert counts.get("Softmax", 0) == len(plain_layers) + shared
    by_activations = [n for n in graph.node if n.op_type == "MatMul" and not any(i in weights for i in n.input)]
    # Gemma 3n's AltUp mixes its streams with per-token coefficients: one such product per layer;
    # plain attention and the KV-shared layers' multiply queries by keys and weights by values.
    expected = (layout.num_layers if family_export.name == "tiny-gemma-3n" else 0) + 2 * (len(plain_layers) + shared)
    assert len(by_activations) == expected
    record = next(r for r in package.report.fx_passes if r["name"] == "substitute_group_query_attention")
    assert record["changes"]["substituted_layers"] == [i for i in range(layout.num_layers) if i not in plain_layers]
    assert sorted(int(i) for i in record["changes"]["plain_layers"]) == plain_layers
    # The cache owners keep GroupQueryAttention, with their presents (graph outputs).
    outputs = [len(n.output) for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert outputs == [3] * (layout.num_layers - len(plain_layers) - shared)
    assert package.report.onnx_pass_changes("omit_unread_presents") == ({"presents_omitted": shared} if shared else {})
    assert package.report.onnx_pass_changes("matmul_kv_shared_attention") == (
        {"layers": shared} if shared else {})
    config = json.loads((package.path / "genai_config.json").read_text())
    # One KV buffer for past and present only where GroupQueryAttention writes every present.
    assert config["search"]["past_present_share_buffer"] is (not plain_layers)


@pytest.mark.l1
def test_gemma4_layout_and_report(preset_exports):
    package = preset_exports.get("tiny-gemma-4").package
    layout = package.layout
    assert layout.kv_layer_indices == (0, 1, 2, 3, 4, 5)
    assert layout.shared_layer_indices == (6, 7, 8, 9)
    assert {k.head_dim for k in layout.kv_layers} == {32, 64}  # sliding and full layers
    report = json.loads((package.path / "export_report.json").read_text())
    assert [s["name"] for s in report["stages"]] == ["load", "trace", "fx_passes", "lower", "onnx_passes", "package"]
    assert all(s["seconds"] > 0 and s["peak_rss_bytes"] > 0 for s in report["stages"])
    (decoder,) = report["sessions"].values()
    assert decoder["filename"] == "model.onnx"
    assert decoder["fx_passes"][0]["name"] == "drop_runtime_asserts"
    assert decoder["fx_passes"][0]["changes"]["asserts_erased"] > 0
    assert decoder["op_counts"]["com.microsoft.FusedMatMul"] > 0  # cpu reads linear weights as stored
    stored = onnx.load(str(package.model_path)).graph.initializer
    assert decoder["initializers"]["count"] == len(stored)
    assert decoder["initializers"]["total_bytes"] == sum(onnx.numpy_helper.to_array(t).nbytes for t in stored)
    data = package.path / "model.onnx.data"
    assert report["files"]["model.onnx.data"] == {"bytes": data.stat().st_size,
                                                  "sha256": hashlib.sha256(data.read_bytes()).hexdigest()}
    assert "| trace |" in (package.path / "export_report.md").read_text()


@pytest.mark.l1
def test_export_is_deterministic_across_processes(preset_exports, tmp_path):
    """A second export of the same checkpoint in a fresh process, with another string-hash seed,
    is byte-identical."""
    exported = preset_exports.get("tiny-gemma-4")
    first = exported.package.path
    env = dict(os.environ, PYTHONHASHSEED="12345")
    subprocess.run(
        [sys.executable, "-m", "exporter", str(exported.checkpoint), "-o", str(tmp_path / "again")],
        check=True, env=env, capture_output=True,
    )
    for name in ("model.onnx", "model.onnx.data", "genai_config.json"):
        assert (first / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name


@pytest.mark.l1
def test_a_forward_looping_over_a_set_of_strings_exports_alike_under_any_hash_seed(tmp_path):
    """Llama 4's forward builds one mask per layer type in ``set(config.layer_types)`` order, which
    string hashing sets per process: string-hash seeds 3 and 4 traced the masks in two orders
    before the trace iterated such sets sorted."""
    packages = []
    for seed in ("3", "4"):
        subprocess.run([sys.executable, "-m", "exporter", "tiny-llama4", "-o", str(tmp_path / seed), "--no-cache"],
                       check=True, env=dict(os.environ, PYTHONHASHSEED=seed), capture_output=True)
        packages.append((tmp_path / seed / "model.onnx").read_bytes())
    assert packages[0] == packages[1]


@pytest.mark.l1
def test_cli_overwrite_and_summary(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "genai_config.json").write_text("{}")  # an earlier package
    (target / "stale.txt").write_text("old")
    result = subprocess.run(
        [sys.executable, "-m", "exporter", "tiny-llama", "-o", str(target), "--overwrite"],
        check=False, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "lowering to ONNX" in result.stderr
    assert result.stdout.startswith(f"Wrote {target} in ")
    assert not (target / "stale.txt").exists()
    assert (target / "model.onnx").is_file()


@pytest.mark.l1
def test_cli_list_names_presets_aliases_and_eps(capsys):
    from exporter.cli import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("tiny-gemma-4", "gemma-4-e2b-shape", "gemma-4-e2b", "google/gemma-4-E2B-it", "cpu", "webgpu"):
        assert name in out


@pytest.mark.l1
def test_a_session_model_saves_into_its_subfolder(tmp_path):
    """Room for a package of several sessions: a model file name with a folder gets the folder,
    and its weights land beside it."""
    import numpy as np
    import onnx_ir as ir
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from exporter.package.files import save_model

    weight = numpy_helper.from_array(np.arange(64, dtype=np.float32).reshape(8, 8), "weight")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "weight"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], [weight])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    save_model(model, tmp_path, "vision/model.onnx")
    assert sorted(p.name for p in (tmp_path / "vision").iterdir()) == ["model.onnx", "model.onnx.data"]
    session = ort.InferenceSession(str(tmp_path / "vision" / "model.onnx"))
    x = np.ones((1, 8), np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], x @ np.arange(64, dtype=np.float32).reshape(8, 8))
