"""Real checkpoints: every saved tensor (persistent buffers included) comes from the checkpoint,
what the export does not read is reported, and ``check --against`` compares a package with
transformers on its source."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from exporter import ExporterError, export
from exporter.cli import main
from exporter.load.compute_dtype import cast_like_from_pretrained
from exporter.load.presets import build_preset
from tests.helpers.checkpoints import constant_saved_tensors, perturb_constant_tensors, save_checkpoint


@pytest.mark.l1
@pytest.mark.parametrize("name", ["tiny-gemma-4", "tiny-llama", "tiny-gemma2"])
def test_test_checkpoints_move_every_constant(name):
    """The lesson of layer_scalar: a test checkpoint holds no tensor at the value init gave it."""
    model, _ = build_preset(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    constant = constant_saved_tensors(model)
    assert set(perturb_constant_tensors(model)) == set(constant)
    after = model.state_dict()
    assert all(not bool((after[n] == before[n]).any()) for n in constant)
    if name == "tiny-gemma-4":
        assert "model.layers.0.layer_scalar" in constant


@pytest.fixture(scope="module")
def gemma4_checkpoint(preset_exports):
    return preset_exports.checkpoint("tiny-gemma-4")


@pytest.mark.l1
def test_streamed_package_holds_the_checkpoints_layer_scalars(gemma4_checkpoint, preset_exports):
    import onnx
    import onnx.numpy_helper

    package = preset_exports.get("tiny-gemma-4").package
    stored = {t.name: t for t in onnx.load(str(package.model_path)).graph.initializer}
    saved = load_file(str(gemma4_checkpoint.folder / "model.safetensors"))
    for layer in range(package.layout.num_layers):
        key = f"model.layers.{layer}.layer_scalar"
        value = onnx.numpy_helper.to_array(stored[f"model.{key}"])
        assert value.tolist() == saved[key].tolist() != [1.0]


def _edited_checkpoint(checkpoint, tmp_path, edit):
    folder = tmp_path / "edited"
    shutil.copytree(checkpoint.folder, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.l1
def test_a_checkpoint_tensor_the_export_does_not_read_is_reported(gemma4_checkpoint, tmp_path):
    def add_unknown(tensors):
        tensors["model.layers.0.old_name.weight"] = tensors["model.layers.0.pre_feedforward_layernorm.weight"].clone()

    folder = _edited_checkpoint(gemma4_checkpoint, tmp_path, add_unknown)
    package = export(str(folder), output_dir=tmp_path / "lenient")
    assert ("checkpoint tensors that match no tensor of the model, not read (renamed or unconverted keys?): "
            "1: model.layers.0.old_name.weight") in package.report.notes
    with pytest.raises(ExporterError, match=r"--strict: checkpoint tensors that match no tensor .*: "
                                            r"1: model.layers.0.old_name.weight \(in "):
        export(str(folder), output_dir=tmp_path / "strict", strict=True)
    assert not (tmp_path / "strict").exists()


@pytest.mark.l1
def test_a_saved_buffer_missing_from_the_checkpoint_is_an_error(gemma4_checkpoint, tmp_path, capsys):
    folder = _edited_checkpoint(gemma4_checkpoint, tmp_path, lambda t: t.pop("model.layers.3.layer_scalar"))
    assert main([str(folder), "-o", str(tmp_path / "out")]) == 2
    assert "has no tensor for 'model.layers.3.layer_scalar'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.l1
def test_a_misshapen_checkpoint_tensor_is_an_error(gemma4_checkpoint, tmp_path):
    def shrink(tensors):
        tensors["model.layers.1.self_attn.q_proj.weight"] = tensors["model.layers.1.self_attn.q_proj.weight"][:64]

    folder = _edited_checkpoint(gemma4_checkpoint, tmp_path, shrink)
    with pytest.raises(ExporterError, match=r"'model.layers.1.self_attn.q_proj.weight' in .*model.safetensors has "
                                            r"shape \[64, 64\], the model's .* needs \[128, 64\]"):
        export(str(folder), output_dir=tmp_path / "out")


@pytest.mark.l1
def test_tied_copies_that_disagree_are_refused(tmp_path):
    model, tokenizer = build_preset("tiny-gemma2")  # ties its LM head to the embedding
    folder = save_checkpoint(model, tokenizer, tmp_path / "ckpt")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] * 2
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExporterError, match="holds different values under 'lm_head.weight' and 'model.embed_tokens.weight'"):
        export(str(folder), output_dir=tmp_path / "out")


@pytest.mark.l1
def test_tied_copies_that_agree_are_read_as_one(tmp_path):
    """A tied LM head saved under its own key too (older checkpoints do) is the same tensor:
    neither key is reported unread, and --strict accepts it."""
    model, tokenizer = build_preset("tiny-gemma2")
    folder = save_checkpoint(model, tokenizer, tmp_path / "ckpt")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    package = export(str(folder), output_dir=tmp_path / "out", strict=True)
    assert not any(note.startswith("checkpoint tensors") for note in package.report.notes), package.report.notes


@pytest.mark.l1
def test_a_tensor_stored_in_the_packages_dtype_is_copied_from_its_checkpoint_bytes(gemma4_checkpoint):
    """The byte range ``verbatim_range`` gives is the tensor (or its rows) as safetensors stores it;
    a tensor the package stores in another dtype, or cut across columns, has none (it is read
    and converted)."""
    import onnx_ir as ir

    from exporter.weights.stores import SafetensorsWeights

    folder = gemma4_checkpoint.folder
    source = SafetensorsWeights(folder, {})
    saved = load_file(str(folder / "model.safetensors"))

    def read(stored):
        with open(stored.path, "rb") as file:
            file.seek(stored.offset)
            return file.read(stored.length)

    assert {t.dtype for t in saved.values()} == {torch.float32}
    for key, tensor in saved.items():
        assert read(source.verbatim_range(key, None, ir.DataType.FLOAT)) == tensor.numpy().tobytes(), key
        assert source.verbatim_range(key, None, ir.DataType.FLOAT16) is None, key
    table = saved["model.embed_tokens.weight"]
    for rows in [(slice(3, 7),), (slice(3, 7), slice(None)), (slice(0, table.shape[0]), slice(0, table.shape[1]))]:
        stored = source.verbatim_range("model.embed_tokens.weight", rows, ir.DataType.FLOAT)
        assert read(stored) == table[rows].contiguous().numpy().tobytes(), rows
    for cut in [(slice(None), slice(0, 4)), (slice(0, 8, 2),), (slice(5, 5),)]:
        assert source.verbatim_range("model.embed_tokens.weight", cut, ir.DataType.FLOAT) is None, cut


@pytest.mark.l1
def test_attach_copies_a_weight_in_the_packages_dtype_and_converts_the_others(gemma4_checkpoint, tmp_path):
    """``attach`` gives a weight kept in its checkpoint's dtype as a range of the checkpoint file
    (which onnx_ir copies file to file) and converts one kept in another dtype; both save the
    checkpoint's values."""
    import onnx
    import onnx.numpy_helper
    import onnx_ir as ir

    from exporter.weights.placeholders import WEIGHT_PLACEHOLDER, attach
    from exporter.weights.stores import SafetensorsWeights

    folder = gemma4_checkpoint.folder
    table = load_file(str(folder / "model.safetensors"))["model.embed_tokens.weight"]
    rows = (slice(2, 6),)
    graph = ir.Graph([], [], nodes=[], name="weights")
    for name, dtype in [("as_stored", ir.DataType.FLOAT), ("converted", ir.DataType.FLOAT16)]:
        placeholder = ir.ExternalTensor(WEIGHT_PLACEHOLDER, offset=None, length=None, dtype=dtype,
                                        shape=ir.Shape(table[rows].shape), name=name)
        value = ir.Value(name=name, shape=placeholder.shape, type=ir.TensorType(dtype), const_value=placeholder)
        graph.register_initializer(value)
        graph.outputs.append(value)
    model = ir.Model(graph, ir_version=10)
    recipe = ("model.embed_tokens.weight", rows)
    attach(model, SafetensorsWeights(folder, {}), {"as_stored": recipe, "converted": recipe})
    made = {name: value.const_value.raw() for name, value in graph.initializers.items()}
    assert isinstance(made["as_stored"], ir.ExternalTensor) and not isinstance(made["converted"], ir.ExternalTensor)
    ir.save(model, tmp_path / "model.onnx", external_data="model.onnx.data", size_threshold_bytes=0)
    saved = {t.name: onnx.numpy_helper.to_array(t, base_dir=str(tmp_path))
             for t in onnx.load(str(tmp_path / "model.onnx"), load_external_data=False).graph.initializer}
    assert saved["as_stored"].tobytes() == table[rows].numpy().tobytes()
    assert saved["converted"].tobytes() == table[rows].half().numpy().tobytes()


