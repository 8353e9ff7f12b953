"""Bad input: a one-line error that says what to do, a non-zero exit, no partial package."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from exporter import ExporterError, export, pipeline
from exporter.cli import main
from exporter.load.presets import build_preset

pytestmark = pytest.mark.l1


def _run_cli(args, capsys) -> tuple[int, str]:
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def _assert_nothing_written(parent, name):
    assert not (parent / name).exists()
    assert not [p for p in parent.iterdir() if ".partial-" in p.name], "staging folder left behind"


def test_unknown_name(tmp_path, capsys):
    code, message = _run_cli(["no-such-model", "-o", str(tmp_path / "out")], capsys)
    assert code == 2
    assert message.startswith("error: unknown model 'no-such-model'") and "python -m exporter list" in message
    _assert_nothing_written(tmp_path, "out")


def test_a_near_miss_gets_a_suggestion(tmp_path, capsys):
    code, message = _run_cli(["tiny-lama", "-o", str(tmp_path / "out")], capsys)
    assert code == 2 and "did you mean 'tiny-llama'?" in message
    _assert_nothing_written(tmp_path, "out")


def test_every_subcommand_has_its_own_help(capsys):
    for command in ("list", "plan", "check"):
        with pytest.raises(SystemExit) as exited:
            main([command, "--help"])
        assert exited.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: python -m exporter {command}")


def test_missing_path(tmp_path, capsys):
    code, message = _run_cli([str(tmp_path / "missing" / "model"), "-o", str(tmp_path / "out")], capsys)
    assert code == 2 and "does not exist" in message
    _assert_nothing_written(tmp_path, "out")


def test_folder_without_config(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    code, message = _run_cli([str(tmp_path / "model"), "-o", str(tmp_path / "out")], capsys)
    assert code == 2 and "has no config.json" in message
    _assert_nothing_written(tmp_path, "out")


def test_encoder_model_is_refused(tmp_path, capsys):
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=128)
    transformers.BertForMaskedLM(config).save_pretrained(tmp_path / "bert")
    code, message = _run_cli([str(tmp_path / "bert"), "-o", str(tmp_path / "out")], capsys)
    assert code == 2
    assert "BertForMaskedLM is not a decoder language model" in message
    _assert_nothing_written(tmp_path, "out")


def test_existing_output_folder_is_refused(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("user data")
    code, message = _run_cli(["tiny-llama", "-o", str(tmp_path / "out")], capsys)
    assert code == 2 and "exists" in message and "--overwrite" in message
    assert (tmp_path / "out" / "keep.txt").read_text() == "user data"


def test_overwrite_refuses_a_folder_that_is_not_a_package(tmp_path, capsys):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("user data")
    code, message = _run_cli(["tiny-llama", "-o", str(tmp_path / "home"), "--overwrite"], capsys)
    assert code == 2 and "is not a package" in message
    assert (tmp_path / "home" / "notes.txt").read_text() == "user data"


def test_unsupported_ep_and_precision(tmp_path, capsys):
    code, message = _run_cli(["tiny-llama", "--ep", "webgpu", "--precision", "bf16", "-o", str(tmp_path / "a")], capsys)
    assert code == 2 and "EP 'webgpu' does not run precision 'bf16'" in message and "fp16" in message
    code, message = _run_cli(["tiny-llama", "--ep", "tpu", "-o", str(tmp_path / "b")], capsys)
    assert code == 2 and "unknown EP 'tpu'" in message and "webgpu" in message
    with pytest.raises(SystemExit) as exited:
        main(["tiny-llama", "--precision", "int2", "-o", str(tmp_path / "c")])
    assert exited.value.code == 2 and "invalid choice: 'int2'" in capsys.readouterr().err
    code, message = _run_cli(["tiny-llama", "--precision", "int4", "--int4-8bit", "lm_head,attention", "-o",
                              str(tmp_path / "g")], capsys)
    assert code == 2 and "unknown 8-bit role 'attention'" in message and "sensitive_layers" in message
    code, message = _run_cli(["tiny-llama", "--precision", "int8", "--int4-8bit", "lm_head", "-o",
                              str(tmp_path / "h")], capsys)
    assert code == 2 and "--int4-8bit applies to --precision int4, not int8" in message
    code, message = _run_cli(["tiny-llama", "--ep", "cuda", "--precision", "int4", "--int4-8bit", "lm_head", "-o",
                              str(tmp_path / "i")], capsys)
    assert code == 2 and "EP 'cuda' was not measured running 8-bit weights" in message
    code, message = _run_cli(["tiny-llama", "--ep", "webgpu", "--precision", "int4", "--int4-method", "hqq", "-o",
                              str(tmp_path / "j")], capsys)
    assert code == 2 and "EP 'webgpu' was not measured running MatMulNBits with float zero points" in message
    code, message = _run_cli(["tiny-llama", "--int4-block-size", "64", "-o", str(tmp_path / "e")], capsys)
    assert code == 2 and "--int4-block-size applies to --precision int4, not fp32" in message
    code, message = _run_cli(["tiny-llama", "--precision", "int4", "--int4-block-size", "24", "-o",
                              str(tmp_path / "f")], capsys)
    assert code == 2 and "power of two" in message
    code, message = _run_cli(["tiny-llama", "--ep", "cpu", "--precision", "bf16", "-o", str(tmp_path / "d")], capsys)
    assert code == 2 and "EP 'cpu' does not run precision 'bf16'" in message
    assert list(tmp_path.iterdir()) == []


def test_export_failing_midway_leaves_nothing(tmp_path, capsys, monkeypatch):
    def broken_lowering(*args):
        raise RuntimeError("simulated lowering failure")

    monkeypatch.setattr(pipeline, "lower", broken_lowering)
    code, message = _run_cli(["tiny-llama", "-o", str(tmp_path / "out")], capsys)
    assert code == 1  # not the input's fault: a bug, as the README's exit codes say
    assert message == (
        "error: lowering to ONNX failed: RuntimeError: simulated lowering failure "
        "(rerun with --debug for the traceback; please report it with the model's config)"
    )
    _assert_nothing_written(tmp_path, "out")


def test_failure_while_writing_removes_the_staging_folder(tmp_path, monkeypatch):
    from exporter.package import files as package

    def broken_save(*args):
        raise OSError("disk full")

    monkeypatch.setattr(package, "save_tokenizer", broken_save)
    model, tokenizer = build_preset("tiny-llama")
    with pytest.raises(OSError, match="disk full"):
        export(model, tokenizer, output_dir=tmp_path / "out")
    _assert_nothing_written(tmp_path, "out")


def test_in_memory_model_needs_its_tokenizer(tmp_path):
    model, _ = build_preset("tiny-llama")
    with pytest.raises(ExporterError, match="needs the model's tokenizer"):
        export(model, output_dir=tmp_path / "out")


def test_remote_code_stays_off(tmp_path, capsys):
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "my_custom_lm",
        "architectures": ["MyCustomForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"},
    }))
    (folder / "configuration_custom.py").write_text("raise SystemExit('remote code ran')\n")
    code, message = _run_cli([str(folder), "-o", str(tmp_path / "out")], capsys)
    assert code == 2 and "--trust-remote-code" in message
    _assert_nothing_written(tmp_path, "out")


@pytest.mark.parametrize("quantization", [
    {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True},
    {"quant_method": "bitsandbytes", "load_in_4bit": True},
])
def test_a_checkpoint_quantized_in_a_form_not_read_is_refused(quantization, preset_exports, tmp_path, capsys):
    """Its weights are packed integers under other names (AWQ's ``qweight``); only formats
    transformers dequantizes on load and that are tested here (gpt-oss's MXFP4, fine-grained FP8)
    are read, through its quantizer's converters."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "quantized"
    shutil.copytree(preset_exports.checkpoint("tiny-llama").folder, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    for key in [key for key in tensors if key.endswith("proj.weight")]:
        tensors[key.removesuffix("weight") + "qweight"] = tensors.pop(key).to(torch.int32)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    code, message = _run_cli([str(folder), "-o", str(tmp_path / "out")], capsys)
    assert code == 2 and message.startswith(f"error: the checkpoint is pre-quantized ({quantization['quant_method']})")
    assert "export a float checkpoint of it" in message
    _assert_nothing_written(tmp_path, "out")


def test_a_float_checkpoint_with_a_stale_quantization_config_exports(preset_exports, tmp_path):
    """A merged fine-tune can keep the quantization_config of the adapter's base (QLoRA's
    bitsandbytes) over float weights: those weights are read as they are."""
    folder = tmp_path / "merged"
    shutil.copytree(preset_exports.checkpoint("tiny-llama").folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "bitsandbytes", "load_in_4bit": True}}))
    package = export(str(folder), output_dir=tmp_path / "out", strict=True, cache=False)
    assert not any("dequantized" in note for note in package.report.notes)
