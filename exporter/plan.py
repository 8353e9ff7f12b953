"""The export plan, computed in one place from the profile's facts, the precision, the options and
the model's facts: for each session, the FX passes and the ONNX passes in order, each with why it
applies. ``python -m exporter plan MODEL --ep X`` prints it; the export report records it.

A pass is planned on a session where its ``applies(settings, session)`` gives a reason; passes never re-check their own
scheduling. The settings are what the plan decided about the profile (graph capture on or off,
the attention op at this precision), so no stage rewrites the profile.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ep_profiles import EpProfile
from exporter.errors import ExporterError
from exporter.int4_options import Int4Options
from exporter.load.layout import DecoderLayout
from exporter.load.multimodal import MultimodalFacts
from exporter.onnx_passes import ONNX_PASSES
from exporter.precisions import PRECISIONS
from exporter.sessions import SESSIONS
from fx_passes import FX_PASSES
from fx_passes.custom_ops.ops import FLOAT32_COUNT_LIMIT
from fx_passes.substitute_group_query_attention import describe_plain_layers


@dataclass(frozen=True)
class ExportSettings:
    """What the plan decided for an export: every pass's ``applies`` and ``__call__`` read it, and so do
    the sessions (``fx_passes.base.Settings`` is its protocol below the plan)."""

    profile: EpProfile
    layout: DecoderLayout
    precision: str
    graph_capture: bool  # the profile captures the decoder's graph and the caller did not turn it off
    attention_op: bool  # the profile's attention op (GroupQueryAttention) runs at this precision
    full_logits: bool
    int4: Int4Options | None
    multimodal: MultimodalFacts | None = None  # None: a text package (the decoder alone)
    int4_encoders: bool = False  # int4 quantizes the vision and speech towers too
    # Decoder layers GroupQueryAttention could not take (found by its FX pass, taken in by
    # ``with_findings`` after the decoder's FX passes): their attention stays transformers', and
    # past and present KV are then separate buffers.
    plain_attention_layers: tuple[int, ...] = ()
    # k in the decoder's residual-stream scale 2**-k at fp16 activations, from the float32 peaks
    # measured at export time (``exporter.load.activation_ranges``); 0: no scaling. Depends on the
    # weights, so the graph cache's key leaves it out (it acts after the cached graphs).
    residual_exponent: int = 0
    # The caller's cap on the context (--max-length, API max_length=); None: the profile's default.
    max_length: int | None = None
    # --int4-method awq: each decoder linear layer's input scale s by its weight's checkpoint name,
    # measured at export time (``exporter.load.activation_aware_scales``). Depends on the weights,
    # so the graph cache's key leaves it out (it acts after the cached graphs).
    activation_aware_scales: dict | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def context_length(self) -> int:
        """The positions the package allocates and generates to (genai_config's context_length and
        search.max_length): the model's own, capped by the caller's max_length, else by the
        profile's default cap."""
        if self.max_length is None:
            return self.profile.capped_context(self.layout.context_length)
        return min(self.layout.context_length, self.max_length)

    @property
    def compute_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision].compute_dtype(self.profile)

    @property
    def weight_bytes(self) -> float:
        return PRECISIONS[self.precision].weight_bytes

    def quantized(self, session) -> bool:
        """Whether ``session``'s weights are stored block-quantized: the decoder's and the
        embedding's at int4 and int8; an encoder's only with ``int4_encoders``."""
        return self.weight_bits is not None and (not session.is_encoder or self.int4_encoders)

    @property
    def weight_bits(self) -> int | None:
        """The bits of the precision's block-quantized weights; None at float precisions."""
        return PRECISIONS[self.precision].weight_bits

    def stored_weight_bytes(self, session) -> float:
        """Bytes a weight of ``session`` takes in the package (what buffer limits are checked with)."""
        if self.weight_bits is not None and not self.quantized(session):
            return self.compute_dtype.itemsize
        return self.weight_bytes

    def with_findings(self, session, plain_attention_layers: dict[int, str] | None = None) -> ExportSettings:
        """These settings with what ``session``'s FX passes found (their ``findings``): the decoder
        layers left with transformers' attention, ``{layer: why}``. Their past and present KV are
        separate buffers, which ONNX Runtime GenAI cannot capture: a captured decoder is refused."""
        if not session.is_decoder or not plain_attention_layers:
            return self
        if session.captured(self):
            raise ExporterError(
                f"EP '{self.profile.name}' captures the decoder's graph, which needs GroupQueryAttention in every "
                f"layer, and {len(plain_attention_layers)} cannot have it "
                f"({describe_plain_layers(plain_attention_layers)}); export with --no-graph-capture "
                "(API: graph_capture=False)")
        # Layer numbers, as ints: a graph-cache round trip through JSON makes the keys strings.
        return dataclasses.replace(self, plain_attention_layers=tuple(sorted(int(k) for k in plain_attention_layers)))

    @property
    def share_kv_buffer(self) -> bool:
        """Whether the package asks for one KV buffer for past and present (the export then checks
        that GroupQueryAttention writes every present)."""
        return self.profile.past_present_share_buffer and self.attention_op and not self.plain_attention_layers


