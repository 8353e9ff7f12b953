"""The facts behind the profiles' ``weight_bit_widths`` and ``weight_float_zero_points``,
re-measured: every block-quantized case (``scripts/probe_quantized_kernels.py``) is exact on each
EP whose profile claims 8 bits, float zero points run exactly where claimed, and the probe calls a
kernel that decodes other values wrong."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from ep_profiles import get_profile
from tests.helpers.webgpu import require_webgpu

pytestmark = pytest.mark.unit

_SPEC = importlib.util.spec_from_file_location(
    "probe_quantized_kernels", Path(__file__).resolve().parents[2] / "scripts" / "probe_quantized_kernels.py")
probe_quantized_kernels = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = probe_quantized_kernels  # its dataclass looks its module up there
_SPEC.loader.exec_module(probe_quantized_kernels)


def _assert_every_case_exact(ep: str):
    """Every integer-zero-point case exact; the 4-bit float-zero-point cases exact exactly where the
    profile claims them (``weight_float_zero_points``), so a plugin that starts or stops running
    them fails here until the profile says so."""
    cases = probe_quantized_kernels.probe(ep)
    integer = [case for case in cases if case.zero_points != "float"]
    assert {case.bits for case in integer} == {4, 8} and len(integer) == 24
    assert all(case.result == "exact" for case in integer), [c for c in integer if c.result != "exact"]
    assert 8 in get_profile(ep).weight_bit_widths and "int8" in get_profile(ep).precisions
    float_four_bit = [case for case in cases if case.zero_points == "float" and case.bits == 4]
    assert len(float_four_bit) == 4
    claimed = get_profile(ep).weight_float_zero_points
    assert all((case.result == "exact") == claimed for case in float_four_bit), (claimed, float_four_bit)


@pytest.mark.l3
def test_cpu_runs_4_and_8_bit_blocks_exactly():
    _assert_every_case_exact("cpu")


@pytest.mark.l5
@pytest.mark.xdist_group("webgpu")
def test_webgpu_runs_4_and_8_bit_blocks_exactly():
    require_webgpu()
    _assert_every_case_exact("webgpu")


@pytest.mark.l3
def test_a_kernel_reading_other_values_is_called_wrong(monkeypatch):
    """The reference decodes ``scale * (zero_point - q)`` (a sign flipped, as a nibble or zero
    point misread flips a block): the CPU's right answer is then reported wrong, so the probe can
    fail."""
    blocks = probe_quantized_kernels._blocks

    def flipped(rng, bits, zero_points, rows, dtype):
        blob, scales, zero, weights = blocks(rng, bits, zero_points, rows, dtype)
        return blob, scales, zero, -weights

    monkeypatch.setattr(probe_quantized_kernels, "_blocks", flipped)
    cases = probe_quantized_kernels.probe("cpu")
    # The CPU refuses 8-bit blocks with float zero points before computing anything.
    assert {case.result for case in cases if not (case.bits == 8 and case.zero_points == "float")} == {"wrong"}
