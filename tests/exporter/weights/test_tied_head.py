"""On an EP that runs FusedMatMul (cpu) every linear weight is read as stored and a tied LM head is
stored once; where it does not (webgpu) weights are stored transposed and a tied head twice. Their
numbers are covered by the L3/L4 tests of every family."""

from __future__ import annotations

import onnx
import pytest
import torch

from exporter import export

pytestmark = pytest.mark.l1


def _tables(package, vocab: int, hidden: int) -> list[list[int]]:
    model = onnx.load(str(package.model_path), load_external_data=False)
    return sorted(list(t.dims) for t in model.graph.initializer if sorted(t.dims) == sorted([vocab, hidden]))


def test_cpu_stores_a_tied_head_once(preset_exports):
    exported = preset_exports.get("tiny-gemma-4")
    model, package = exported.model, exported.package
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    vocab, hidden = model.config.get_text_config().vocab_size, model.config.get_text_config().hidden_size
    assert _tables(package, vocab, hidden) == [[vocab, hidden]]
    changes = package.report.decoder.onnx_pass_changes("fold_weight_transposes")
    assert changes["tied_weights_read_transposed"] == 1


def test_cpu_reads_every_linear_weight_as_stored(preset_exports):
    """No weight is stored transposed: each linear layer's weight keeps the shape [out, in] its
    checkpoint gives it, and one FusedMatMul (transB) reads each."""
    exported = preset_exports.get("tiny-gemma-4")
    package = exported.package
    changes = package.report.decoder.onnx_pass_changes("fold_weight_transposes")
    linears = {f"model.{name}.weight": tuple(module.weight.shape) for name, module in exported.model.named_modules()
               if isinstance(module, torch.nn.Linear)}
    graph = onnx.load(str(package.model_path), load_external_data=False).graph
    stored = {t.name: tuple(t.dims) for t in graph.initializer}
    fused = [n for n in graph.node if n.op_type == "FusedMatMul"]
    read = {n.input[1] for n in fused}
    assert changes["weights_transposed"] == 0 and changes["weights_read_transposed"] == len(read) > 0
    assert all({a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}.get("transB") == 1 for n in fused)
    kept = {name for name in linears if name in stored}
    assert kept and kept <= read, sorted(kept - read)
    assert all(stored[name] == linears[name] for name in kept)
    assert "MatMul" not in {n.op_type for n in graph.node if n.input[1:2] and n.input[1] in stored}


def test_webgpu_keeps_a_transposed_copy(preset_exports, tmp_path):
    exported = preset_exports.get("tiny-gemma-4")
    package = export(exported.model, exported.tokenizer, ep="webgpu", output_dir=tmp_path / "webgpu")
    vocab, hidden = exported.model.config.vocab_size, exported.model.config.hidden_size
    assert _tables(package, vocab, hidden) == [[hidden, vocab], [vocab, hidden]]
    assert "com.microsoft.FusedMatMul" not in package.report.op_counts
