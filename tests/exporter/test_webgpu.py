"""WebGPU packages: graph structure everywhere (L1), and on ONNX Runtime's WebGPU EP over a
software Vulkan adapter (L5: Mesa's lavapipe, installed by scripts/install_webgpu_stack.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx_ir as ir
import onnxruntime_genai as og
import pytest

from ep_profiles import PLAIN_ATTENTION
from exporter import ExporterError, export
from exporter.onnx_passes import ONNX_PASSES
from exporter.verify import postconditions
from exporter.verify.ep_runtime import inference_session, placement
from tests.helpers.genai_greedy import GREEDY_SCRIPT as GREEDY
from tests.helpers.genai_greedy import greedy
from tests.helpers.webgpu import WEBGPU, require_webgpu

pytestmark = pytest.mark.xdist_group("webgpu")


@pytest.fixture(scope="module")
def webgpu_exports(preset_exports, tmp_path_factory):
    """tiny-gemma-4's test checkpoint for cpu (shared fixture), and the same checkpoint folder for
    webgpu with and without graph capture."""
    cpu = preset_exports.get("tiny-gemma-4")
    root = tmp_path_factory.mktemp("webgpu")
    # fp32, as the cpu package: the generation test compares tokens exactly (fp16 is test_precisions').
    folder = str(cpu.checkpoint)
    captured = export(folder, ep="webgpu", precision="fp32", output_dir=root / "captured")
    uncaptured = export(folder, ep="webgpu", precision="fp32", graph_capture=False, output_dir=root / "uncaptured")
    return cpu, captured, uncaptured


@pytest.mark.l1
def test_webgpu_package_is_ready_for_graph_capture(webgpu_exports):
    _, captured, uncaptured = webgpu_exports
    model = ir.load(captured.model_path)
    assert postconditions.cpu_placed_nodes(model) == []
    config = json.loads((captured.path / "genai_config.json").read_text())
    assert config["model"]["decoder"]["session_options"]["provider_options"] == [
        {"webgpu": {"enableGraphCapture": "1", "validationMode": "disabled"}}]
    assert config["search"]["past_present_share_buffer"] is True
    gqa = next(r for r in captured.report.fx_passes if r["name"] == "substitute_group_query_attention")["changes"]
    # Every sliding layer attends over its window's slots; full layers keep GroupQueryAttention.
    assert gqa["window_mask_layers"] == gqa["sliding_window_layers"] > 0
    assert captured.report.op_counts["com.microsoft.GroupQueryAttention"] < captured.layout.num_layers
    # Dispatches per step: one window-slot computation for all sliding layers and one last-token
    # choice for all the gathers, no full-range Slice left (transformers' x[:, :, i] of the
    # per-layer inputs: Tidy turns them into nothing).
    assert captured.report.op_counts["CumSum"] == 3  # the slots' two counts and the first maximum, once
    full_slices = [n for n in model.graph if n.op_type == "Slice" and _is_full_range(n)]
    assert full_slices == []
    assert captured.report.onnx_pass_changes("tidy")["full_range_slices_removed"] >= 2 * captured.layout.num_layers
    # Without graph capture the shape arithmetic stays (the CPU may run it).
    assert postconditions.cpu_placed_nodes(ir.load(uncaptured.model_path))
    uncaptured_config = json.loads((uncaptured.path / "genai_config.json").read_text())
    assert uncaptured_config["model"]["decoder"]["session_options"]["provider_options"] == [
        {"webgpu": {"enableGraphCapture": "0"}}]


def _is_full_range(node) -> bool:
    """A Slice from 0 to INT64_MAX-like ends with step 1 on every axis it names."""
    data, starts, ends, axes, steps = [*node.inputs, None, None][:5]
    bounds = [ir.convenience.get_const_tensor(value) for value in (starts, ends)]
    step = ir.convenience.get_const_tensor(steps) if steps is not None else None
    if any(bound is None for bound in bounds) or (steps is not None and step is None):
        return False
    starts, ends = (bound.numpy().tolist() for bound in bounds)
    steps = step.numpy().tolist() if step is not None else [1] * len(starts)
    return all(s == 0 and e >= 2**62 and k == 1 for s, e, k in zip(starts, ends, steps, strict=True))


@pytest.mark.l1
def test_graph_capture_export_fails_when_cpu_nodes_remain(preset_exports, tmp_path, monkeypatch):
    """Without the constant-Reshape rewrite the graph keeps shape arithmetic: the export must say
    so, name the nodes, and leave nothing behind."""
    exported = preset_exports.get("tiny-gemma-4")
    monkeypatch.setattr(ONNX_PASSES["static_reshape_targets"], "applies", lambda settings, session: None)
    with pytest.raises(ExporterError, match=r"captures the decoder's graph, but \d+ nodes would run on the CPU "
                                            r"\(Shape .*--no-graph-capture"):
        export(exported.model, exported.tokenizer, ep="webgpu", output_dir=tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.l1
def test_graph_capture_without_a_shared_kv_buffer_is_refused(preset_exports, tmp_path):
    """A capturing profile whose attention is not GroupQueryAttention cannot share the KV buffer,
    which ONNX Runtime GenAI's graph capture requires: the export says so instead of writing a
    package GenAI would refuse."""
    import dataclasses

    exported = preset_exports.get("tiny-gemma-4")
    plain = dataclasses.replace(WEBGPU, attention_op=PLAIN_ATTENTION)
    with pytest.raises(ExporterError, match="captures the decoder's graph, which needs every present KV written"):
        export(exported.model, exported.tokenizer, ep=plain, output_dir=tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.l5
def test_every_decoder_node_runs_on_webgpu(webgpu_exports):
    require_webgpu()
    _, captured, _ = webgpu_exports
    session = inference_session(captured.model_path, WEBGPU, WEBGPU.genai_provider_options())
    assert session.get_providers()[0] == "WebGpuExecutionProvider"
    placed = placement(session)
    assert set(placed) == {"WebGpuExecutionProvider"}, {ep: dict(ops) for ep, ops in placed.items()}


@pytest.mark.l5
def test_without_the_rewrites_graph_capture_is_refused(webgpu_exports):
    """Proof the placement test can fail: the package exported without graph capture keeps shape
    arithmetic, and ONNX Runtime refuses to capture it."""
    require_webgpu()
    _, _, uncaptured = webgpu_exports
    with pytest.raises(Exception, match="cannot use the graph capture feature"):
        inference_session(uncaptured.model_path, WEBGPU, WEBGPU.genai_provider_options())


def _webgpu_greedy(package: Path, prompts: list[list[int]], new_tokens: int,
                   mode: str = "one by one") -> tuple[list[list[int]], str]:
    env = dict(os.environ, ORTGENAI_ORT_VERBOSE_LOGGING="1")
    done = subprocess.run([sys.executable, str(GREEDY), str(package), "webgpu", json.dumps(prompts), str(new_tokens),
                           mode], check=False, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.l5
def test_graph_capture_generation_matches_cpu_past_the_window(webgpu_exports):
    """Greedy tokens of the captured WebGPU package == the CPU package's, for a prompt shorter
    than the sliding window generating 3 windows' worth, and a prompt longer than the window
    (the WebGPU GroupQueryAttention window bug would diverge right after the window)."""
    require_webgpu()
    cpu, captured, _ = webgpu_exports
    window = cpu.package.layout.sliding_window
    short = [(7 * i + 3) % 500 + 5 for i in range(6)]
    long = [(11 * i + 1) % 500 + 5 for i in range(window + 8)]
    cases = [([short], 3 * window), ([long], window + 8)]
    for prompts, new_tokens in cases:
        want = greedy(og.Model(str(cpu.package.path)), prompts, new_tokens)
        got, log = _webgpu_greedy(captured.path, prompts, new_tokens)
        assert got == want
        assert "This session will use the graph capture feature" in log
        # The first token comes from the (uncaptured) prompt run, the first decode step captures,
        # and every later step replays.
        assert log.count("Replaying the captured WebGpuExecutionProvider graph") == len(got[0]) - 2 > 0


@pytest.mark.l5
def test_batched_generation_matches_cpu_past_the_window(webgpu_exports):
    """A batch of two prompts longer than the window, both packages (with and without capture):
    the window attention's slots and bias are computed per row."""
    from tests.helpers.genai_greedy import batched_greedy

    require_webgpu()
    cpu, captured, uncaptured = webgpu_exports
    window = cpu.package.layout.sliding_window
    prompts = [[(13 * i + 2) % 500 + 5 for i in range(window + 4)], [(5 * i + 9) % 500 + 5 for i in range(window + 4)]]
    want = batched_greedy(og.Model(str(cpu.package.path)), prompts, window + 8)
    assert want[0] != want[1]
    for package in (captured, uncaptured):
        got, _ = _webgpu_greedy(package.path, prompts, window + 8, "batched")
        assert got == want


