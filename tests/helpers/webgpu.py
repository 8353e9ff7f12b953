"""The WebGPU EP for the L5 tests: present here, or a skip (a failure under CI)."""

from __future__ import annotations

import os

import pytest

from ep_profiles import get_profile
from exporter.verify.ep_runtime import EpUnavailable

WEBGPU = get_profile("webgpu")


def require_webgpu():
    """The EP and an adapter; in CI their absence is a failure (.ci/run installs them)."""
    import onnxruntime as ort

    try:
        from exporter.verify.ep_runtime import register

        register(WEBGPU)
        if not any(d.ep_name == WEBGPU.ort_provider for d in ort.get_ep_devices()):
            raise EpUnavailable("no WebGPU adapter (is Mesa's lavapipe from bookworm-backports installed?)")
    except EpUnavailable as error:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the WebGPU tests: {error}; .ci/run installs the stack")
        pytest.skip(f"WebGPU EP not on this machine ({error}); run scripts/install_webgpu_stack.sh")
