"""``export()``: resolve, plan, then for each planned session (``exporter.sessions``) trace -> FX
passes -> lower -> ONNX passes -> post-conditions, then write the package. Each step is one module; this one only strings them
together, times them and fills the report.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ep_profiles import EpProfile
from exporter.cache import graph_cache
from exporter.errors import ExporterBug, ExporterError, environment_error
from exporter.int4_options import Int4Options
from exporter.load import activation_ranges
from exporter.load.layout import DecoderLayout
from exporter.load.prepare import prepare
from exporter.load.sources import LoadOptions, load
from exporter.lower.torch_onnx import lower
from exporter.options import ExportOptions
from exporter.onnx_passes import ONNX_PASSES, FusionDidNotApply, run_onnx_passes
from exporter.package import destination
from exporter.package import files as package
from exporter.package.genai_config import FALLBACK_DECODER_TYPE, build_genai_config, genai_model_type
from exporter.package.report import ExportReport, SessionReport, package_summary
from exporter.plan import ExportPlan, ExportSettings, export_settings, make_plan
from exporter.precisions import PRECISIONS
from exporter.progress import ProgressDisplay
from exporter.sessions import SESSIONS
from exporter.stages import StageLog, StageRecord
from exporter.trace import translation_ready
from exporter.trace.decoder import REPLICATED_LAYERS
from exporter.verify import postconditions
from exporter.verify.sample_prefill import run_sample_prefill
from exporter.weights.meta_model import tensor_names
from exporter.weights.origins import WeightOrigin, made_from, weight_origins
from exporter.weights.placeholders import attach, detach
from exporter.weights.stores import SafetensorsWeights, account
from fx_passes import FX_PASSES, PassDidNotApply, run_fx_passes


@dataclass(frozen=True)
class ExportedPackage:
    path: Path
    report: ExportReport
    layout: DecoderLayout
    plan: ExportPlan
    # Each session file -> its weight initializers -> where their bytes come from (a checkpoint
    # range copied, or one stored tensor converted and laid out: ``WeightOrigin``), where
    # every weight is that and was read by nothing but the writer (what a command-line replay
    # records: ``exporter.cache.replay``); else None, and ``weight_origins_why_not``.
    weight_origins: dict[str, dict[str, WeightOrigin]] | None = None
    weight_origins_why_not: str | None = None

    @property
    def model_path(self) -> Path:
        """The decoder's model file."""
        return self.path / SESSIONS["decoder"].filename(self.plan.settings)

    def session_path(self, name: str) -> Path:
        return self.path / SESSIONS[name].filename(self.plan.settings)

    def summary(self) -> dict[str, Any]:
        """What CI scripts read (``--json``): where the package is, its sessions, sizes, passes,
        stage timings and notes; the full record is the package's export_report.json."""
        return package_summary(self.path, self.report)


def _without_cyclic_collection(function: Callable) -> Callable:
    """Python's cyclic garbage collector off while ``function`` runs, as it was after. An export
    makes millions of objects that live until it ends (traced nodes, fake tensors, symbolic
    shapes), which the collector would traverse again and again for nothing: 2.2 s of a 35-layer
    export, against 30 MiB more peak memory without it. Garbage is freed by reference counting as
    usual, and cycles at the next collection after the export."""

    @functools.wraps(function)
    def collecting_after(*args, **kwargs):
        enabled = gc.isenabled()
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return collecting_after


