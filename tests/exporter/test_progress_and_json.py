"""What an export shows while it runs (stage lines; a bar of bytes written on a terminal only) and
the ``--json`` summary CI scripts read."""

from __future__ import annotations

import io
import json
import sys

import pytest

from exporter import export
from exporter.cli import main

pytestmark = pytest.mark.l1


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "log"])
def test_progress_shows_stages_and_on_a_terminal_the_bytes_written(tmp_path, monkeypatch, terminal):
    stream = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    package = export("tiny-llama", output_dir=tmp_path / "pkg", progress=True)
    shown = stream.getvalue()
    for stage in ("loading the model", "tracing with torch.export", "lowering to ONNX", "writing the package"):
        assert f"  {stage}: " in shown, shown
    import onnx_ir as ir

    from exporter.package.files import external_tensors

    tensors, _ = external_tensors(ir.load(package.model_path))  # those in model.onnx.data
    assert 0 < tensors < package.report.decoder.initializers["count"]  # tiny norms stay in model.onnx
    if terminal:
        assert f"{tensors}/{tensors} tensors" in shown and "B/s" in shown, shown
    else:
        assert "tensors" not in shown and "\r" not in shown, shown  # a log gets plain lines only


def test_the_api_prints_nothing_by_default(tmp_path, capsys):
    export("tiny-llama", output_dir=tmp_path / "pkg")
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_json_summary_describes_the_package(tmp_path, capsys):
    out = tmp_path / "pkg"
    assert main(["tiny-llama", "-o", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    report = json.loads((out / "export_report.json").read_text())
    assert summary["ok"] is True and summary["package"] == str(out.resolve())
    assert (summary["ep"], summary["precision"]) == ("cpu", "fp32")
    assert list(summary["sessions"]) == ["decoder"]
    decoder = summary["sessions"]["decoder"]
    assert decoder["file"] == "model.onnx"
    assert decoder["onnx_nodes"] == sum(report["sessions"]["decoder"]["op_counts"].values())
    assert decoder["fx_passes"] == [p["name"] for p in report["sessions"]["decoder"]["fx_passes"]]
    assert "gather_last_token" in decoder["fx_passes"]
    assert decoder["lowering"] == report["sessions"]["decoder"]["lowering"] == "without torch.onnx's decomposition re-trace"
    for name, size in summary["files"].items():
        assert (out / name).stat().st_size == size, name
    assert summary["package_bytes"] == sum(summary["files"].values())
    assert {"export_report.json", "export_report.md", "model.onnx.data"} <= set(summary["files"])
    assert [s["name"] for s in summary["stages"]] == [s["name"] for s in report["stages"]]
    assert summary["notes"] == report["notes"]


def test_json_failure_is_json_too(tmp_path, capsys):
    assert main(["tiny-lama", "-o", str(tmp_path / "pkg"), "--json"]) == 2
    captured = capsys.readouterr()
    failure = json.loads(captured.out)
    assert failure["ok"] is False and failure["exit_code"] == 2
    assert "did you mean 'tiny-llama'" in failure["error"]
    assert captured.err.strip().splitlines()[-1] == f"error: {failure['error']}"
    assert not (tmp_path / "pkg").exists()


def test_a_failed_stage_ends_its_line(tmp_path, monkeypatch):
    from exporter import pipeline
    from exporter.errors import ExporterError

    def failing_lower(*args, **kwargs):
        raise ExporterError("simulated")

    monkeypatch.setattr(pipeline, "lower", failing_lower)
    stream = _Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    with pytest.raises(ExporterError):
        export("tiny-llama", output_dir=tmp_path / "pkg", progress=True)
    shown = stream.getvalue()
    assert shown.endswith("  lowering to ONNX: failed after 0.0 s" + " " * 32 + "\n"), repr(shown[-200:])
    import time

    time.sleep(1.2)  # the ticker would have printed twice by now
    assert stream.getvalue() == shown


def test_json_argument_errors_are_json_too(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["tiny-llama", "--precision", "fp8", "--json"])
    assert exited.value.code == 2
    failure = json.loads(capsys.readouterr().out)
    assert failure["ok"] is False and "invalid choice: 'fp8'" in failure["error"]


def test_the_default_output_of_a_dot_folder_is_named_after_it(tmp_path, monkeypatch, capsys):
    from exporter.load.presets import build_preset
    from tests.helpers.checkpoints import save_checkpoint

    folder = save_checkpoint(*build_preset("tiny-llama"), tmp_path / "my-model")
    monkeypatch.chdir(folder)
    assert main(["."]) == 0
    assert (folder / "my-model-cpu-fp32" / "genai_config.json").is_file()