@dataclass(frozen=True)
class PlannedPass:
    name: str
    why: str


@dataclass(frozen=True)
class SessionPlan:
    name: str
    fx_passes: tuple[PlannedPass, ...]
    onnx_passes: tuple[PlannedPass, ...]


@dataclass(frozen=True)
class ExportPlan:
    settings: ExportSettings
    sessions: tuple[SessionPlan, ...]
    notes: tuple[str, ...] = ()  # what passes say where they are not planned (``unplanned_note``)

    def to_dict(self) -> dict[str, Any]:
        settings = self.settings
        return {
            "ep": settings.profile.name,
            "precision": settings.precision,
            "graph_capture": settings.graph_capture,
            "attention_op": settings.profile.attention_op if settings.attention_op else "plain",
            "full_logits": settings.full_logits,
            "multimodal": settings.multimodal is not None,
            "sessions": [
                {
                    "name": session.name,
                    "captured": SESSIONS[session.name].captured(settings),
                    "fx_passes": [vars(p) for p in session.fx_passes],
                    "onnx_passes": [vars(p) for p in session.onnx_passes],
                }
                for session in self.sessions
            ],
        }

    def to_text(self) -> str:
        settings = self.settings
        capture = "on" if settings.graph_capture else "off"
        lines = [f"Export plan: {settings.profile.name}, {settings.precision}, graph capture {capture}"]
        for session in self.sessions:
            captured = " (graph captured)" if settings.graph_capture and SESSIONS[session.name].captured(settings) else ""
            lines.append(f"\nsession {session.name}{captured}")
            for title, passes in (("FX passes", session.fx_passes), ("ONNX passes", session.onnx_passes)):
                lines.append(f"  {title}:" + ("" if passes else " none"))
                width = max((len(p.name) for p in passes), default=0)
                lines += [f"    {p.name:<{width}}  {p.why}" for p in passes]
        return "\n".join(lines)


def export_settings(profile: EpProfile, layout: DecoderLayout, precision: str, *, graph_capture: bool = True,
                    full_logits: bool = False, int4: Int4Options | None = None,
                    multimodal: MultimodalFacts | None = None, int4_encoders: bool = False,
                    residual_exponent: int = 0, max_length: int | None = None,
                    activation_aware_scales: dict | None = None) -> ExportSettings:
    if max_length is not None and max_length > layout.context_length:
        raise ExporterError(f"max_length {max_length} is over the model's context length ({layout.context_length}, "
                            f"its max_position_embeddings); choose at most {layout.context_length}")
    return ExportSettings(
        profile=profile,
        layout=layout,
        precision=precision,
        graph_capture=profile.graph_capture and graph_capture,
        attention_op=profile.runs_attention_op_at(precision),
        full_logits=full_logits,
        int4=int4,
        multimodal=multimodal,
        int4_encoders=int4_encoders,
        residual_exponent=residual_exponent,
        max_length=max_length,
        activation_aware_scales=activation_aware_scales,
    )


def make_plan(settings: ExportSettings) -> ExportPlan:
    """The plan of an export with these settings; refuses a context the decoder cannot count."""
    def planned(registry, session) -> tuple[PlannedPass, ...]:
        return tuple(PlannedPass(p.name, why) for p in registry.values() if (why := p.applies(settings, session)))

    sessions = {name: session for name, session in SESSIONS.items() if session.applies(settings)}
    if any(s.is_decoder for s in sessions.values()):
        _refuse_uncountable_context(settings)
    plans = tuple(SessionPlan(name, planned(FX_PASSES, session), planned(ONNX_PASSES, session))
                  for name, session in sessions.items())
    notes = tuple(note for plan, session in zip(plans, sessions.values(), strict=True)
                  for p in (*FX_PASSES.values(), *ONNX_PASSES.values())
                  if p.name not in {q.name for q in (*plan.fx_passes, *plan.onnx_passes)}
                  and (unplanned := getattr(p, "unplanned_note", None)) and (note := unplanned(settings, session)))
    return ExportPlan(settings, plans, notes)


def counts_positions_in_float32(settings: ExportSettings) -> bool:
    """Whether the decoder counts tokens or compares position ids in float32 on the device: the
    captured last-token choice, and attention over explicit slots (sliding layers, soft-capped
    layers, where the kernel drops the window or the softcap)."""
    kernel, layout = settings.profile.attention_kernel, settings.layout
    in_graph = ((not kernel.window_in_every_call and layout.sliding_window is not None)
                or (not kernel.softcap and layout.attention_softcap is not None) or kernel.exact_query_rows is not None)
    return settings.graph_capture or in_graph


def _refuse_uncountable_context(settings: ExportSettings) -> None:
    length = settings.context_length
    if counts_positions_in_float32(settings) and length > FLOAT32_COUNT_LIMIT:
        raise ExporterError(f"max_length {length} is over what this {settings.profile.name} decoder counts exactly "
                            f"({FLOAT32_COUNT_LIMIT} tokens, in float32 on the device): choose --max-length "
                            f"{FLOAT32_COUNT_LIMIT} or less (API: max_length=)")
