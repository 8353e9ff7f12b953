"""--max-length / max_length=: genai_config's context and the KV cache size the report states; the
webgpu profile's default cap."""

from __future__ import annotations

import json

import pytest

from exporter import ExporterError, export
from tests.helpers.checkpoints import build_preset

pytestmark = pytest.mark.l1


def _kv_bytes_per_slot(config, element_bytes: int) -> int:
    """From the config alone: keys and values of each KV-owning layer (Gemma 4's full-attention
    layers have their own head size)."""
    text = config.get_text_config()
    owning = text.num_hidden_layers - (getattr(text, "num_kv_shared_layers", 0) or 0)
    layers = text.per_layer_config[:owning]  # Gemma 4: each layer's head size and KV heads
    return sum(2 * layer.num_key_value_heads * layer.head_dim * element_bytes for layer in layers)


def test_max_length_sets_the_context_and_the_report_gives_the_kv_bytes(tmp_path):
    package = export("tiny-gemma-4", output_dir=tmp_path / "pkg", max_length=100)
    config = json.loads((package.path / "genai_config.json").read_text())
    assert config["model"]["context_length"] == config["search"]["max_length"] == 100
    model, _ = build_preset("tiny-gemma-4")
    assert package.report.kv_cache == {"max_length": 100, "element_bytes": 4,
                                       "bytes": 100 * _kv_bytes_per_slot(model.config, 4)}
    report = json.loads((package.path / "export_report.json").read_text())
    assert report["kv_cache"] == package.report.kv_cache
    assert "KV cache at max_length 100:" in (package.path / "export_report.md").read_text()


def test_webgpu_caps_a_long_context_by_default_and_max_length_overrides(tmp_path):
    model, tokenizer = build_preset("tiny-llama")
    model.config.max_position_embeddings = 16384
    capped = export(model, tokenizer, ep="webgpu", output_dir=tmp_path / "capped")
    config = json.loads((capped.path / "genai_config.json").read_text())
    assert config["model"]["context_length"] == 4096
    assert capped.report.kv_cache["max_length"] == 4096 and capped.report.kv_cache["element_bytes"] == 2
    chosen = export(model, tokenizer, ep="webgpu", output_dir=tmp_path / "chosen", max_length=10000)
    assert json.loads((chosen.path / "genai_config.json").read_text())["model"]["context_length"] == 10000
    cpu = export(model, tokenizer, ep="cpu", output_dir=tmp_path / "cpu")
    assert json.loads((cpu.path / "genai_config.json").read_text())["model"]["context_length"] == 16384


@pytest.mark.parametrize("length, words", [(0, "must be 1 or more"), (5000, "over the model's context length (2048")])
def test_a_wrong_max_length_is_refused(tmp_path, length, words):
    with pytest.raises(ExporterError, match=words.replace("(", r"\(")):
        export("tiny-llama", output_dir=tmp_path / "pkg", max_length=length)
    assert not (tmp_path / "pkg").exists()


def test_a_context_past_float32_counts_is_refused_where_the_device_counts(tmp_path):
    """Graph-captured decoders count tokens and compare position ids in float32 on the device,
    exact to 2**24: a longer captured context is refused before anything is written. Without
    capture (and without sliding layers, whose window slots are counted the same way) it is not."""
    model, tokenizer = build_preset("tiny-llama")
    model.config.max_position_embeddings = 2**24 + 1
    stages = []
    with pytest.raises(ExporterError, match=r"over what this webgpu decoder counts exactly \(16777216 tokens"):
        export(model, tokenizer, ep="webgpu", output_dir=tmp_path / "pkg", max_length=2**24 + 1,
               on_stage=lambda name, record: stages.append(name))
    assert not (tmp_path / "pkg").exists() and set(stages) == {"load"}  # refused before the trace
    uncaptured = export(model, tokenizer, ep="webgpu", output_dir=tmp_path / "uncaptured", max_length=2**24 + 1,
                        graph_capture=False)
    assert json.loads((uncaptured.path / "genai_config.json").read_text())["model"]["context_length"] == 2**24 + 1


def test_sliding_layers_on_webgpu_count_in_float32_without_capture_too(tmp_path):
    """The webgpu profile's sliding-window attention counts a row's tokens in float32 whether or
    not the graph is captured: past 2**24 it is refused either way."""
    model, tokenizer = build_preset("tiny-gemma-4")
    model.config.get_text_config().max_position_embeddings = 2**24 + 1
    with pytest.raises(ExporterError, match=r"over what this webgpu decoder counts exactly"):
        export(model, tokenizer, ep="webgpu", output_dir=tmp_path / "pkg", max_length=2**24 + 1, graph_capture=False)
    assert not (tmp_path / "pkg").exists()
