"""`python -m exporter check`: passes a good package, fails a broken one with a readable reason."""

from __future__ import annotations

import json
import shutil

import pytest

from exporter.cli import main

pytestmark = pytest.mark.l1


def _broken_copy(preset_exports, tmp_path, edit, plain_attention=False):
    package = tmp_path / "package"
    shutil.copytree(preset_exports.get("tiny-llama", plain_attention=plain_attention).package.path, package)
    config_path = package / "genai_config.json"
    config = json.loads(config_path.read_text())
    edit(config)
    config_path.write_text(json.dumps(config))
    return package


def test_good_package_passes(preset_exports, capsys):
    package = preset_exports.get("tiny-gemma-4").package.path
    assert main(["check", str(package), "--ep", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True
    assert [f["check"] for f in report["findings"]] == [
        "files", "domains", "types", "buffer_limit", "genai_config", "graph_capture", "session", "smoke_generation"
    ]


def test_wrong_head_size_fails(preset_exports, tmp_path, capsys):
    def edit(config):
        config["model"]["decoder"]["head_size"] = 7

    package = _broken_copy(preset_exports, tmp_path, edit)
    assert main(["check", str(package)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  genai_config" in out and "genai_config says 2 x 7" in out
    assert out.strip().endswith("7 passed, 1 failed")


def test_missing_kv_names_fail(preset_exports, tmp_path, capsys):
    def edit(config):
        config["model"]["decoder"]["outputs"]["present_key_names"] = "present_key.%d"

    package = _broken_copy(preset_exports, tmp_path, edit)
    assert main(["check", str(package)]) == 1
    assert "past KV layers [0, 1, 2, 3] and present KV layers [] differ" in capsys.readouterr().out


def test_not_a_package(tmp_path, capsys):
    assert main(["check", str(tmp_path)]) == 1
    assert "is not a package folder" in capsys.readouterr().out
    assert main(["check", str(tmp_path), "--ep", "tpu"]) == 2


def test_shared_kv_buffer_without_group_query_attention_fails(preset_exports, tmp_path, capsys):
    """Plain attention appends to its past; a shared buffer would make it read the whole buffer."""
    def edit(config):
        config["search"]["past_present_share_buffer"] = True

    package = _broken_copy(preset_exports, tmp_path, edit, plain_attention=True)
    assert main(["check", str(package)]) == 1
    assert "past_present_share_buffer is on but 8 present outputs (e.g. present.0.key) are not written by GroupQueryAttention" in capsys.readouterr().out


@pytest.mark.l1
def test_ep_generation_may_part_only_at_a_near_tie():
    import numpy as np

    from exporter.check import _compare_generations

    logits = [np.array([0.0, 5.0, 4.9, 1.0]), np.array([3.0, 0.0, 0.0, 2.0])]
    assert _compare_generations([1, 0], logits, [1, 0], "fp32") == (True, "")
    agree, why = _compare_generations([1, 0], logits, [2, 3], "fp16")  # step 0: 5.0 vs 4.9
    assert agree and "near tie" in why
    agree, why = _compare_generations([1, 0], logits, [1, 3], "fp16")  # step 1: 3.0 vs 2.0
    assert not agree and "from step 1" in why
    assert not _compare_generations([1, 0], logits, [2, 3], "fp32")[0]


def test_an_op_on_a_type_its_schema_refuses_fails(preset_exports, tmp_path, capsys):
    """An fp32 Mul's output declared bf16: one type parameter bound to two dtypes, a graph ONNX
    Runtime refuses on every EP."""
    import onnx

    package = tmp_path / "package"
    shutil.copytree(preset_exports.get("tiny-llama").package.path, package)
    graph = onnx.load(str(package / "model.onnx"), load_external_data=False)
    mul = next(n for n in graph.graph.node if n.op_type == "Mul" and n.domain == "")
    graph.graph.value_info.append(onnx.helper.make_tensor_value_info(mul.output[0], onnx.TensorProto.BFLOAT16, None))
    onnx.save(graph, str(package / "model.onnx"))
    (package / "export_report.json").unlink()  # as another exporter's package: no sha256 to refuse the edit
    assert main(["check", str(package)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL  types             ops on types their ONNX schema does not allow: decoder: Mul {mul.name} with T " \
           "bound to tensor(float) and tensor(bfloat16)" in out, out
