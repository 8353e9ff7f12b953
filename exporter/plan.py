"""The export plan, computed in one place from the profile's facts, the precision, the options and
the model's facts: for each session, the FX passes and the ONNX passes in order, each with why it
applies. ``python -m exporter plan MODEL --ep X`` prints it; the export report records it.

A pass is planned on a session where its ``applies(settings, session)`` gives a reason; passes never re-check their own
scheduling. The settings are what the plan decided about the profile (graph capture on or off,
the attention op at this precision), so no stage rewrites the profile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ep_profiles import EpProfile
from exporter.load.layout import DecoderLayout
from exporter.load.multimodal import MultimodalFacts
from exporter.onnx_passes import ONNX_PASSES
from exporter.int4_options import Int4Options
from exporter.precisions import PRECISIONS
from exporter.sessions import SESSIONS
from fx_passes import FX_PASSES


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
    # Decoder layers GroupQueryAttention could not take (found by its FX pass; set by
    # ``pipeline._with_plain_attention_layers`` after the decoder's FX passes):
    # their attention stays transformers', and past and present KV are then separate buffers.
    plain_attention_layers: tuple[int, ...] = ()
    # k in the decoder's residual-stream scale 2**-k at fp16 activations, from the float32 peaks
    # measured at export time (``exporter.load.activation_ranges``); 0: no scaling. Depends on the
    # weights, so the graph cache's key leaves it out (it acts after the cached graphs).
    residual_exponent: int = 0

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
                    residual_exponent: int = 0) -> ExportSettings:
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
    )


def make_plan(settings: ExportSettings) -> ExportPlan:
    def planned(registry, session) -> tuple[PlannedPass, ...]:
        return tuple(PlannedPass(p.name, why) for p in registry.values() if (why := p.applies(settings, session)))

    return ExportPlan(settings, tuple(
        SessionPlan(name, planned(FX_PASSES, session), planned(ONNX_PASSES, session))
        for name, session in SESSIONS.items() if session.applies(settings)
    ))
