"""L2: the routed-experts substitution computes what the traced blocks did (the packages' L3 and L4
are the family tests, and the fused-vs-plain test in tests/exporter/test_more_architectures.py)."""

from __future__ import annotations

import pytest
import torch

from ep_profiles import get_profile
from exporter.load.layout import derive_layout
from exporter.load.presets import build_preset
from exporter.trace.decoder import make_inputs, trace
from fx_passes.base import run_fx_passes
from fx_passes.registry import FX_PASSES
from tests.helpers.families import FUSED_MIXTURE_OF_EXPERTS_FAMILIES
from tests.helpers.plan_settings import DECODER, pass_settings

MOE = torch.ops.genai_exporter.mixture_of_experts.default


def _substituted(name: str):
    model, _ = build_preset(name)
    layout = derive_layout(model)
    program, _ = trace(model, layout)
    generator = torch.Generator().manual_seed(0)
    cases = [make_inputs(layout, 1, 7, 0, generator=generator), make_inputs(layout, 2, 1, 5, generator=generator),
             make_inputs(layout, 2, 6, 0, generator=generator, right_padding=(0, 2))]
    with torch.no_grad():
        before = [program.module()(*inputs) for inputs in cases]
    settings = pass_settings(get_profile("cpu"), layout)
    passes = [FX_PASSES[n] for n in ("drop_runtime_asserts", "drop_noop_casts", "substitute_mixture_of_experts")]
    program, records = run_fx_passes(program, passes, settings, DECODER)
    return layout, program, cases, before, records[-1].changes


@pytest.mark.l2
@pytest.mark.parametrize("name", sorted(FUSED_MIXTURE_OF_EXPERTS_FAMILIES))
def test_substitution_keeps_results(name):
    layout, program, cases, before, changes = _substituted(name)
    fused = [n for n in program.graph.nodes if n.target is MOE]
    assert len(fused) == layout.experts_modules == len(changes["substituted_layers"]) > 0
    assert changes["plain_blocks"] == {}
    # No expert's weights are gathered per token any more.
    assert not any(n.target is torch.ops.aten.index.Tensor and "experts" in str(n.args[0]) for n in program.graph.nodes)
    with torch.no_grad():
        for inputs, want in zip(cases, before, strict=True):
            for got, expected in zip(program.module()(*inputs), want, strict=True):
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.l2
def test_gemma4_experts_stay_plain_and_say_why():
    """Gemma 4's router scales each expert's weight (per_expert_scale) and its experts are
    GELU-gated: not what the MoE op computes, so the blocks stay as traced."""
    layout, program, cases, before, changes = _substituted("tiny-gemma-4-moe")
    assert changes["substituted_layers"] == [] and len(changes["plain_blocks"]) == layout.experts_modules == 4
    assert all("SiLU-gated" in why for why in changes["plain_blocks"].values())
    assert not any(n.target is MOE for n in program.graph.nodes)
