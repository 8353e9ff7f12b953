"""Model sources: local folders (safe loading), hub ids offline, multimodal checkpoints."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers

from exporter import ExporterError, export
from exporter.load.presets import build_preset
from exporter.load.sources import LoadOptions, load
from exporter.package.files import save_tokenizer
from exporter.trace.decoder import GenAIDecoder, input_names, make_inputs
from tests.helpers.checkpoints import perturb_constant_tensors, save_checkpoint


def _logits_match(package, model, tolerance=1e-4):
    layout = package.layout
    inputs = make_inputs(layout, 1, 5, 3, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = GenAIDecoder(model, layout)(*inputs)[0].numpy()[:, -1:]  # no padding: last token
    session = ort.InferenceSession(str(package.model_path), providers=["CPUExecutionProvider"])
    feeds = dict(zip(input_names(layout), [t.numpy() for t in (*inputs[:3], *inputs[3])], strict=True))
    got = session.run(["logits"], feeds)[0]
    return got.shape == expected.shape and float(np.max(np.abs(got - expected))) <= tolerance


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "tiny-llama"
    model, tokenizer = build_preset("tiny-llama")
    perturb_constant_tensors(model)
    save_checkpoint(model, tokenizer, folder)
    return folder, model


@pytest.mark.l3
def test_local_folder_exports_from_safetensors(llama_folder, tmp_path):
    folder, model = llama_folder
    package = export(str(folder), output_dir=tmp_path / "pkg")
    assert package.report.source == f"folder {folder}"
    assert (package.path / "tokenizer.json").is_file()
    assert _logits_match(package, model)


@pytest.mark.l1
def test_pickled_weights_need_opt_in(tmp_path):
    model, tokenizer = build_preset("tiny-llama")
    folder = tmp_path / "pickled"
    folder.mkdir()
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    tokenizer.save_pretrained(folder)
    assert not list(folder.glob("*.safetensors")) and list(folder.glob("*.bin"))
    with pytest.raises(ExporterError, match="only pickled .bin weights.*--allow-pickled-weights"):
        load(str(folder))
    loaded = load(str(folder), options=LoadOptions(allow_pickled_weights=True))
    torch.testing.assert_close(loaded.model.lm_head.weight, model.lm_head.weight)


@pytest.mark.l1
def test_hub_id_offline_names_alternatives(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ExporterError, match="cannot fetch 'google/gemma-4-E2B-it'.*preset"):
        load("gemma-4-e2b")


@pytest.mark.l1
def test_tokenizer_file_names_cannot_escape_the_package(tmp_path):
    _, tokenizer = build_preset("tiny-llama")
    tokenizer.vocab_files_names = {"tokenizer_file": "../escaped.json"}
    package_dir = tmp_path / "pkg"
    package_dir.mkdir()
    with pytest.raises(ExporterError, match="not a plain file name"):
        save_tokenizer(tokenizer, package_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]
    assert list(package_dir.iterdir()) == []


@pytest.mark.l3
@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
def test_multimodal_gemma4_exports_its_language_model(tmp_path, tied):
    """A multimodal checkpoint (what Google publishes): the text model's tensors sit under
    ``model.language_model``; the LM head is tied (or not) by the top-level flag, whatever the text
    config says; the towers' tensors are reported as left out, not as unmatched."""
    text_model, tokenizer = build_preset("tiny-gemma-4")
    config = transformers.Gemma4Config(
        text_config=text_model.config.to_dict(),  # says tie_word_embeddings=True
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16},
        audio_config=None,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    multimodal = transformers.Gemma4ForConditionalGeneration(config).eval()
    multimodal.model.language_model.load_state_dict(text_model.model.state_dict())
    perturb_constant_tensors(multimodal)
    folder = save_checkpoint(multimodal, tokenizer, tmp_path / "multimodal")
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert (reference.lm_head.weight is reference.get_input_embeddings().weight) is tied

    # Without its processor settings, a multimodal package cannot be made: a clear error.
    with pytest.raises(ExporterError, match="no image processor settings.*--text-only"):
        export(str(folder), output_dir=tmp_path / "pkg", strict=True)
    package = export(str(folder), output_dir=tmp_path / "pkg", strict=True, text_only=True)
    notes = package.report.notes
    assert any("multimodal" in note and "text-only" in note for note in notes)
    assert any(note.startswith("checkpoint tensors left out, the multimodal model's other parts") for note in notes)
    assert not any("match no tensor" in note or "never reads" in note for note in notes), notes
    assert package.layout.model_type == "gemma4_text"
    assert package.layout.shared_layer_indices == (6, 7, 8, 9)
    ids = torch.tensor([[2, 17, 42, 5, 99, 7]])
    with torch.no_grad():
        want = reference(input_ids=ids).logits[:, -1:].numpy()
    assert float(np.abs(_prefill_logits(package, ids) - want).max()) <= 1e-4


def _prefill_logits(package, ids: torch.Tensor) -> np.ndarray:
    layout = package.layout
    session = ort.InferenceSession(str(package.model_path), providers=["CPUExecutionProvider"])
    empty = make_inputs(layout, 1, ids.shape[1], 0)[3]
    feeds = [ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None], *empty]
    return session.run(["logits"], dict(zip(input_names(layout), [t.numpy() for t in feeds], strict=True)))[0]


@pytest.mark.l1
def test_multimodal_generation_defaults_come_from_the_whole_config(tmp_path):
    """Without generation_config.json, a multimodal checkpoint's end-of-sequence ids are its top-level ones."""
    text_model, tokenizer = build_preset("tiny-gemma-4")
    config = transformers.Gemma4Config(text_config=text_model.config.to_dict(), vision_config=None,
                                       audio_config=None, eos_token_id=[1, 106])
    multimodal = transformers.Gemma4ForConditionalGeneration(config)
    folder = save_checkpoint(multimodal, tokenizer, tmp_path / "multimodal")
    (folder / "generation_config.json").unlink()
    loaded = load(str(folder))
    assert loaded.generation_config.eos_token_id == [1, 106]


@pytest.mark.l3
def test_in_memory_model_is_left_as_the_caller_had_it(tmp_path):
    """Exporting from a training script must not change the model: dtype and train mode stay."""
    model, tokenizer = build_preset("tiny-llama")
    fp32_state = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(torch.bfloat16).train()
    package = export(model, tokenizer, output_dir=tmp_path / "pkg")
    assert model.training and next(model.parameters()).dtype == torch.bfloat16
    assert any("converted to float32" in note for note in package.report.notes)
    fp32_model, _ = build_preset("tiny-llama")
    fp32_model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in fp32_state.items()})
    assert _logits_match(package, fp32_model)
