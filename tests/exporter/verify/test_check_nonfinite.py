"""`python -m exporter check` never passes a number that is not finite (issue 38).

NaN compares false with any bound, so a package whose logits were all NaN passed: ``source_logits``
saw a largest difference of 0, and the greedy generations picked token 0 at every step, in the
vocabulary. Each package here is an exported one with one graph output edited (a Mul by NaN, an Add
of +Inf, ...), so the failure is known exactly and named by its step.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from ep_profiles import get_profile
from exporter import export
from exporter.cli import main
from exporter.verify.check import Finding, _check_smoke_generation, _Context, check_package
from exporter.verify.check_against import degenerate_repeat
from exporter.verify.distribution import nonfinite

pytestmark = pytest.mark.l1

REPEATED = 7  # the token the "repeat" edit makes the package pick at every step (not tiny-llama's end)


def _edit_output(package: Path, model_file: str, output: str, kind: str) -> None:
    """Rewrite ``model_file`` so that graph output ``output`` becomes, by ``kind``:
    "nan": every value NaN; "inf": the last value along its last axis +Inf;
    "nan_after_prefill": every value NaN from the first decode step on (the prompt's run is sound);
    "repeat": 0 everywhere but 1 at token REPEATED (finite logits that pick one token forever)."""
    model = onnx.load(str(package / model_file), load_external_data=False)
    graph, before = model.graph, f"{output}_before_edit"
    for node in graph.node:
        node.input[:] = [before if name == output else name for name in node.input]
        node.output[:] = [before if name == output else name for name in node.output]
    declared = next(o for o in graph.output if o.name == output).type.tensor_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(declared.elem_type)
    width = declared.shape.dim[-1].dim_value

    def constant(name, values, of=dtype):
        graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(values, dtype=of), name))
        return name

    make = onnx.helper.make_node
    if kind == "nan":
        nodes = [make("Mul", [before, constant("edit_nan", np.nan)], [output])]
    elif kind == "inf":
        nodes = [make("Add", [before, constant("edit_inf", [0.0] * (width - 1) + [np.inf])], [output])]
    elif kind == "repeat":
        nodes = [make("Mul", [before, constant("edit_zero", 0.0)], ["edit_zeros"]),
                 make("Add", ["edit_zeros", constant("edit_one_hot", np.eye(width)[REPEATED])], [output])]
    elif kind == "nan_after_prefill":  # a decode step feeds one position
        nodes = [make("Shape", ["position_ids"], ["edit_positions"], start=1, end=2),
                 make("Equal", ["edit_positions", constant("edit_single", [1], np.int64)], ["edit_decoding"]),
                 make("Where", ["edit_decoding", constant("edit_nan", np.nan), constant("edit_one", 1.0)], ["edit_factor"]),
                 make("Mul", [before, "edit_factor"], [output])]
    graph.node.extend(nodes)
    onnx.save(model, str(package / model_file))
    (package / "export_report.json").unlink()  # as another exporter's package: no sha256 to refuse the edit


def _edited_copy(source: Path, tmp_path: Path, model_file: str, output: str, kind: str) -> Path:
    package = tmp_path / "package"
    shutil.copytree(source, package)
    _edit_output(package, model_file, output, kind)
    return package


@pytest.fixture(scope="module")
def tiny_llama(preset_exports):
    return preset_exports.get("tiny-llama")


@pytest.fixture(scope="module")
def multimodal_package(tmp_path_factory) -> Path:
    from tests.helpers.checkpoints import save_multimodal_checkpoint

    folder = tmp_path_factory.mktemp("multimodal")
    checkpoint = save_multimodal_checkpoint(folder / "checkpoint")
    return export(str(checkpoint), ep="cpu", precision="fp32", output_dir=folder / "package").path


def test_nonfinite_counts_nan_and_each_infinity():
    assert nonfinite(np.array([1.0, np.nan, np.inf, -np.inf, np.nan], dtype=np.float32)) == \
        "2 NaN, 1 +Inf, 1 -Inf of 5 values"
    assert nonfinite(np.array([1.0, -3e38, 0.0], dtype=np.float32)) is None


def test_bf16_session_outputs_are_read_as_float32(tmp_path):
    """onnxruntime gives no numpy array for a bf16 output (a bf16 tower's features): they are
    widened bit for bit, a NaN and an Inf kept."""
    from exporter.verify.ep_runtime import float32_outputs, inference_session

    make = onnx.helper
    graph = make.make_graph([make.make_node("Cast", ["x"], ["y"], to=onnx.TensorProto.BFLOAT16)], "cast",
                            [make.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])],
                            [make.make_tensor_value_info("y", onnx.TensorProto.BFLOAT16, [4])])
    onnx.save(make.make_model(graph, opset_imports=[make.make_opsetid("", 21)]), str(tmp_path / "cast.onnx"))
    session = inference_session(tmp_path / "cast.onnx", get_profile("cpu"), {})
    values = np.array([1.5, -2.0, np.nan, np.inf], dtype=np.float32)  # each exact in bf16
    y = float32_outputs(session, {"x": values})["y"]
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, values)  # NaN equal to NaN here
    assert nonfinite(y) == "1 NaN, 1 +Inf of 4 values"


@pytest.mark.parametrize("kind, detail", [
    ("nan", "on CPU, logits at step 0 (prefill) not finite: 512 NaN of 512 values"),
    ("inf", "on CPU, logits at step 0 (prefill) not finite: 1 +Inf of 512 values"),
    ("nan_after_prefill", "on CPU, logits at step 1 not finite: 512 NaN of 512 values"),
])
def test_logits_not_finite_fail_smoke_generation_at_their_step(tiny_llama, tmp_path, capsys, kind, detail):
    package = _edited_copy(tiny_llama.package.path, tmp_path, "model.onnx", "logits", kind)
    assert main(["check", str(package), "--json"]) == 1
    findings = {f["check"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    assert findings["smoke_generation"] == {"check": "smoke_generation", "passed": False, "detail": detail,
                                            "skipped": False}
    assert all(f["passed"] for check, f in findings.items() if check != "smoke_generation"), findings


def test_ep_generation_fails_on_logits_not_finite(tiny_llama, tmp_path, monkeypatch):
    """The EP run's own logits are read (only its tokens were, equal to the CPU's: token 0 from NaN
    on both). A cpu package names no provider, so GenAI runs the "EP" run on the CPU here: the EP's
    registration, the one thing it adds, is stubbed."""
    package = _edited_copy(tiny_llama.package.path, tmp_path, "model.onnx", "logits", "nan")
    monkeypatch.setattr("exporter.verify.ep_runtime.register", lambda profile, genai=False: None)
    findings = list(_check_smoke_generation(_Context(package, get_profile("webgpu"))))
    step_0 = "logits at step 0 (prefill) not finite: 512 NaN of 512 values"
    assert findings == [Finding("smoke_generation", False, f"on CPU, {step_0}"),
                        Finding("ep_generation", False, f"on WebGpuExecutionProvider, {step_0}")]


@pytest.mark.l4
def test_against_fails_logits_not_finite_at_their_step(tiny_llama, tmp_path):
    """The bug: ``source_logits`` said "max |logit difference| 0" for all-NaN logits."""
    package = _edited_copy(tiny_llama.package.path, tmp_path, "model.onnx", "logits", "nan")
    findings = {f.check: f for f in check_package(package, get_profile("cpu"), against=str(tiny_llama.checkpoint))}
    for check in ("source_logits", "source_tokens"):
        assert not findings[check].passed
        assert re.fullmatch(r"at prompt 1, generated token 0 \(position \d+\) the package's logits are not finite: "
                            r"512 NaN of 512 values", findings[check].detail), findings[check].detail


@pytest.mark.l4
def test_against_fails_a_degenerate_repeat(tiny_llama, tmp_path):
    """Finite logits that pick one token from the first step on pass the checks without a reference
    (its tokens are in the vocabulary); transformers, picking others, fails them."""
    package = _edited_copy(tiny_llama.package.path, tmp_path, "model.onnx", "logits", "repeat")
    findings = {f.check: f for f in check_package(package, get_profile("cpu"), against=str(tiny_llama.checkpoint))}
    assert findings["smoke_generation"].passed and findings["smoke_generation"].detail.endswith(f"{[REPEATED] * 8}")
    assert not findings["source_tokens"].passed
    assert re.fullmatch(rf"at prompt 1 the package picks {REPEATED} '.*' at every step from generated token 0 "
                        r"\(16 steps\), transformers at [0-8] of them: a degenerate repeat",
                        findings["source_tokens"].detail), findings["source_tokens"].detail


def test_degenerate_repeat_fails_even_where_every_step_is_a_near_tie():
    """One token at every step is a failure where transformers picks it at most at half of them,
    however close its logits (flat ones make every step a near tie); a model that itself repeats
    the token may part from it once."""
    near_tie = [np.array([0.0, 1e-4, 0.0]), np.array([1e-4, 0.0, 0.0]), np.array([0.0, 0.0, 1e-4]),
                np.array([0.0, 1e-4, 0.0])]
    assert degenerate_repeat(near_tie, [0, 0, 0, 0]) == (0, 1)
    assert degenerate_repeat(near_tie, [1, 1, 1, 1]) == (1, 2)
    itself = [np.array([0.0, 1.0, 0.0])] * 3 + [np.array([0.0, 1.0, 1.0 + 1e-4])]
    assert degenerate_repeat(itself, [1, 1, 1, 1]) is None  # transformers repeats it too, but once
    assert degenerate_repeat(near_tie, [0, 1, 0, 0]) is None  # not one token
    assert degenerate_repeat(near_tie[:1], [1]) is None  # one step is no repeat


def test_multimodal_session_outputs_not_finite_fail(multimodal_package, tmp_path):
    """Each session the multimodal generation runs is named, not the logits its NaN reaches (one
    test, so that one worker exports the package)."""
    for model_file, output, where in (
        ("vision/model.onnx", "image_features", "vision output image_features"),
        ("speech/model.onnx", "audio_features", "speech output audio_features"),
        ("embedding/model.onnx", "inputs_embeds", "embedding output inputs_embeds at step 0 (prefill)"),
    ):
        package = _edited_copy(multimodal_package, tmp_path / output, model_file, output, "nan")
        findings = {f.check: f for f in check_package(package, get_profile("cpu"))}
        finding = findings["multimodal_generation"]
        assert not finding.passed
        assert re.fullmatch(rf"on CPU from a generated image and audio, {re.escape(where)} not finite: (\d+) NaN of \1 "
                            "values", finding.detail), finding.detail
        assert findings["multimodal_config"].passed and findings[f"session_{model_file.split('/')[0]}"].passed
