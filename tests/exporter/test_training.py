"""``ExportOnSave`` inside a real ``transformers.Trainer``: a package per (N-th) checkpoint, each
equal in outputs to the model it was made from, and training exactly as it is without it."""

from __future__ import annotations

import pytest
import torch
import transformers

from exporter import ExportOnSave
from tests.helpers.checkpoints import build_preset, perturb_constant_tensors
from tests.helpers.parity import check_parity

pytestmark = pytest.mark.l3


def _dataset(vocab_size: int, rows: int = 8, length: int = 12):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab_size, (rows, length), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _train(model, tokenizer, output_dir, callbacks, save_steps: int):
    arguments = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=4, save_steps=save_steps, save_strategy="steps",
        per_device_train_batch_size=2, learning_rate=5e-3, report_to=[], use_cpu=True, seed=0,
        logging_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=_dataset(model.config.vocab_size),
                                   processing_class=tokenizer, callbacks=callbacks)
    trainer.train()
    return trainer


def _tiny_llama():
    model, tokenizer = build_preset("tiny-llama")
    perturb_constant_tensors(model, seed=2)
    return model, tokenizer


def test_full_checkpoints_are_exported_from_the_folders_the_trainer_wrote(tmp_path):
    model, tokenizer = _tiny_llama()
    callback = ExportOnSave(ep="cpu")
    _train(model, tokenizer, tmp_path / "run", [callback], save_steps=2)

    assert [p.path for p in callback.exported] == [tmp_path / "run" / "onnx" / f"checkpoint-{step}-cpu-fp32"
                                                   for step in (2, 4)]
    for package, step in zip(callback.exported, (2, 4), strict=True):
        assert package.report.source == f"folder {tmp_path / 'run' / f'checkpoint-{step}'}"
        saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / f"checkpoint-{step}",
                                                                  dtype=torch.float32).eval()
        check_parity(package, saved)
    first, last = (p.path / "model.onnx.data" for p in callback.exported)
    assert first.read_bytes() != last.read_bytes(), "training moved the weights between the checkpoints"


def test_a_lora_run_exports_every_second_save_and_trains_as_without_it(tmp_path):
    peft = pytest.importorskip("peft")

    def lora_model():
        base, tokenizer = _tiny_llama()
        torch.manual_seed(3)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        return peft.get_peft_model(base, config), tokenizer

    model, tokenizer = lora_model()
    callback = ExportOnSave(ep="cpu", every=2, folder="{output_dir}/packages/step{step}")
    trained = _train(model, tokenizer, tmp_path / "run", [callback], save_steps=1).model

    assert [p.path for p in callback.exported] == [tmp_path / "run" / "packages" / f"step{s}" for s in (2, 4)]
    assert not (tmp_path / "run" / "checkpoint-4" / "config.json").exists(), "an adapters-only checkpoint"
    assert any("merged into a copy" in note for note in callback.exported[-1].report.notes)
    check_parity(callback.exported[-1], trained.get_base_model().eval())

    # The same run without the callback ends with the same weights, bit for bit.
    model, tokenizer = lora_model()
    alone = _train(model, tokenizer, tmp_path / "alone", [], save_steps=1).model
    with_exports, without = trained.state_dict(), alone.state_dict()
    assert with_exports.keys() == without.keys()
    assert all(torch.equal(with_exports[name], without[name]) for name in without)


def test_every_must_be_positive():
    with pytest.raises(ValueError, match="every must be 1 or more"):
        ExportOnSave(every=0)


def test_a_failed_export_can_warn_and_let_training_go_on(tmp_path):
    model, tokenizer = _tiny_llama()
    (tmp_path / "a-file").write_text("not a folder")
    callback = ExportOnSave(folder=str(tmp_path / "a-file" / "{checkpoint}"), on_error="warn")
    trainer = _train(model, tokenizer, tmp_path / "run", [callback], save_steps=2)
    assert trainer.state.global_step == 4 and callback.exported == []
    assert [f.split(":")[0] for f in callback.failures] == ["checkpoint-2", "checkpoint-4"]
    assert "is a file" in callback.failures[0]


def test_a_wrong_ep_or_precision_fails_before_training():
    from exporter import ExporterError

    with pytest.raises(ExporterError, match="unknown EP 'tpu'"):
        ExportOnSave(ep="tpu")
    with pytest.raises(ExporterError, match="does not run precision"):
        ExportOnSave(ep="webgpu", precision="bf16")


def test_an_option_export_does_not_take_fails_at_construction():
    """A misspelt option fails when the callback is made, not at the first save hours into training."""
    with pytest.raises(TypeError, match="ExportOnSave got options export\\(\\) does not take: text_onyl"):
        ExportOnSave(text_onyl=True)