@_without_cyclic_collection
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
    text_only: bool = False,
    int4_encoders: bool = False,
    processor: Any = None,
    on_stage: Callable[[str, StageRecord | None], None] | None = None,
    progress: bool = False,
    max_length: int | None = None,
    cache: bool | str | Path = True,
) -> ExportedPackage:
    """Export a decoder LM to an ONNX Runtime GenAI package in ``output_dir``.

    ``model`` is a preset name, a local Hugging Face folder, a GGUF file, a hub id or alias, or an
    in-memory ``PreTrainedModel`` (then ``tokenizer`` is required). ``ep`` is a profile name or an
    ``EpProfile`` of your own (e.g. ``dataclasses.replace(get_profile("cpu"), max_buffer_size=...)``).
    ``graph_capture=False`` exports for a profile's EP with graph capture off (a profile that
    captures needs every node on the EP). By default the graph computes logits
    for each sequence's last token only (what generation reads); ``full_logits=True`` keeps all
    positions, for scoring. ``on_stage(name, record)`` is called with ``record=None`` when a
    stage starts and with its timings when it ends. ``random_weights`` builds the source's
    architecture from its config with random weights (no weights downloaded or read). ``strict``
    makes a checkpoint tensor the export would not read an error (by default the report lists
    them). ``int4`` sets block size, symmetry, accuracy level, method and 8-bit roles for
    ``precision="int4"`` (default: ``Int4Options()``, the accuracy level the profile's);
    ``precision="int8"`` stores every weight in symmetric 8-bit blocks. A Gemma 4 multimodal model gives a
    multimodal package (decoder, embedding, vision and speech sessions) unless ``text_only``; an
    in-memory one then needs its ``processor`` (or the processor's folder) for the image and audio
    settings. ``int4_encoders`` quantizes the vision and speech towers too at ``precision="int4"``
    or ``"int8"``
    (by default they stay at the activation precision). ``max_length`` caps the context GenAI
    allocates and generates to (genai_config's context_length and search.max_length); by default
    the model's own, capped by the profile's default (webgpu: 4096, since under graph capture the
    whole KV buffer is allocated up front). The report gives the KV cache's bytes at that length.
    ``cache``: where lowered graphs are kept for re-exports of the same architecture with other
    weights (``exporter.cache.graph_cache``): True for ``$XDG_CACHE_HOME/genai-exporter/graphs`` (off where
    ``GENAI_EXPORTER_NO_CACHE=1``), a folder, or False for none. Every file of a package but its
    report is byte-identical whether or not its graphs came from the cache.
    """
    # Every option keyword, by ExportOptions' field names (tests/exporter/test_options.py keeps the
    # signature and the record one list): a new option cannot be left out here.
    given = locals()
    options = ExportOptions(**{field.name: given[field.name] for field in dataclasses.fields(ExportOptions)})
    resolved = options.resolve()
    profile, precision, int4 = resolved.profile, resolved.precision, resolved.int4
    cache_folder = graph_cache.chosen_folder(cache)
    output_dir = Path(output_dir)
    target = destination.check_destination(output_dir, overwrite)
    display = ProgressDisplay() if progress else None
    stages = StageLog(*(listener for listener in (display, on_stage) if listener is not None))

    with stages.stage("load"):
        options = LoadOptions(allow_pickled_weights, trust_remote_code, random_weights, strict, text_only)
        loaded = load(model, tokenizer, options, processor)
        compute_dtype = PRECISIONS[precision].compute_dtype(profile)
        prepared = prepare(loaded, compute_dtype, int4 if PRECISIONS[precision].weight_bits == 4 else None)
    ranges, awq = prepared.activation_ranges, prepared.activation_aware_scales
    settings = export_settings(profile, prepared.layout, precision, graph_capture=graph_capture,
                               full_logits=full_logits, int4=int4, multimodal=loaded.multimodal,
                               int4_encoders=int4_encoders,
                               residual_exponent=activation_ranges.exponent_of(ranges), max_length=max_length,
                               activation_aware_scales=awq.scales if awq is not None else None)
    plan = make_plan(settings)
    tokenizer_bytes = _tokenizer_bytes(loaded.tokenizer)
    destination.require_space(target, _fewest_weight_bytes(prepared, settings, plan) + tokenizer_bytes)
    report = _new_report(loaded, settings, plan)
    if ranges is not None:
        report.activation_ranges = activation_ranges.report_of(ranges)
    if awq is not None:
        report.activation_aware_scales = awq.to_dict()
    length = settings.context_length
    report.kv_cache = {"max_length": length, "element_bytes": compute_dtype.itemsize,
                       "bytes": settings.layout.kv_cache_bytes(length, compute_dtype.itemsize)}

    cached_graphs = _graph_cache(cache_folder, cache is False, prepared, settings, plan, report)

    models, readers = {}, {}
    for session_plan in plan.sessions:
        session = SESSIONS[session_plan.name]
        models[session.name], readers[session.name], settings = _export_session(
            session, session_plan, prepared, settings, report, stages, cached_graphs)
    report.notes += activation_ranges.risk_notes(ranges, report.onnx_pass_changes("scale_residual_stream"),
                                                 settings.layout.num_layers)
    every_reader = [reader for session_readers in readers.values() for reader in session_readers]
    if loaded.weights is not None:
        report.notes += account(loaded.weights, len(every_reader),
                                        {reader.tensor_name for reader in every_reader}, strict)
    origins = _weight_origins(loaded, models, readers, settings)

    package_bytes = _package_bytes(report, tokenizer_bytes)
    destination.require_space(target, package_bytes)
    try:
        with destination.staging_folder(target) as staging:
            _write_package(staging, models, loaded, settings, report, stages, display, package_bytes)
            if origins[0] is not None and (why_not := _read_once_each(models, readers)):
                origins = None, why_not
    except OSError as error:
        if mapped := environment_error(error, package_bytes, where=target.path):
            raise mapped from error
        raise
    return ExportedPackage(output_dir, report, settings.layout, plan, *origins)


