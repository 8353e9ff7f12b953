"""The profiles the exporter can target today, and those still planned."""

from __future__ import annotations

from ep_profiles.profile import EpProfile

CPU = EpProfile(
    name="cpu",
    genai_provider="",
    ort_provider="CPUExecutionProvider",
    precisions=("fp32",),
    description="ONNX Runtime's default CPU provider",
    fx_passes=("drop_runtime_asserts", "drop_noop_casts"),
    fused_ops=("GroupQueryAttention", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"),
    past_present_share_buffer=True,
)

PROFILES: dict[str, EpProfile] = {p.name: p for p in (CPU,)}

# Accepted names whose profiles have not landed yet: asking for one gets a clear "not yet"
# rather than an "unknown EP", so users know the name is right.
PLANNED_EPS: tuple[str, ...] = ("cuda", "dml", "webgpu", "trt-rtx")


class UnknownProfileError(ValueError):
    pass


def get_profile(name: str) -> EpProfile:
    if name in PROFILES:
        return PROFILES[name]
    available = ", ".join(PROFILES)
    if name in PLANNED_EPS:
        raise UnknownProfileError(
            f"EP '{name}' is not supported yet (planned); use one of: {available}"
        )
    raise UnknownProfileError(f"unknown EP '{name}'; use one of: {available}")