@pytest.mark.l1
def test_a_streamed_package_writes_the_bytes_of_one_exported_from_memory(preset_exports):
    """Weights copied from the checkpoint file land where the in-memory export writes the same
    values: the two packages' weight files are equal byte for byte."""
    streamed = preset_exports.get("tiny-gemma-4").package
    in_memory = preset_exports.get("tiny-gemma-4", source="memory").package
    assert (streamed.path / "model.onnx.data").read_bytes() == (in_memory.path / "model.onnx.data").read_bytes()


@pytest.mark.l1
@pytest.mark.parametrize("name", ["tiny-gemma-4", "tiny-llama"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cast_gives_the_buffers_from_pretrained_gives(name, dtype, tmp_path):
    """Rotary tables stay fp32 in a fp16 model, as transformers builds them: cast to fp16 they
    would shift every rotary angle by position x rounding error."""
    model, tokenizer = build_preset(name)
    save_checkpoint(model, tokenizer, tmp_path / "ckpt")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=dtype)
    cast_like_from_pretrained(model, dtype)
    want = dict(loaded.named_buffers())
    got = dict(model.named_buffers())
    assert want.keys() == got.keys()
    assert any(b.dtype == torch.float32 for b in want.values()), "the rotary tables are fp32"
    for buffer_name, buffer in want.items():
        assert got[buffer_name].dtype == buffer.dtype, buffer_name
        torch.testing.assert_close(got[buffer_name], buffer, rtol=0, atol=0)


@pytest.mark.l3
@pytest.mark.l4
def test_check_against_passes_on_every_family(family_export, capsys):
    exported = family_export
    assert main(["check", str(exported.package.path), "--against", str(exported.checkpoint), "--json"]) == 0
    findings = {f["check"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    assert findings["source_logits"]["passed"] and findings["source_tokens"]["passed"]
    assert "the package's greedy tokens are transformers'" in findings["source_tokens"]["detail"]


@pytest.mark.l3
@pytest.mark.l4
def test_check_against_names_where_a_package_with_a_buffer_left_at_init_parts(gemma4_checkpoint, tmp_path, capsys):
    """The bug this check exists for: one layer_scalar at its init value 1."""
    model = transformers.AutoModelForCausalLM.from_pretrained(gemma4_checkpoint.folder, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[3].layer_scalar.fill_(1.0)
    package = export(model, gemma4_checkpoint.tokenizer, output_dir=tmp_path / "wrong")
    assert main(["check", str(package.path), "--against", str(gemma4_checkpoint.folder)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  source_logits     at prompt 1, generated token 0 (position " in out
    assert "the logits differ from transformers' by" in out
    assert "FAIL  source_tokens" in out and "the package picks" in out and "where transformers picks" in out