def _weight_origins(loaded, models, readers, settings: ExportSettings) -> tuple[dict | None, str | None]:
    """Each session file's weights -> where their bytes come from, or why the package's weights
    depend on more than their checkpoint tensors (``ExportedPackage.weight_origins``)."""
    if not isinstance(loaded.weights, SafetensorsWeights):
        return None, "the weights do not stream from a checkpoint folder's safetensors"
    if settings.compute_dtype == torch.float16:
        # Another checkpoint may need another residual scale (or none): only an export measures it.
        return None, ("its activations are fp16, whose residual scale the export measures from the weights "
                      "(exporter.load.activation_ranges) and a replay would not")
    if loaded.weights.compared_values:
        return None, "the checkpoint saves a tied tensor under two keys, whose values the export compared"
    origins = {}
    for name, model in models.items():
        session = weight_origins(model, readers[name])
        if session.origins is None:
            return None, session.why_not
        origins[SESSIONS[name].filename(settings)] = session.origins
    return origins, None


def _read_once_each(models, readers) -> str | None:
    """Whether, once written, each weight was read by the writer once for each initializer made
    from it and by nothing else: what ``weight_origins`` concluded before writing, confirmed
    (None), or why not."""
    for name, model in models.items():
        expected = collections.Counter()
        for value in model.graph.initializers.values():
            chain = made_from(value.const_value)
            if chain is not None and chain[0] is not None:
                expected[id(chain[0])] += 1
        for reader in readers[name]:
            if reader.reads != expected[id(reader)]:
                return f"weight {reader.name} was read {reader.reads} times while the package was written"
    return None


def _write_package(staging: Path, models, loaded, settings: ExportSettings, report: ExportReport,
                   stages: StageLog, display: ProgressDisplay | None, package_bytes: int) -> None:
    with stages.stage("package"), _write_progress(display, models) as on_tensor:
        sections = {}
        for name, onnx_model in models.items():
            session = SESSIONS[name]
            package.save_model(onnx_model, staging, session.filename(settings), on_tensor)
            sections[name] = session.genai_section(settings, [v.name for v in onnx_model.graph.inputs])
            for filename, values in session.extra_files(settings).items():
                package.save_json(values, staging / filename)
        genai_config = build_genai_config(settings, loaded.generation_config, sections)
        package.save_json(genai_config, staging / package.GENAI_CONFIG_FILENAME)
        package.save_tokenizer(loaded.tokenizer, staging)
    if settings.compute_dtype == torch.float16:
        with stages.stage("sample_prefill"):
            report.sample_prefill = run_sample_prefill(staging, loaded.tokenizer, package_bytes)
    package.save_report(report, stages, staging)


# What a node's protobuf takes in model.onnx, with room to spare (about 180 bytes measured on the
# tiny Gemma 4), and the configs and report (a few KiB for the tiny models, under 1 MiB for E2B).
_GRAPH_BYTES_PER_NODE = 1024
_CONFIG_AND_REPORT_BYTES = 1 << 20


def _write_progress(display: ProgressDisplay | None, models) -> contextlib.AbstractContextManager:
    """The display's write bar over the tensors the package writer writes externally (nothing
    without a display)."""
    if display is None:
        return contextlib.nullcontext(None)
    tensors, weight_bytes = map(sum, zip(*(package.external_tensors(m) for m in models.values()), strict=True))
    return display.writing(tensors, weight_bytes)


def _package_bytes(report: ExportReport, tokenizer_bytes: int) -> int:
    """The package's size, known once the graphs are built: weights (inside the model files or
    beside them), each graph's nodes, the tokenizer, the configs and the report."""
    sessions = report.sessions.values()
    weight_bytes = sum(r.initializers["total_bytes"] for r in sessions)
    node_count = sum(sum(r.op_counts.values()) for r in sessions)
    return weight_bytes + node_count * _GRAPH_BYTES_PER_NODE + tokenizer_bytes + _CONFIG_AND_REPORT_BYTES