@pytest.mark.l5
def test_batch_of_unequal_prompts_matches_each_prompt_alone(webgpu_exports):
    """Prompts of three lengths in one batch, the shorter right-padded as GenAI pads them: each
    row's tokens == that prompt's alone on the CPU package, with and without capture. The captured
    decoder finds each row's last real token from its position ids (it once took the last
    position, a padding token, and the short rows went wrong from their first token)."""
    from tests.helpers.genai_greedy import package_pad_token_id

    require_webgpu()
    cpu, captured, uncaptured = webgpu_exports
    window = cpu.package.layout.sliding_window
    pad = package_pad_token_id(cpu.package.path)
    lengths = (window + 4, 9, 1)
    prompts = [[(7 * i + 5 * row) % 500 + 5 for i in range(length)] for row, length in enumerate(lengths)]
    assert all(pad not in prompt for prompt in prompts)
    want = greedy(og.Model(str(cpu.package.path)), prompts, window + 8)
    for package in (captured, uncaptured):
        got, log = _webgpu_greedy(package.path, prompts, window + 8, "batched")
        assert got == want, package.path.name
        assert ("Replaying the captured WebGpuExecutionProvider graph" in log) == (package is captured)


@pytest.mark.l5
def test_check_command_places_the_package_on_webgpu(webgpu_exports, capsys):
    from exporter.cli import main

    require_webgpu()
    _, captured, uncaptured = webgpu_exports
    assert main(["check", str(captured.path), "--ep", "webgpu"]) == 0
    out = capsys.readouterr().out
    assert "PASS  session" in out and "nodes run on WebGpuExecutionProvider" in out
    assert "PASS  ep_generation" in out and "SKIP" not in out
    # Without capture the CPU may take the shape arithmetic; the check says where it went.
    assert main(["check", str(uncaptured.path), "--ep", "webgpu"]) == 0
    assert "on CPUExecutionProvider (" in capsys.readouterr().out


