"""Execution-provider profiles: one frozen record per ONNX Runtime EP.

Profiles hold facts only: what the EP runs (precisions, attention op, norm fusions), its limits
(buffer size, graph capture) and what genai_config says about its provider. Which passes run is
the export plan's business (``exporter.plan``), computed from these facts; no stage branches on a
profile's name.
"""

from ep_profiles.profile import (
    GROUP_QUERY_ATTENTION,
    PLAIN_ATTENTION,
    AttentionKernel,
    EpProfile,
)
from ep_profiles.registry import PROFILES, get_profile

__all__ = [
    "GROUP_QUERY_ATTENTION",
    "PLAIN_ATTENTION",
    "PROFILES",
    "AttentionKernel",
    "EpProfile",
    "get_profile",
]