def _tokenizer_bytes(tokenizer) -> int:
    """tokenizer.json's size, serialized the way save_pretrained writes it (0 for a tokenizer that
    has no fast backend: its vocabulary files are small beside any model's weights)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return len(backend.to_str(pretty=True).encode()) if backend is not None else 0


def _fewest_weight_bytes(prepared, settings: ExportSettings, plan: ExportPlan) -> int:
    """The package's size as known before anything is traced: every saved tensor at the fewest
    bytes per weight any planned session stores (the exact size is checked before writing)."""
    elements = sum({id(t): t.numel() for t in prepared.model.state_dict(keep_vars=True).values()}.values())
    return int(elements * min(settings.stored_weight_bytes(SESSIONS[s.name]) for s in plan.sessions))


def _export_session(session, session_plan, prepared, settings: ExportSettings, report: ExportReport,
                    stages: StageLog, cached_graphs: tuple[graph_cache.GraphCache, dict] | None):
    """One session: its lowered graph from the cache, or trace -> FX passes -> lower; then weights
    attached lazily -> ONNX passes -> post-conditions. Returns its ONNX model, the readers of its
    weights (``attach``), and the settings with the decoder layers that kept plain
    attention."""
    session_report = report.sessions[session.name] = SessionReport(session.filename(settings))
    lowered = cached_graphs[0].read(session.name) if cached_graphs is not None else None
    if lowered is not None:
        report.graph_cache["sessions"][session.name] = "hit"
        with stages.stage(_stage("graph_cache", session, settings)):
            onnx_model = lowered.model()
    else:
        lowered, onnx_model, decomposed_because, copied_layers = _lower_session(
            session, session_plan, prepared, settings, stages)
        session_report.lowering = (f"re-traced by torch.onnx to decompose it ({decomposed_because})"
                                   if decomposed_because else "without torch.onnx's decomposition re-trace")
        session_report.tracing = _tracing_words(copied_layers, settings.layout.num_layers)
        if cached_graphs is not None:
            with stages.stage(_stage("graph_cache", session, settings)):
                _write_to_cache(cached_graphs, session.name, lowered, report)
    session_report.fx_passes = lowered.fx_passes
    report.notes += _fx_pass_notes(session_plan, lowered.fx_passes)
    settings = _with_findings(settings, session, session_plan, lowered.fx_passes)
    with stages.stage(_stage("onnx_passes", session, settings)):
        readers = attach(onnx_model, prepared.weight_store, lowered.recipes)
        _run_onnx_passes(onnx_model, session, session_plan, settings, session_report)
        postconditions.require(onnx_model, settings, session)
        if note := postconditions.uncaptured_cpu_note(onnx_model, settings, session):
            report.notes.append(note)
    session_report.describe_graph(onnx_model)
    return onnx_model, readers, settings


def _lower_session(session, session_plan, prepared, settings: ExportSettings, stages: StageLog):
    """Trace -> FX passes -> lower; the graph is serialized with its weights as placeholders and
    read back, so that the steps after it see the graph a cache would give. Also returns why
    lowering had to re-trace, if it did, and how many decoder layers were copied rather than traced
    (``exporter.trace.layer_replicas``; None for a session without decoder layers), or why none were."""
    with stages.stage(_stage("trace", session, settings)):
        traced = _run_step("tracing with torch.export", session.trace, prepared, settings)
        copied_layers = traced.program.graph_module.meta.get(REPLICATED_LAYERS)
        translation_ready.record_traced_values(traced.program)
    with stages.stage(_stage("fx_passes", session, settings)):
        program, fx_records = _run_fx_passes(traced.program, session_plan, settings, session)
        _with_findings(settings, session, session_plan, fx_records)  # a refused export stops here, not after lowering
    with stages.stage(_stage("lower", session, settings)):
        onnx_model, decomposed_because = _run_step("lowering to ONNX", lower, program, traced.sample_inputs,
                                                   session.input_names(settings), session.output_names(settings))
        names = tensor_names(traced.module, prepared.model)
        del program, traced
        recipes = detach(onnx_model, prepared.saved_shapes, names, real_weights=prepared.weights_in_model)
        lowered = graph_cache.LoweredSession.of(onnx_model, recipes, fx_records)
        return lowered, lowered.model(), decomposed_because, copied_layers


def _tracing_words(copied_layers: int | str | None, layers: int) -> str:
    if copied_layers is None:
        return ""
    if isinstance(copied_layers, str):
        return f"every decoder layer traced: {copied_layers}"
    if copied_layers == 0:
        return "every decoder layer traced"
    return (f"{layers - copied_layers} of {layers} decoder layers traced, the other {copied_layers} "
            "copied from the traced layer of the same structure")


def _graph_cache(folder: Path | None, turned_off: bool, prepared, settings: ExportSettings, plan: ExportPlan,
                 report: ExportReport) -> tuple[graph_cache.GraphCache, dict] | None:
    """The export's cache entry and its key's ingredients (None where the cache is off, and the
    report says why)."""
    if folder is None:
        report.graph_cache = {"off": "cache=False (--no-cache)" if turned_off
                              else f"{graph_cache.NO_CACHE_VARIABLE} is set"}
        return None
    try:
        views = (prepared.decoder,) if prepared.decoder is not prepared.model else ()
        ingredients = graph_cache.key_ingredients(prepared.model, prepared.weight_store, settings, plan, views)
    except Exception as error:  # a model the key cannot read costs the cache, never the export
        ingredients = f"the key could not be computed ({type(error).__name__}: {error})"
    if isinstance(ingredients, str):
        report.graph_cache = {"off": ingredients}
        return None
    key = graph_cache.key_of(ingredients)
    report.graph_cache = {"folder": str(folder), "key": key, "sessions": {}}
    return graph_cache.GraphCache(folder, key), ingredients


def _write_to_cache(cached_graphs: tuple[graph_cache.GraphCache, dict], session: str, lowered,
                    report: ExportReport) -> None:
    """A cache that cannot be written costs the next export its time, never this one's package."""
    entry, ingredients = cached_graphs
    try:
        entry.write(session, lowered, ingredients)
    except OSError as error:
        report.graph_cache["sessions"][session] = f"not written ({error.strerror or error})"
        return
    report.graph_cache["sessions"][session] = "written"
    with contextlib.suppress(OSError):  # another export pruning the same cache
        entry.prune()


