"""``export()``: resolve, plan, then for each planned session (``exporter.sessions``) trace -> FX
passes -> lower -> ONNX passes -> post-conditions, then write the package. Each step is one module; this one only strings them
together, times them and fills the report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ep_profiles import EpProfile, get_profile
from ep_profiles.registry import UnknownProfileError
from exporter import package, postconditions, weights
from exporter.errors import ExporterError
from exporter.genai_config import (
    FALLBACK_DECODER_TYPE,
    build_genai_config,
    genai_model_type,
)
from exporter.layout import DecoderLayout
from exporter.lower import lower
from exporter.onnx_passes import ONNX_PASSES, run_onnx_passes
from exporter.onnx_passes.norm_fusions import FusionDidNotApply
from exporter.onnx_passes.quantize_int4 import Int4Options
from exporter.plan import ExportPlan, ExportSettings, export_settings, make_plan
from exporter.precisions import PRECISIONS, choose_precision, int4_options
from exporter.prepare import prepare
from exporter.report import ExportReport, initializer_summary, op_counts
from exporter.sessions import SESSIONS
from exporter.sources import LoadOptions, load
from exporter.stages import StageLog, StageRecord
from fx_passes import FX_PASSES, PassContext, run_fx_passes
from fx_passes.graph_facts import PassDidNotApply


@dataclass(frozen=True)
class ExportedPackage:
    path: Path
    report: ExportReport
    layout: DecoderLayout
    plan: ExportPlan

    @property
    def model_path(self) -> Path:
        """The decoder's model file."""
        return self.path / SESSIONS["decoder"].filename


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
    profile = _profile(ep)
    precision = choose_precision(profile, precision)
    int4 = int4_options(profile, precision, int4)
    output_dir = Path(output_dir)
    package.check_destination(output_dir.resolve(), overwrite)
    stages = StageLog(on_stage)

    with stages.stage("load"):
        loaded = load(model, tokenizer, LoadOptions(allow_pickled_weights, trust_remote_code, random_weights, strict))
        prepared = prepare(loaded, PRECISIONS[precision].compute_dtype(profile))
    settings = export_settings(profile, prepared.layout, precision, graph_capture=graph_capture,
                               full_logits=full_logits, int4=int4)
    plan = make_plan(settings)
    report = _new_report(loaded, settings, plan)

    models = {}
    for session_plan in plan.sessions:
        session = SESSIONS[session_plan.name]
        with stages.stage("trace"):
            program, sample_inputs = _run_step("tracing with torch.export", session.trace, prepared.model,
                                               settings.layout)
        with stages.stage("fx_passes"):
            program = _run_fx_passes(program, session_plan, settings, report)
        with stages.stage("lower"):
            onnx_model = _run_step("lowering to ONNX", lower, program, sample_inputs,
                                   session.input_names(settings.layout), session.output_names(settings.layout))
            del program
            if loaded.weights is not None:
                report.notes += weights.attach_and_account(onnx_model, loaded.weights, prepared.saved_shapes, strict)
        with stages.stage("onnx_passes"):
            _run_onnx_passes(onnx_model, session_plan, settings, report)
            postconditions.require(onnx_model, settings)
        _describe_graph(onnx_model, report)
        models[session.name] = onnx_model

    with package.staging_folder(output_dir, overwrite) as staging:
        with stages.stage("package"):
            sections = {}
            for name, onnx_model in models.items():
                session = SESSIONS[name]
                package.save_model(onnx_model, staging, session.filename)
                sections[name] = session.genai_section(settings.layout, profile,
                                                       [v.name for v in onnx_model.graph.inputs], settings.graph_capture)
            genai_config = build_genai_config(settings.layout, profile, loaded.generation_config, sections,
                                              settings.share_kv_buffer)
            package.save_json(genai_config, staging / package.GENAI_CONFIG_FILENAME)
            package.save_tokenizer(loaded.tokenizer, staging)
        package.save_report(report, stages, staging)
    return ExportedPackage(output_dir, report, settings.layout, plan)


def _profile(ep: str | EpProfile) -> EpProfile:
    try:
        return ep if isinstance(ep, EpProfile) else get_profile(ep)
    except UnknownProfileError as error:
        raise ExporterError(str(error)) from None


def _new_report(loaded, settings: ExportSettings, plan: ExportPlan) -> ExportReport:
    layout = settings.layout
    report = ExportReport(source=loaded.source, ep=settings.profile.name, precision=settings.precision,
                          layout=dataclasses.asdict(layout), plan=plan.to_dict(), notes=list(loaded.notes))
    if genai_model_type(layout) != layout.model_type:
        report.notes.append(f"ONNX Runtime GenAI does not list model type '{layout.model_type}'; "
                            f"genai_config names it '{FALLBACK_DECODER_TYPE}' (same decoder I/O)")
    return report


def _run_fx_passes(program, session, settings: ExportSettings, report: ExportReport):
    context = PassContext(profile=settings.profile, layout=settings.layout, precision=settings.precision,
                          weight_bytes=settings.weight_bytes, graph_capture=settings.graph_capture)
    passes = [FX_PASSES[p.name] for p in session.fx_passes]
    try:
        program, records = run_fx_passes(program, passes, context)
    except PassDidNotApply as error:
        raise ExporterError(f"FX pass failed: {error}") from error
    report.fx_passes = [dataclasses.asdict(r) for r in records]
    # A pass may say in words what its counts mean (the truncation: where it cut, what it saves).
    report.notes += [note for p, r in zip(passes, records, strict=True)
                     if (describe := getattr(p, "note", None)) and (note := describe(r.changes))]
    return program


def _run_onnx_passes(onnx_model, session, settings: ExportSettings, report: ExportReport) -> None:
    try:
        records = run_onnx_passes(onnx_model, [ONNX_PASSES[p.name] for p in session.onnx_passes], settings)
    except FusionDidNotApply as error:
        raise ExporterError(f"ONNX fusion failed: {error}") from error
    report.onnx_passes = [dataclasses.asdict(r) for r in records]


def _describe_graph(onnx_model, report: ExportReport) -> None:
    report.op_counts = op_counts(onnx_model)
    report.initializers = initializer_summary(onnx_model)
    report.graph_inputs = [v.name for v in onnx_model.graph.inputs]
    report.graph_outputs = [v.name for v in onnx_model.graph.outputs]


def _run_step(what: str, function, *args):
    try:
        return function(*args)
    except ExporterError:
        raise
    except Exception as error:
        text = str(error).strip()
        raise ExporterError(
            f"{what} failed: {type(error).__name__}: {text.splitlines()[0] if text else ''} "
            "(rerun with --debug for the traceback; please report it with the model's config)"
        ) from error
