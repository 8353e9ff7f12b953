"""L1 / L2: lowering without torch.onnx's decomposition re-trace (``exporter.trace.translation_ready``)
gives the graph the re-trace gives, and each rewrite keeps what the program computes."""

from __future__ import annotations

import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from torch.onnx._internal.exporter import _decomp, _registration

from exporter import export
from exporter.lower.torch_onnx import lower
from exporter.trace import translation_ready
from tests.helpers.onnx_graphs import canonical_graph


@pytest.mark.l2
@pytest.mark.parametrize(("name", "ep"), [
    # Each family's checkpoint is built on the worker that exports its family's package.
    pytest.param(name, ep, marks=pytest.mark.xdist_group(name))
    for name, ep in [("tiny-gemma-4", "cpu"), ("tiny-gemma-4", "webgpu"), ("tiny-cohere", "cpu")]])
def test_the_package_without_the_retrace_is_the_retraced_package(name, ep, preset_exports, tmp_path, monkeypatch):
    """tiny-gemma-4: in-place scaling, truncated layers' shapes, GroupQueryAttention's flattened
    heads (and on webgpu, fp16 with window attention); tiny-cohere: dtype conversions. Streamed from
    the family's test checkpoint (every init constant moved): the same graph, and the same weights
    file."""
    folder = str(preset_exports.checkpoint(name).folder)
    skipped = export(folder, ep=ep, output_dir=tmp_path / "skipped", cache=False)
    assert skipped.report.sessions["decoder"].lowering == "without torch.onnx's decomposition re-trace"
    monkeypatch.setattr(translation_ready, "ready_for_translation", lambda program, translated: "the test's reference")
    retraced = export(folder, ep=ep, output_dir=tmp_path / "retraced", cache=False)
    assert retraced.report.sessions["decoder"].lowering == "re-traced by torch.onnx to decompose it (the test's reference)"
    assert canonical_graph(skipped.model_path) == canonical_graph(retraced.model_path)
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


class _ScaledByWiderDtype(torch.nn.Module):
    def forward(self, a, scale):
        x = a + a
        x.mul_(scale)  # fp16 *= fp32 stays fp16; x * scale would be fp32
        return x + 1


class _UnsqueezedInPlace(torch.nn.Module):
    def forward(self, a, b):
        x = a + b
        kept = x * 3
        x.unsqueeze_(0)
        return x * 2, kept


class _Flatten(torch.nn.Module):
    def forward(self, x):
        return x.flatten(1, 2) * 2


class _ScaledFlattenAll(torch.nn.Module):
    def forward(self, x):
        y = x + 1
        y.mul_(2)
        return y.reshape(-1)


class _MixedDtypes(torch.nn.Module):
    def forward(self, half, single, count):
        # float16 + float32; an integer times a Python float; a float16 times a Python int
        return (half + single) * (count * 0.5 + 1) + half * 3


class _AsFloat(torch.nn.Module):
    def forward(self, a, b):
        return (a + b).float()  # already float32: the conversion is the graph's output


def _exported(module, *inputs, dynamic_shapes=None):
    return torch.export.export(module, inputs, dynamic_shapes=dynamic_shapes, strict=False)


def _targets(program) -> list:
    return [n.target for n in program.graph.nodes if n.op == "call_function"]


def _ready(program) -> str | None:
    return translation_ready.ready_for_translation(program, set(_decomp.get_onnx_implemented_overloads(
        _registration.ONNXRegistry.from_torchlib())))


def _onnx_outputs(program, inputs, names) -> list:
    model, decomposed_because = lower(program, inputs, names, ["output"])
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return decomposed_because, session.run(None, {n: x.numpy() for n, x in zip(names, inputs, strict=True)})


@pytest.mark.l1
def test_in_place_arithmetic_on_a_fresh_value_becomes_functional():
    inputs = (torch.randn(2, 3), torch.randn(2, 3))
    program = _exported(_ScaledSum(), *inputs)
    assert torch.ops.aten.mul_.Tensor in _targets(program)
    assert _ready(program) is None
    assert _targets(program) == [torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor]
    torch.testing.assert_close(program.graph_module(*inputs)[0], _ScaledSum()(*inputs))