@pytest.mark.l1
def test_check_fails_a_captured_package_with_cpu_shape_work(webgpu_exports, tmp_path, capsys):
    """`check` runs the export's own post-condition: a package that asks for graph capture but
    computes shapes on the CPU fails, naming the nodes, whether or not the EP is installed."""
    import shutil

    from exporter.cli import main

    _, _, uncaptured = webgpu_exports
    package = tmp_path / "package"
    shutil.copytree(uncaptured.path, package)
    config = json.loads((package / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["provider_options"] = [{"webgpu": {"enableGraphCapture": "1"}}]
    (package / "genai_config.json").write_text(json.dumps(config))
    main(["check", str(package), "--ep", "webgpu"])
    out = capsys.readouterr().out
    assert "FAIL  graph_capture" in out and "nodes would run on the CPU (Shape" in out


@pytest.mark.l5
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_int4_routed_experts_run_as_qmoe_on_the_ep_with_the_graph_captured(preset, tmp_path):
    """int4: the experts become QMoE, which the WebGPU plugin runs (its float MoE it does not), fed
    [batch, seq, hidden] so no shape work is left on the CPU; every node on the EP, the captured
    package's greedy tokens on the EP those of the CPU EP (near-tie rule of ``check``)."""
    from exporter.load.presets import build_preset
    from exporter.verify.check import check_package

    require_webgpu()
    model, tokenizer = build_preset(preset)
    package = export(model, tokenizer, ep="webgpu", precision="int4", output_dir=tmp_path / "out", cache=False)
    assert package.report.op_counts.get("com.microsoft.QMoE") == package.layout.experts_modules > 0
    assert "com.microsoft.MoE" not in package.report.op_counts
    findings = {f.check: f for f in check_package(package.path, WEBGPU)}
    assert findings["session"].detail.startswith("all ") and "WebGpuExecutionProvider" in findings["session"].detail
    for name in ("graph_capture", "ep_generation"):
        assert findings[name].passed and not findings[name].skipped, findings[name].detail
