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

    from exporter.package import external_tensors

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
    for name, size in summary["files"].items():
        assert (out / name).stat().st_size == size, name
    assert summary["package_bytes"] == sum(summary["files"].values())
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
