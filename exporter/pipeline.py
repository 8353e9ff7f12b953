"""The export pipeline: load -> trace -> FX passes -> lower -> ONNX passes -> package.

Each stage is one module with one entry function; this module only strings them together, times
them, and assembles the report.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ep_profiles import EpProfile, get_profile
from ep_profiles.registry import UnknownProfileError
from exporter import graph_capture_check, package, weights
from exporter.compute_dtype import cast_like_from_pretrained
from exporter.errors import ExporterError
from exporter.genai_config import (
    FALLBACK_DECODER_TYPE,
    build_genai_config,
    genai_model_type,
)
from exporter.layout import DecoderLayout, derive_layout
from exporter.lower import lower
from exporter.onnx_fusions import FusionDidNotApply, run_fusions
from exporter.onnx_passes import default_pass_list, run_onnx_passes
from exporter.quantize_int4 import Int4Options, QuantizeWeightsInt4
from exporter.report import ExportReport, initializer_summary, op_counts
from exporter.sources import LoadOptions, load
from exporter.stages import StageLog, StageRecord
from exporter.trace import trace
from fx_passes import FX_PASSES, PassContext, run_fx_passes
from fx_passes.graph_facts import PassDidNotApply

PRECISIONS = ("fp32", "fp16", "bf16", "int4")
GROUP_QUERY_ATTENTION = "GroupQueryAttention"


@dataclass(frozen=True)
class ExportedPackage:
    path: Path
    report: ExportReport
    layout: DecoderLayout

    @property
    def model_path(self) -> Path:
        return self.path / package.MODEL_FILENAME


def export(
    model: Any,
    tokenizer: Any = None,
    *,
    ep: str | EpProfile = "cpu",
    graph_capture: bool = True,
    output_dir: str | Path,
    precision: str | None = None,
    overwrite: bool = False,
    full_logits: bool = False,
    allow_pickled_weights: bool = False,
    trust_remote_code: bool = False,
    random_weights: bool = False,
    strict: bool = False,
    int4: Int4Options | None = None,
    on_stage: Callable[[str, StageRecord | None], None] | None = None,
) -> ExportedPackage:
    """Export a decoder LM to an ONNX Runtime GenAI package in ``output_dir``.

    ``model`` is a preset name, a local Hugging Face folder, a hub id or alias, or an in-memory
    ``PreTrainedModel`` (then ``tokenizer`` is required). ``ep`` is a profile name or an
    ``EpProfile`` of your own (e.g. ``dataclasses.replace(get_profile("cpu"), max_buffer_size=...)``).
    ``graph_capture=False`` exports for a profile's EP with graph capture off (a profile that
    captures needs batch size 1 and every node on the EP). By default the graph computes logits
    for each sequence's last token only (what generation reads); ``full_logits=True`` keeps all
    positions, for scoring. ``on_stage(name, record)`` is called with ``record=None`` when a
    stage starts and with its timings when it ends. ``random_weights`` builds the source's
    architecture from its config with random weights (no weights downloaded or read). ``strict``
    makes a checkpoint tensor the export would not read an error (by default the report lists
    them). ``int4`` sets block size, symmetry and accuracy level for ``precision="int4"``
    (default: ``Int4Options`` with the profile's accuracy level).
    """
    try:
        profile = ep if isinstance(ep, EpProfile) else get_profile(ep)
    except UnknownProfileError as error:
        raise ExporterError(str(error)) from None
    if not graph_capture:
        profile = profile.without_graph_capture()
    precision = choose_precision(profile, precision)
    if int4 is not None and precision != "int4":
        raise ExporterError(f"int4 options apply to --precision int4, not {precision}")
    int4 = int4 or Int4Options(accuracy_level=profile.int4_accuracy_level)
    # The fused ops the EP runs at this precision (CUDA has no fp32 GroupQueryAttention).
    profile = dataclasses.replace(profile, fused_ops=profile.fused_ops_at(precision))
    output_dir = Path(output_dir)
    package.check_destination(output_dir.resolve(), overwrite)

    stages = StageLog(on_stage)
    with stages.stage("load"):
        loaded = load(model, tokenizer, LoadOptions(allow_pickled_weights, trust_remote_code, random_weights, strict))
        hf_model = loaded.model
        dtype = compute_dtype(profile, precision)
        if loaded.weights is not None:
            cast_like_from_pretrained(hf_model, dtype)  # empty parameters, built for this export: no copy
            hf_model.tie_weights()  # converting meta parameters replaces them, untying a tied LM head
        elif any(p.dtype != dtype for p in hf_model.parameters()):
            # A copy: an in-memory model belongs to the caller (often mid-training) and keeps its dtype.
            hf_model = copy.deepcopy(hf_model)
            cast_like_from_pretrained(hf_model, dtype)
            loaded.notes.append(f"weights converted to {str(dtype).removeprefix('torch.')} for tracing (a copy; the model is unchanged)")
        try:
            layout = derive_layout(hf_model)
        except Exception as error:
            raise ExporterError(
                f"{type(hf_model).__name__} could not run with a KV cache ({_first_line(error)}); "
                "only decoder LMs with a transformers KV cache can be exported"
            ) from None
        # Tensors without data (and a checkpoint's persistent buffers) are traced as fake
        # tensors; their values arrive when the package is written.
        if loaded.weights is not None:
            saved_shapes = {name: tuple(t.shape) for name, t in hf_model.state_dict(keep_vars=True).items()}
            weights.fake_weights(hf_model, buffers=loaded.weights.provides_buffers)

    report = ExportReport(
        source=loaded.source,
        ep=profile.name,
        precision=precision,
        layout=dataclasses.asdict(layout),
        notes=list(loaded.notes),
    )
    if genai_model_type(layout) != layout.model_type:
        report.notes.append(
            f"ONNX Runtime GenAI does not list model type '{layout.model_type}'; "
            f"genai_config names it '{FALLBACK_DECODER_TYPE}' (same decoder I/O)"
        )

    with stages.stage("trace"):
        program, sample_inputs = _run_step("tracing with torch.export", trace, hf_model, layout)

    with stages.stage("fx_passes"):
        context = PassContext(profile=profile, layout=layout, options={"precision": precision})
        fx_passes = [FX_PASSES[name] for name in fx_pass_names(profile, layout, full_logits)]
        try:
            program, fx_records = run_fx_passes(program, fx_passes, context)
        except PassDidNotApply as error:
            raise ExporterError(f"FX pass failed: {error}") from error
        report.fx_passes = [dataclasses.asdict(r) for r in fx_records]
        report.notes += [note for r in fx_records if (note := _describe_truncation(r.changes))]

    with stages.stage("lower"):
        onnx_model = _run_step("lowering to ONNX", lower, program, sample_inputs, layout)
        del program
        if loaded.weights is not None:
            attached, read = weights.attach(onnx_model, loaded.weights, saved_shapes)
            report.notes.append(f"{attached} weight tensors written from {loaded.weights.description} "
                                "one at a time, never all in memory")
            unread = loaded.weights.unread(read)
            if strict and unread.unexplained:
                raise ExporterError(f"--strict: {unread.notes()[0]}")
            report.notes += unread.notes()

    with stages.stage("onnx_passes"):
        onnx_records = run_onnx_passes(
            onnx_model,
            # int4 keeps a tied LM head's Transpose: the quantizer then stores the table once.
            default_pass_list(graph_capture=profile.graph_capture, fold_shared_transposes=precision != "int4"),
        )
        report.onnx_passes = [dataclasses.asdict(r) for r in onnx_records]
        try:
            report.fusions = [dataclasses.asdict(r) for r in run_fusions(onnx_model, profile.fused_ops)]
        except FusionDidNotApply as error:
            raise ExporterError(f"ONNX fusion failed: {error}") from error
        if precision == "int4":
            quantizer = QuantizeWeightsInt4(int4)
            quantizer(onnx_model)
            if not quantizer.matmuls:
                raise ExporterError("int4 quantization found no MatMul with a constant weight to quantize")
            report.quantization = {
                "bits": 4, "block_size": int4.block_size, "symmetric": int4.symmetric,
                "accuracy_level": int4.accuracy_level, "matmuls": quantizer.matmuls,
                "gathers": quantizer.gathers, "tables_shared_with_lm_head": quantizer.shared_tables,
            }
        share_kv_buffer = profile.past_present_share_buffer and _presents_from_group_query_attention(onnx_model)
        if profile.graph_capture and not share_kv_buffer:
            # ONNX Runtime GenAI captures only decoders whose past and present share one buffer.
            raise ExporterError(
                f"EP '{profile.name}' captures the decoder's graph, which needs every present KV written in place "
                "by GroupQueryAttention (a shared past/present buffer), and this graph's are not; export with "
                "--no-graph-capture (API: graph_capture=False)"
            )
        if profile.graph_capture and (on_cpu := graph_capture_check.cpu_placed_nodes(onnx_model)):
            raise ExporterError(
                f"EP '{profile.name}' captures the decoder's graph, but {len(on_cpu)} nodes would run on the CPU "
                f"({graph_capture_check.describe(on_cpu)}); export with --no-graph-capture "
                "(API: graph_capture=False), or report the model"
            )

    report.op_counts = op_counts(onnx_model)
    report.initializers = initializer_summary(onnx_model)
    report.graph_inputs = [v.name for v in onnx_model.graph.inputs]
    report.graph_outputs = [v.name for v in onnx_model.graph.outputs]

    with package.staging_folder(output_dir, overwrite) as staging:
        with stages.stage("package"):
            package.save_model(onnx_model, staging)
            genai_config = build_genai_config(
                layout,
                profile,
                loaded.generation_config,
                report.graph_inputs,
                package.MODEL_FILENAME,
                context_length=layout.context_length,
                # One KV buffer for past and present needs every present written in place by
                # GroupQueryAttention, which the substitution pass guarantees (it fails otherwise).
                share_kv_buffer=share_kv_buffer,
            )
            package.save_json(genai_config, staging / package.GENAI_CONFIG_FILENAME)
            package.save_tokenizer(loaded.tokenizer, staging)
        report.stages = [s.to_dict() for s in stages.records]
        report.files = {p.name: p.stat().st_size for p in sorted(staging.iterdir()) if p.is_file()}
        package.save_json(report.to_dict(), staging / package.REPORT_FILENAME)
        (staging / package.REPORT_MARKDOWN_FILENAME).write_text(report.to_markdown())
    return ExportedPackage(output_dir, report, layout)


def _presents_from_group_query_attention(model) -> bool:
    presents = [v for v in model.graph.outputs if v.name.startswith("present.")]
    return bool(presents) and all(
        (node := v.producer()) is not None and node.op_type == GROUP_QUERY_ATTENTION for v in presents
    )


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def compute_dtype(profile: EpProfile, precision: str) -> torch.dtype:
    """The dtype the graph computes in: the precision's own, or for int4 (weights only) the
    profile's activation precision."""
    return _DTYPES[profile.int4_activations if precision == "int4" else precision]


def choose_precision(profile: EpProfile, asked: str | None) -> str:
    """``asked``, checked against what the profile's EP runs; without one, the EP's preferred."""
    if asked is None:
        return profile.default_precision
    if asked not in profile.precisions:
        known = "known" if asked in PRECISIONS else "unknown"
        raise ExporterError(
            f"precision '{asked}' ({known}) is not supported for EP '{profile.name}'; use one of: "
            + ", ".join(profile.precisions)
        )
    return asked


def fx_pass_names(profile, layout: DecoderLayout, full_logits: bool) -> list[str]:
    """The profile's passes; weight splitting where the profile limits buffer sizes;
    GroupQueryAttention where the profile runs it; then the last-token passes unless all logits
    are wanted, the shared-KV truncation only where the model has KV-shared layers."""
    names = list(profile.fx_passes)
    if profile.max_buffer_size is not None:
        names.append("split_oversized_weights")
    if GROUP_QUERY_ATTENTION in profile.fused_ops:
        names.append("substitute_group_query_attention")
    if not full_logits:
        names.append("gather_last_token")
        if layout.shared_layer_indices:
            names.append("truncate_shared_kv_layers")
    return names


def _describe_truncation(changes: dict[str, int]) -> str | None:
    if "layers_on_last_token" not in changes:
        return None
    num_layers, shared = changes["num_layers"], changes["layers_on_last_token"]
    first_shared, first = num_layers - shared, changes["first_truncated_layer"]
    note = (
        f"prefill truncation at layer {first_shared} of {num_layers}: {shared} layers "
        f"({first_shared}-{num_layers - 1}, KV-shared) run on the last token only, saving {shared} "
        f"layer-rows for every prompt token but the last ({shared * 511} for a 512-token prompt)"
    )
    if first < first_shared:
        note += f"; the part of layer {first} that feeds no KV cache runs on it too"
    return note


def _run_step(what: str, function, *args):
    try:
        return function(*args)
    except ExporterError:
        raise
    except Exception as error:
        raise ExporterError(
            f"{what} failed: {type(error).__name__}: {_first_line(error)} "
            "(rerun with --debug for the traceback; please report it with the model's config)"
        ) from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