@pytest.mark.l1
def test_an_in_place_view_becomes_functional_and_its_input_keeps_its_value():
    inputs = (torch.randn(2, 3), torch.randn(2, 3))
    program = _exported(_UnsqueezedInPlace(), *inputs)
    assert _ready(program) is None
    assert torch.ops.aten.unsqueeze.default in _targets(program)
    (added,) = [n for n in program.graph.nodes if n.target is torch.ops.aten.add.Tensor]
    assert tuple(added.meta["val"].shape) == (2, 3)  # not the shape the in-place op gave it
    for got, want in zip(program.graph_module(*inputs), _UnsqueezedInPlace()(*inputs), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.l1
@pytest.mark.parametrize(("module", "inputs", "reason"), [
    (_ViewReadAfterScaling(), (torch.randn(2, 3), torch.randn(2, 3)), "translates no aten.mul_.Tensor"),
    (_ScaledByWiderDtype(), (torch.randn(2, 3).half(), torch.randn(3)), "no translated twin of the same dtype"),
], ids=["seen-through-a-view", "dtype-promoting"])
def test_in_place_arithmetic_that_a_twin_would_change_keeps_the_decomposition(module, inputs, reason):
    program = _exported(module, *inputs)
    targets = _targets(program)
    shapes = [tuple(n.meta["val"].shape) for n in program.graph.nodes if n.op == "call_function"]
    assert reason in _ready(program)
    assert _targets(program) == targets
    assert [tuple(n.meta["val"].shape) for n in program.graph.nodes if n.op == "call_function"] == shapes


@pytest.mark.l1
def test_reshapes_become_views_reading_the_input_dimensions():
    program = _exported(_Flatten(), torch.randn(3, 4, 5), dynamic_shapes=({0: torch.export.Dim.DYNAMIC},))
    assert _ready(program) is None
    (view,) = [n for n in program.graph.nodes if n.target is torch.ops.aten.view.default]
    batch, width = view.args[1]
    assert batch.target is torch.ops.aten.sym_size.int and batch.args[1] == 0 and width == 20
    assert view.args[0].target is torch.ops.aten.clone.default
    program.graph.lint()
    for rows in (1, 3, 7):
        x = torch.randn(rows, 4, 5)
        torch.testing.assert_close(program.graph_module(x)[0], _Flatten()(x))


@pytest.mark.l3
def test_a_reshape_to_a_product_of_sizes_keeps_the_decomposition_and_nothing_is_rewritten():
    x = torch.randn(3, 4)
    program = _exported(_ScaledFlattenAll(), x, dynamic_shapes=({0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC},))
    targets = _targets(program)
    reason = _ready(program)
    assert "no node computes" in reason and _targets(program) == targets  # the in-place op too
    decomposed_because, (got,) = _onnx_outputs(program, (x,), ["x"])
    assert decomposed_because == reason
    torch.testing.assert_close(torch.from_numpy(got), _ScaledFlattenAll()(x))


@pytest.mark.l3
def test_a_dtype_keeping_conversion_that_is_an_output_goes():
    inputs = (torch.randn(2, 3), torch.randn(2, 3))
    program = _exported(_AsFloat(), *inputs)
    decomposed_because, (got,) = _onnx_outputs(program, inputs, ["a", "b"])
    assert decomposed_because is None
    assert torch.ops.aten.to.dtype not in _targets(program)
    torch.testing.assert_close(torch.from_numpy(got), _AsFloat()(*inputs))


def _mixed_dtype_inputs() -> tuple:
    return torch.randn(2, 3).half(), torch.randn(2, 3), torch.arange(6).reshape(2, 3)


@pytest.mark.l1
def test_type_promotion_on_recorded_values_is_torch_onnx_s_own():
    """The same casts and scalar tensors, with the same values, as torch.onnx's pass, which runs
    every node again in fake mode."""
    from torch.onnx._internal.exporter import _fx_passes

    promoted = []
    for promote in (translation_ready.insert_type_promotions, _fx_passes.insert_type_promotion_nodes):
        program = _exported(_MixedDtypes(), *_mixed_dtype_inputs())
        assert _ready(program) is None
        promote(program.graph_module)
        promoted.append([(str(n.target), str(n.args), str(n.kwargs), n.meta["val"].dtype, tuple(n.meta["val"].shape))
                         for n in program.graph.nodes if n.op == "call_function"])
    assert promoted[0] == promoted[1]
    assert sum("convert_element_type" in target for target, *_ in promoted[0]) >= 2  # half and count cast


@pytest.mark.l3
def test_a_ready_program_with_mixed_dtypes_lowers_with_its_promotions(monkeypatch):
    """The same numbers as with torch.onnx's decomposition and type promotion; against eager,
    float16's precision (2**-10 relative: ONNX Runtime rounds the float16 product on its own)."""
    inputs = _mixed_dtype_inputs()
    promoted = []
    monkeypatch.setattr(translation_ready, "insert_type_promotions",
                        lambda module, own=translation_ready.insert_type_promotions: promoted.append(module) or own(module))
    decomposed_because, (got,) = _onnx_outputs(_exported(_MixedDtypes(), *inputs), inputs, ["half", "single", "count"])
    assert decomposed_because is None
    assert len(promoted) == 1, "the promotions came from the recorded values, not torch.onnx's fake-mode re-run"
    monkeypatch.setattr(translation_ready, "ready_for_translation", lambda program, translated: "the test's reference")
    _, (reference,) = _onnx_outputs(_exported(_MixedDtypes(), *inputs), inputs, ["half", "single", "count"])
    assert (got == reference).all()
    torch.testing.assert_close(torch.from_numpy(got), _MixedDtypes()(*inputs), rtol=2**-10, atol=2**-10)


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
    unvalued = next(n for n in graph.nodes if n.op == "call_function" and n is not stray)
    del unvalued.meta["val"]
    values = {n: n.meta.get("val") for n in graph.nodes}
    reason = translation_ready.refresh_fake_values(program.graph_module)
    assert reason == "_raises_without_real_values's value could not be recomputed (RuntimeError)"
    assert all(n.meta.get("val") is values[n] for n in graph.nodes)
    assert "val" not in unvalued.meta




class _ScaledPlusOne(torch.nn.Module):
    def forward(self, a, b):
        return a * 2 + 1, b - 1


def _refreshed(change, monkeypatch) -> tuple[list, dict, list]:
    """The traced ``_ScaledPlusOne`` with its values recorded, ``change(graph, a * 2)`` applied,
    then refreshed: its three call nodes, their values before, and the nodes recomputed."""
    program = _exported(_ScaledPlusOne(), torch.randn(2, 3), torch.randn(2, 3))
    translation_ready.record_traced_values(program)
    graph = program.graph
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    values = {n: n.meta["val"] for n in nodes}
    change(graph, nodes[0])
    recomputed = []
    fake_value = translation_ready.fake_value
    monkeypatch.setattr(translation_ready, "fake_value",
                        lambda node, *args, **kwargs: recomputed.append(node) or fake_value(node, *args, **kwargs))
    assert translation_ready.refresh_fake_values(program.graph_module) is None
    return nodes, values, recomputed


def _fed_a_slice(end: int):
    def change(graph, scaled):
        with graph.inserting_before(scaled):
            part = graph.call_function(torch.ops.aten.slice.Tensor, (scaled.args[0], 0, 0, end))
        scaled.args = (part, *scaled.args[1:])
    return change


@pytest.mark.l1
def test_values_are_recomputed_where_a_pass_changed_the_graph_and_downstream_only(monkeypatch):
    """A pass feeds ``a * 2`` the first row of ``a`` only: the new slice, ``a * 2`` and its user
    are recomputed to one row; ``b - 1`` is not recomputed and keeps its value."""
    (scaled, plus_one, minus_one), values, recomputed = _refreshed(_fed_a_slice(1), monkeypatch)
    assert [n.target for n in recomputed] == [torch.ops.aten.slice.Tensor, scaled.target, plus_one.target]
    assert tuple(scaled.meta["val"].shape) == tuple(plus_one.meta["val"].shape) == (1, 3)
    assert minus_one.meta["val"] is values[minus_one]


@pytest.mark.l1
def test_a_recomputed_value_like_the_old_one_keeps_it_and_its_users_do_not_run(monkeypatch):
    """Fed all of ``a`` through a slice, ``a * 2`` is recomputed to the same shape: it keeps its
    value object, so ``+ 1`` is not recomputed."""
    nodes, values, recomputed = _refreshed(_fed_a_slice(2), monkeypatch)
    assert [n.target for n in recomputed] == [torch.ops.aten.slice.Tensor, nodes[0].target]
    assert all(node.meta["val"] is values[node] for node in nodes)


@pytest.mark.l1
def test_an_argument_of_another_type_is_a_change(monkeypatch):
    """``a * 2`` made ``a * 2.0`` (equal numbers, another result dtype for an integer ``a``) is
    recomputed."""
    program_inputs = (torch.ones(2, 3, dtype=torch.int64), torch.randn(2, 3))
    program = _exported(_ScaledPlusOne(), *program_inputs)
    translation_ready.record_traced_values(program)
    scaled = next(n for n in program.graph.nodes if n.op == "call_function")
    assert scaled.meta["val"].dtype == torch.int64
    scaled.args = (scaled.args[0], 2.0)
    assert translation_ready.refresh_fake_values(program.graph_module) is None
    assert scaled.meta["val"].dtype == torch.float32
