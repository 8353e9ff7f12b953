"""L3: ONNX Runtime CPU vs PyTorch on logits and every present KV."""

from __future__ import annotations

import pytest

from exporter import export
from tests.helpers.parity import check_parity


@pytest.mark.l3
def test_onnx_runtime_matches_pytorch(family_export):
    """Generation packages: logits of each row's last real token, every present KV in full."""
    check_parity(family_export.package, family_export.model)


@pytest.mark.l3
def test_full_logits_package_matches_pytorch(preset_exports, tmp_path):
    """--full-logits keeps every position (and turns the truncation passes off)."""
    exported = preset_exports.get("tiny-gemma-4")
    package = export(exported.model, exported.tokenizer, output_dir=tmp_path / "full", full_logits=True)
    assert [r["name"] for r in package.report.fx_passes] == [
        "drop_runtime_asserts", "drop_noop_casts", "fold_untranslatable_constants", "complex_as_real_pairs",
        "substitute_group_query_attention"]
    check_parity(package, exported.model)


@pytest.mark.l3
def test_plain_attention_package_matches_pytorch(preset_exports):
    """A profile without GroupQueryAttention keeps transformers' attention, left padding included."""
    exported = preset_exports.get("tiny-gemma-4", plain_attention=True)
    package = exported.package
    assert "substitute_group_query_attention" not in [r["name"] for r in package.report.fx_passes]
    assert not any(op.endswith("GroupQueryAttention") for op in package.report.op_counts)
    check_parity(package, exported.model)
