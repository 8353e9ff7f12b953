"""EP profiles are data the pipeline can rely on."""

from __future__ import annotations

import dataclasses

import pytest

from ep_profiles import PLANNED_EPS, PROFILES, get_profile
from ep_profiles.registry import UnknownProfileError
from fx_passes import FX_PASSES


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profile_is_consistent(name):
    profile = get_profile(name)
    assert profile.name == name
    assert profile.precisions and profile.default_precision == profile.precisions[0]
    assert all(p in FX_PASSES for p in profile.fx_passes), "profile asks for an unknown FX pass"
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.name = "other"  # type: ignore[misc]


def test_planned_and_unknown_eps_are_told_apart():
    for name in PLANNED_EPS:
        with pytest.raises(UnknownProfileError, match="not supported yet"):
            get_profile(name)
    with pytest.raises(UnknownProfileError, match="unknown EP"):
        get_profile("tpu")
