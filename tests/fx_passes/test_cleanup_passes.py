"""L2: the clean-up passes keep the program's results exactly, and say what they erased."""

from __future__ import annotations

import pytest
import torch

from ep_profiles import get_profile
from exporter.load.layout import derive_layout
from exporter.load.presets import build_preset
from exporter.trace.decoder import make_inputs, trace
from fx_passes import FX_PASSES, run_fx_passes
from tests.helpers.plan_settings import DECODER, pass_settings

pytestmark = pytest.mark.unit

ASSERT = torch.ops.aten._assert_tensor_metadata.default
CASTS = (torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten.type_as.default)


def _count(program, targets) -> int:
    return sum(1 for n in program.graph.nodes if n.op == "call_function" and n.target in targets)


def _noop_casts(program) -> int:
    return sum(
        1
        for n in program.graph.nodes
        if n.op == "call_function"
        and n.target in CASTS
        and n.args[0].meta["val"].dtype == n.meta["val"].dtype
    )


@pytest.fixture(scope="module")
def traced_tiny_gemma4():
    model, _ = build_preset("tiny-gemma-4")
    layout = derive_layout(model)
    program, _ = trace(model, layout)
    return program, layout


@pytest.mark.l2
def test_cleanup_passes_keep_semantics(traced_tiny_gemma4):
    program, layout = traced_tiny_gemma4
    generator = torch.Generator().manual_seed(0)
    cases = [
        make_inputs(layout, 1, 7, 0, generator=generator),
        make_inputs(layout, 2, 1, 9, generator=generator),
        make_inputs(layout, 3, 4, 20, generator=generator, left_padding=(0, 2, 5)),
    ]
    with torch.no_grad():
        before = [program.module()(*inputs) for inputs in cases]
    asserts, noop_casts, casts = _count(program, (ASSERT,)), _noop_casts(program), _count(program, CASTS)
    assert asserts > 0 and noop_casts > 0 and casts > noop_casts  # int64 -> float casts must stay

    settings = pass_settings(get_profile("cpu"), layout)
    passes = [FX_PASSES["drop_runtime_asserts"], FX_PASSES["drop_noop_casts"]]
    program, records = run_fx_passes(program, passes, settings, DECODER)

    assert records[0].changes == {"asserts_erased": asserts}
    assert records[1].changes == {"casts_erased": noop_casts}
    assert _count(program, (ASSERT,)) == 0 and _noop_casts(program) == 0
    assert _count(program, CASTS) == casts - noop_casts
    with torch.no_grad():
        for inputs, expected in zip(cases, before, strict=True):
            for got, want in zip(program.module()(*inputs), expected, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
