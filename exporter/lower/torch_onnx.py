"""Lower the torch.export program to an ONNX model with ONNX Runtime GenAI's names.

``torch.onnx.export(..., optimize=False)``: its default optimizer runs onnxscript's rewrite rules,
whose cost grows with the square of the node count (most of 81 s at 35 layers); the chosen pass
list in ``exporter.onnx_passes`` runs instead.

torch.onnx's first step decomposes the program into ops it translates by re-tracing it; a traced
decoder needs none of it once ``exporter.trace.translation_ready`` has rewritten it, so it is skipped, and
the type promotion after it reads the values that module recomputed.
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
import warnings

import onnx_ir as ir
import torch
from torch.export import ExportedProgram

from exporter.trace import translation_ready
from fx_passes.custom_ops.ops import ONNX_TRANSLATIONS

OPSET = 21

# The symbolic dims torch.export invents (s0, s17, ...) get the names ONNX Runtime GenAI's own
# packages use, keyed by (graph input, axis).
_DIM_NAMES = {
    ("input_ids", 0): "batch_size",
    ("input_ids", 1): "sequence_length",
    ("attention_mask", 1): "total_sequence_length",
}


def lower(program: ExportedProgram, sample_inputs: tuple, input_names: list[str],
          output_names: list[str]) -> tuple[ir.Model, str | None]:
    """The ONNX model, and why torch.onnx had to re-trace the program to decompose it (None where
    it did not). ``program`` is rewritten in place (``translation_ready``): lower it once."""
    decomposed_because: list[str] = []
    with _quiet_torch_onnx(), _decomposition_skipped_when_ready(decomposed_because):
        onnx_program = torch.onnx.export(
            program,
            sample_inputs,
            dynamo=True,
            optimize=False,
            opset_version=OPSET,
            custom_translation_table=ONNX_TRANSLATIONS,
            verbose=False,
            report=False,
        )
    model = onnx_program.model
    _name_graph_io(model, input_names, output_names)
    return model, (decomposed_because[0] if decomposed_because else None)


def _name_graph_io(model: ir.Model, wanted_inputs: list[str], wanted_outputs: list[str]) -> None:
    graph = model.graph
    if len(graph.inputs) != len(wanted_inputs) or len(graph.outputs) != len(wanted_outputs):
        raise RuntimeError(
            f"lowered graph has {len(graph.inputs)} inputs / {len(graph.outputs)} outputs, "
            f"expected {len(wanted_inputs)} / {len(wanted_outputs)}"
        )
    for value, name in zip(graph.inputs, wanted_inputs, strict=True):
        value.name = name
    for value, name in zip(graph.outputs, wanted_outputs, strict=True):
        value.name = name

    renames: dict[str, str] = {}
    for value in graph.inputs:
        for axis, dim in enumerate(value.shape):
            if isinstance(dim, ir.SymbolicDim) and (value.name, axis) in _DIM_NAMES:
                renames[str(dim.value)] = _DIM_NAMES[(value.name, axis)]
    first_past = next((v for v in graph.inputs if v.name.startswith("past_key_values.")), None)
    if first_past is not None and isinstance(first_past.shape[2], ir.SymbolicDim):
        renames[str(first_past.shape[2].value)] = "past_sequence_length"

    def renamed(shape: ir.Shape | None) -> ir.Shape | None:
        if shape is None:
            return None
        dims = [
            ir.SymbolicDim(renames.get(str(d.value), d.value)) if isinstance(d, ir.SymbolicDim) else d
            for d in shape
        ]
        return ir.Shape(dims)

    for value in [*graph.inputs, *graph.outputs]:
        value.shape = renamed(value.shape)


@contextlib.contextmanager
def _decomposition_skipped_when_ready(decomposed_because: list[str]):
    """torch.onnx's decomposition step, skipped for a program ``translation_ready`` makes ready,
    whose type promotion then reads the values it recomputed. torch.onnx has no option for this,
    so its step functions are wrapped for the call, one lowering at a time (the wrappers are
    module-wide, and each holds its own lowering's state)."""
    from torch.onnx._internal.exporter import _decomp, _fx_passes

    made_ready: list[bool] = []

    def decompose_unless_ready(program: ExportedProgram, registry):
        reason = translation_ready.ready_for_translation(program, set(_decomp.get_onnx_implemented_overloads(registry)))
        made_ready.append(reason is None)
        if reason is None:
            return program
        decomposed_because.append(reason)
        return decompose(program, registry)

    def promote_on_recorded_values_when_ready(graph_module):
        if made_ready != [True]:
            return promote(graph_module)
        return translation_ready.insert_type_promotions(graph_module)

    with _TORCH_ONNX_STEPS_WRAPPED:  # read torch's own steps only when no other lowering wraps them
        decompose, promote = _fx_passes.decompose_with_registry, _fx_passes.insert_type_promotion_nodes
        _fx_passes.decompose_with_registry = decompose_unless_ready
        _fx_passes.insert_type_promotion_nodes = promote_on_recorded_values_when_ready
        try:
            yield
        finally:
            _fx_passes.decompose_with_registry = decompose
            _fx_passes.insert_type_promotion_nodes = promote


_TORCH_ONNX_STEPS_WRAPPED = threading.RLock()


@contextlib.contextmanager
def _quiet_torch_onnx():
    """torch.onnx prints progress lines and warns about optional torchvision ops; the exporter
    reports its own progress."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
