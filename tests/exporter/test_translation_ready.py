"""L1 / L2: lowering without torch.onnx's decomposition re-trace (``exporter.translation_ready``)
gives the graph the re-trace gives, and each rewrite keeps what the program computes."""

from __future__ import annotations

import re

import onnx
import pytest
import torch

from exporter import export, translation_ready


def _canonical(path) -> tuple:
    """The graph with values named by where they are made: nodes (domain, op, inputs,
    attributes), graph inputs and outputs with their types. Generated constants' names (torch.onnx's
    ``val_N``, the static reshape targets' ``node_<node>_target_N``, which carry FX node names)
    are numbered by first use; weights keep their names."""
    graph = onnx.load(str(path), load_external_data=False).graph
    names = {value.name: value.name for value in graph.input}
    for tensor in graph.initializer:
        names[tensor.name] = None if re.fullmatch(r"val_\d+|node_\w+_target_\d+", tensor.name) else "weight:" + tensor.name
    nodes = []
    for node in graph.node:
        inputs = []
        for name in node.input:
            if names.get(name, "") is None:
                names[name] = f"constant{len(names)}"
            inputs.append(names.get(name, name))
        for name in node.output:
            names[name] = f"value{len(names)}"
        attributes = sorted((a.name, str(onnx.helper.get_attribute_value(a))) for a in node.attribute)
        nodes.append((node.domain, node.op_type, tuple(inputs), tuple(attributes)))
    io = [(v.name, str(v.type)) for v in [*graph.input, *graph.output]]
    return nodes, [names[v.name] for v in graph.output], io


@pytest.mark.l2
@pytest.mark.parametrize(("name", "ep"), [("tiny-gemma-4", "cpu"), ("tiny-gemma-4", "webgpu"), ("tiny-cohere", "cpu")])
def test_the_package_without_the_retrace_is_the_retraced_package(name, ep, tmp_path, monkeypatch):
    """tiny-gemma-4: in-place scaling, truncated layers' shapes, GroupQueryAttention's flattened
    heads (and on webgpu, fp16 with window attention); tiny-cohere: dtype conversions. The same
    graph, and the same weights file."""
    skipped = export(name, ep=ep, output_dir=tmp_path / "skipped", cache=False)
    assert not [note for note in skipped.report.notes if "re-traced" in note]
    monkeypatch.setattr(translation_ready, "prepare", lambda program, translated: "the test's reference")
    retraced = export(name, ep=ep, output_dir=tmp_path / "retraced", cache=False)
    assert [note for note in retraced.report.notes if "re-traced" in note]
    assert _canonical(skipped.model_path) == _canonical(retraced.model_path)
    data = skipped.model_path.name + ".data"
    assert (skipped.path / data).read_bytes() == (retraced.path / data).read_bytes()


class _ScaledSum(torch.nn.Module):
    def forward(self, a, b):
        x = a + b
        x.mul_(2)
        return x


class _ViewReadAfterScaling(torch.nn.Module):
    def forward(self, a, b):
        x = a + b
        first_row = x[0]  # a view: it sees the in-place scaling
        x.mul_(2)
        return first_row + 1


def _exported(module, *inputs, dynamic_shapes=None):
    return torch.export.export(module, inputs, dynamic_shapes=dynamic_shapes, strict=False)


def _targets(program) -> list:
    return [n.target for n in program.graph.nodes if n.op == "call_function"]


@pytest.mark.l1
def test_in_place_arithmetic_on_a_fresh_value_becomes_functional():
    inputs = (torch.randn(2, 3), torch.randn(2, 3))
    program = _exported(_ScaledSum(), *inputs)
    assert torch.ops.aten.mul_.Tensor in _targets(program)
    assert translation_ready.functionalize_in_place_arithmetic(program.graph_module) == 1
    assert _targets(program) == [torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor]
    torch.testing.assert_close(program.graph_module(*inputs)[0], _ScaledSum()(*inputs))


@pytest.mark.l1
def test_in_place_arithmetic_seen_through_a_view_stays():
    program = _exported(_ViewReadAfterScaling(), torch.randn(2, 3), torch.randn(2, 3))
    assert translation_ready.functionalize_in_place_arithmetic(program.graph_module) == 0
    assert torch.ops.aten.mul_.Tensor in _targets(program)


class _Flatten(torch.nn.Module):
    def forward(self, x):
        return x.flatten(1, 2) * 2


class _FlattenAll(torch.nn.Module):
    def forward(self, x):
        return x.reshape(-1) * 2


@pytest.mark.l1
def test_reshapes_become_views_reading_the_input_dimensions():
    x = torch.randn(3, 4, 5)
    program = _exported(_Flatten(), x, dynamic_shapes=({0: torch.export.Dim.DYNAMIC},))
    assert translation_ready.reshapes_as_views(program.graph_module) is None
    (view,) = [n for n in program.graph.nodes if n.target is torch.ops.aten.view.default]
    batch, width = view.args[1]
    assert batch.target is torch.ops.aten.sym_size.int and batch.args[1] == 0 and width == 20
    assert view.args[0].target is torch.ops.aten.clone.default
    program.graph_module.graph.lint()
    for rows in (1, 3, 7):
        x = torch.randn(rows, 4, 5)
        torch.testing.assert_close(program.graph_module(x)[0], _Flatten()(x))


@pytest.mark.l1
def test_a_reshape_to_a_product_of_sizes_keeps_the_decomposition():
    program = _exported(_FlattenAll(), torch.randn(3, 4),
                        dynamic_shapes=({0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC},))
    reason = translation_ready.reshapes_as_views(program.graph_module)
    assert reason is not None and "no node computes" in reason
    assert torch.ops.aten.view.default not in _targets(program)


def _raises_without_real_values(x):
    raise RuntimeError("needs real values")


@pytest.mark.l1
def test_a_value_that_cannot_be_recomputed_leaves_every_value_as_it_was():
    program = _exported(_Flatten(), torch.randn(3, 4, 5))
    graph = program.graph
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):
        stray = graph.call_function(_raises_without_real_values, (output.args[0][0],))
    stray.meta["val"] = "as it was"
    values = {n: n.meta.get("val") for n in graph.nodes}
    reason = translation_ready.refresh_fake_values(program.graph_module)
    assert reason is not None and "_raises_without_real_values" in reason and "RuntimeError" in reason
    assert all(n.meta.get("val") is values[n] for n in graph.nodes)
