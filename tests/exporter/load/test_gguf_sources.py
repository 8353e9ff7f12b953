"""GGUF files as sources: a ``.gguf`` file, or a folder holding one and no config.json, exports
through transformers' GGUF loader (weights dequantized to float32, whole in memory) and is a source
``check --against`` compares with; what a path holds that is not one GGUF file is refused in one line.

The real file is Google's Gemma 3 270M at Q4_K_M (F32, Q4_K, Q5_0, Q6_K and Q8_0 tensors) from the
registry's data packages (slow: about 4 minutes)."""

from __future__ import annotations

import pytest

from ep_profiles import get_profile
from exporter.cli import main
from exporter.errors import ExporterError
from exporter.load.gguf_files import gguf_file
from exporter.verify.check import check_package
from exporter.verify.check_against import reference_model
from tests.helpers.real_checkpoints import gemma3_270m_gguf


def _run_cli(args, capsys) -> tuple[int, str]:
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


@pytest.mark.unit
def test_a_gguf_source_is_the_file_or_the_one_file_of_a_folder(tmp_path):
    (tmp_path / "one").mkdir()
    only = tmp_path / "one" / "model.gguf"
    only.write_bytes(b"GGUF")
    assert gguf_file(only) == only and gguf_file(tmp_path / "one") == only
    (tmp_path / "one" / "config.json").write_text("{}")  # a Hugging Face folder: its config decides
    assert gguf_file(tmp_path / "one") is None
    (tmp_path / "other.bin").write_bytes(b"")
    assert gguf_file(tmp_path / "other.bin") is None


@pytest.mark.unit
def test_a_folder_of_several_gguf_files_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "models").mkdir()
    for name in ("a-q4_0.gguf", "a-q8_0.gguf"):
        (tmp_path / "models" / name).write_bytes(b"GGUF")
    code, message = _run_cli([str(tmp_path / "models"), "-o", str(tmp_path / "out")], capsys)
    assert code == 2
    assert message == (f"error: '{tmp_path / 'models'}' holds 2 GGUF files (a-q4_0.gguf, a-q8_0.gguf); pass the path "
                       "of the one to export")
    assert not (tmp_path / "out").exists()


@pytest.mark.unit
def test_a_damaged_gguf_file_is_refused_in_one_line(tmp_path, capsys):
    damaged = tmp_path / "model.gguf"
    damaged.write_bytes(b"GGUF" + b"\0" * 60)
    code, message = _run_cli([str(damaged), "-o", str(tmp_path / "out")], capsys)
    assert code == 2 and message.startswith(f"error: cannot read the GGUF file '{damaged}': ")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ExporterError, match="cannot read the GGUF file"):  # as check --against's source
        reference_model(str(damaged))


@pytest.mark.slow
@pytest.mark.xdist_group("real_gemma3")
def test_real_gemma3_gguf_exports_and_matches_transformers(tmp_path, capsys):
    gguf = gemma3_270m_gguf(tmp_path / "scratch")
    package = tmp_path / "package"
    assert main([str(gguf), "-o", str(package), "--no-cache"]) == 0
    shown = capsys.readouterr()
    assert (f"GGUF file {gguf.name}: 236 tensors (F32 109, Q4_K 27, Q5_0 81, Q6_K 9, Q8_0 10), dequantized to "
            "float32") in shown.out + shown.err
    findings = {f.check: f for f in check_package(package, get_profile("cpu"), against=str(gguf))}
    assert all(f.passed for f in findings.values()), [f for f in findings.values() if not f.passed]
    assert not findings["source_logits"].skipped and not findings["source_tokens"].skipped
