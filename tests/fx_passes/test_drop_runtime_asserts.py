"""L2: the program after the pass computes what it computed before, without assert nodes."""

from __future__ import annotations

import pytest
import torch

from ep_profiles import get_profile
from exporter.layout import derive_layout
from exporter.presets import build_preset
from exporter.trace import make_inputs, trace
from fx_passes import FX_PASSES, PassContext, run_fx_passes

ASSERT = torch.ops.aten._assert_tensor_metadata.default


@pytest.mark.l2
def test_drop_runtime_asserts_keeps_semantics():
    model, _ = build_preset("tiny-gemma-4")
    layout = derive_layout(model)
    program, _ = trace(model, layout)
    generator = torch.Generator().manual_seed(0)
    cases = [make_inputs(layout, b, s, p, generator=generator) for b, s, p in [(1, 7, 0), (2, 1, 9), (3, 4, 20)]]
    with torch.no_grad():
        before = [program.module()(*inputs) for inputs in cases]
    asserts_before = sum(1 for n in program.graph.nodes if n.target is ASSERT)
    assert asserts_before > 0

    context = PassContext(profile=get_profile("cpu"), layout=layout)
    program, records = run_fx_passes(program, [FX_PASSES["drop_runtime_asserts"]], context)

    assert records[0].changes == {"asserts_erased": asserts_before}
    assert not any(n.target is ASSERT for n in program.graph.nodes)
    with torch.no_grad():
        for inputs, expected in zip(cases, before):
            for got, want in zip(program.module()(*inputs), expected):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