def _with_findings(settings: ExportSettings, session, session_plan, fx_records: list[dict]) -> ExportSettings:
    """The settings with what the session's FX passes found (each pass's ``findings``)."""
    passes = [FX_PASSES[p.name] for p in session_plan.fx_passes]
    for fx_pass, record in zip(passes, fx_records, strict=True):
        if (find := getattr(fx_pass, "findings", None)) and (found := find(record["changes"])):
            settings = settings.with_findings(session, **found)
    return settings


def _stage(step: str, session, settings: ExportSettings) -> str:
    """A step's stage name: the step itself in a one-session package, ``step:session`` otherwise."""
    return f"{step}:{session.name}" if settings.multimodal else step


def _new_report(loaded, settings: ExportSettings, plan: ExportPlan) -> ExportReport:
    layout = settings.layout
    report = ExportReport(source=loaded.source, ep=settings.profile.name, precision=settings.precision,
                          layout=dataclasses.asdict(layout), plan=plan.to_dict(), notes=[*loaded.notes, *plan.notes])
    if note := layout.padded_values_note():
        report.notes.append(note)
    if genai_model_type(layout) == FALLBACK_DECODER_TYPE != layout.model_type:
        report.notes.append(f"ONNX Runtime GenAI does not list model type '{layout.model_type}'; "
                            f"genai_config names it '{FALLBACK_DECODER_TYPE}' (same decoder I/O)")
    return report


def _run_fx_passes(program, session_plan, settings: ExportSettings, session):
    passes = [FX_PASSES[p.name] for p in session_plan.fx_passes]
    try:
        program, records = run_fx_passes(program, passes, settings, session)
    except PassDidNotApply as error:
        raise ExporterError(f"FX pass failed: {error}") from error
    return program, [dataclasses.asdict(r) for r in records]


def _fx_pass_notes(session_plan, records: list[dict]) -> list[str]:
    """What a pass says in words of its counts (the truncation: where it cut, what it saves)."""
    passes = [FX_PASSES[p.name] for p in session_plan.fx_passes]
    return [note for p, r in zip(passes, records, strict=True)
            if (describe := getattr(p, "note", None)) and (note := describe(r["changes"]))]


def _run_onnx_passes(onnx_model, session, session_plan, settings: ExportSettings, report: SessionReport) -> None:
    try:
        records = run_onnx_passes(onnx_model, [ONNX_PASSES[p.name] for p in session_plan.onnx_passes], settings, session)
    except FusionDidNotApply as error:
        raise ExporterError(f"ONNX fusion failed: {error}") from error
    report.onnx_passes = [dataclasses.asdict(r) for r in records]


def _run_step(what: str, function, *args):
    try:
        return function(*args)
    except ExporterError:
        raise
    except Exception as error:
        text = str(error).strip()
        raise ExporterBug(
            f"{what} failed: {type(error).__name__}: {text.splitlines()[0] if text else ''} "
            "(rerun with --debug for the traceback; please report it with the model's config)"
        ) from error
