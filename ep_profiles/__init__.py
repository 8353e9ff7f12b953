"""Execution-provider profiles: one frozen record per ONNX Runtime EP.

Profiles are data only. Pipeline stages read their fields (which passes to run, what genai_config
says about the provider, which precisions it can run); no stage branches on a profile's name.
"""

from ep_profiles.profile import WINDOW_BY_ATTRIBUTE, WINDOW_BY_MASK, EpProfile
from ep_profiles.registry import PROFILES, get_profile

__all__ = ["PROFILES", "WINDOW_BY_ATTRIBUTE", "WINDOW_BY_MASK", "EpProfile", "get_profile"]
