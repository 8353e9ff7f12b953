"""A tied LM head is stored once on an EP that runs FusedMatMul (cpu), and as a transposed copy
where it does not (webgpu). Its numbers are covered by the L3/L4 tests of the tied families."""

from __future__ import annotations

import onnx
import pytest

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
    assert package.report.op_counts.get("com.microsoft.FusedMatMul") == 1
    assert package.report.decoder.onnx_pass_changes("fold_weight_transposes")["tied_weights_read_transposed"] == 1


def test_webgpu_keeps_a_transposed_copy(preset_exports, tmp_path):
    exported = preset_exports.get("tiny-gemma-4")
    package = export(exported.model, exported.tokenizer, ep="webgpu", output_dir=tmp_path / "webgpu")
    vocab, hidden = exported.model.config.vocab_size, exported.model.config.hidden_size
    assert _tables(package, vocab, hidden) == [[hidden, vocab], [vocab, hidden]]
    assert "com.microsoft.FusedMatMul" not in package.report.op_counts
