"""What must hold of a finished session's graph, read off the graph alone: the export checks it
before writing, and ``check`` checks a package with the same functions. Every session's ops must
have types their ONNX schemas allow; the other demands are the decoder's (the one session GenAI
captures and gives a KV cache), and for the other sessions of a multimodal package the export
only reports the nodes that would run on the CPU (``uncaptured_cpu_note``).

- ``cpu_placed_nodes``: the nodes an EP would run on the CPU in a graph that must be captured.
- ``presents_written_in_place``: whether every present KV is written by GroupQueryAttention, the
  only attention that can share one KV buffer between past and present.
- ``dtype_refusals`` (``exporter.onnx_passes.schema_types``): the ONNX ops whose schema, at the graph's opset, refuses the types they are
  given (bf16 ``Conv`` before opset 22; one type parameter bound to two dtypes): ONNX Runtime
  refuses to load such a graph on any EP.

Graph capture (WebGPU's command recording, CUDA graphs) replays the device work of one run, so a
captured session refuses any node placed on the CPU. ONNX Runtime places on the CPU whatever
computes a shape input: a Reshape target, Slice bounds, Expand/Tile sizes, axes given as inputs,
and so on, together with the Shape/Concat/Squeeze chains that feed them. Constants are fine
(they are read once). This check reads the graph only, so it runs without the EP installed;
``python -m exporter check`` asks the real EP for its placement where it is installed.
"""

from __future__ import annotations

import onnx_ir as ir

from exporter.onnx_passes.schema_types import dtype_refusals

# (op type, input indices read on the CPU) for the ONNX ops a decoder graph uses.
_SHAPE_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,),
    "Expand": (1,),
    "Tile": (1,),
    "Slice": (1, 2, 3, 4),
    "Squeeze": (1,),
    "Unsqueeze": (1,),
    "ReduceSum": (1,),
    "ReduceMean": (1,),
    "ReduceMax": (1,),
    "ReduceMin": (1,),
    "CumSum": (1,),
    "Split": (1,),
    "Pad": (1, 2, 3),
    "TopK": (1,),
    "ConstantOfShape": (0,),
    "Range": (0, 1, 2),
    "OneHot": (1,),
    "Resize": (1, 2, 3),
}
# Ops whose every output is host memory.
_HOST_OPS = {"Shape", "Size", "NonZero"}


def cpu_placed_nodes(model: ir.Model) -> list[ir.Node]:
    """Nodes that compute a value read on the CPU, in graph order."""
    found: dict[int, ir.Node] = {}
    pending: list[ir.Value] = []
    for node in model.graph.all_nodes():
        if node.op_type in _HOST_OPS:
            found[id(node)] = node
        for index in _SHAPE_INPUTS.get(node.op_type, ()) if node.domain in ("", "ai.onnx") else ():
            if index < len(node.inputs) and node.inputs[index] is not None:
                pending.append(node.inputs[index])
    while pending:
        value = pending.pop()
        producer = value.producer()
        if producer is None or ir.convenience.get_const_tensor(value) is not None or id(producer) in found:
            continue
        found[id(producer)] = producer
        pending.extend(v for v in producer.inputs if v is not None)
    order = {id(node): i for i, node in enumerate(model.graph.all_nodes())}
    return sorted(found.values(), key=lambda node: order[id(node)])


def describe(nodes: list[ir.Node], limit: int = 6) -> str:
    named = ", ".join(f"{n.op_type} {n.name}" for n in nodes[:limit])
    more = f" and {len(nodes) - limit} more" if len(nodes) > limit else ""
    return named + more


def presents_written_in_place(model: ir.Model) -> bool:
    """Every ``present.*`` output is written by GroupQueryAttention (there is at least one)."""
    has_presents = any(v.name.startswith("present.") for v in model.graph.outputs)
    return has_presents and not presents_not_in_place(model)


def presents_not_in_place(model: ir.Model) -> list[str]:
    """The ``present.*`` outputs something other than GroupQueryAttention writes."""
    return sorted(v.name for v in model.graph.outputs
                  if v.name.startswith("present.") and ((node := v.producer()) is None or node.op_type != "GroupQueryAttention"))


def require(model: ir.Model, settings, session) -> None:
    """The export's check of a finished session against its plan (``exporter.plan.ExportSettings``):
    a one-line ``ExporterError`` before anything is written where GenAI would refuse the package."""
    from exporter.errors import ExporterBug, ExporterError

    if refused := dtype_refusals(model):
        raise ExporterBug(f"the {session.name} session gives ops types their ONNX schema does not allow, which "
                          f"ONNX Runtime refuses to load ({', '.join(map(str, refused[:4]))}"
                          f"{f' and {len(refused) - 4} more' if len(refused) > 4 else ''}); please report the model")
    if not session.is_decoder:
        return
    name = settings.profile.name
    if settings.share_kv_buffer and not presents_written_in_place(model):
        raise ExporterBug(f"EP '{name}' shares the KV buffer, but some present KV is not written by "
                          "GroupQueryAttention; please report the model")
    if not session.captured(settings):
        return
    if not settings.share_kv_buffer:
        # ONNX Runtime GenAI captures only decoders whose past and present share one buffer.
        raise ExporterError(
            f"EP '{name}' captures the decoder's graph, which needs every present KV written in place "
            "by GroupQueryAttention (a shared past/present buffer), and this graph's are not; export with "
            "--no-graph-capture (API: graph_capture=False)"
        )
    if on_cpu := cpu_placed_nodes(model):
        raise ExporterError(
            f"EP '{name}' captures the decoder's graph, but {len(on_cpu)} nodes would run on the CPU "
            f"({describe(on_cpu)}); export with --no-graph-capture (API: graph_capture=False), or report the model"
        )


def uncaptured_cpu_note(model: ir.Model, settings, session) -> str | None:
    """For a session an EP runs without graph capture (a multimodal package's encoders and
    embedding): the nodes ONNX Runtime would place on the CPU, for the report. Not an error: only
    a captured graph must run whole on the EP."""
    if session.captured(settings) or not settings.profile.genai_provider:
        return None
    on_cpu = cpu_placed_nodes(model)
    if not on_cpu or session.is_decoder:
        return None
    return (f"{session.name} session: {len(on_cpu)} shape nodes run on the CPU beside "
            f"{settings.profile.name} ({describe(on_cpu, 3)}); it is not captured, so that only costs copies")
