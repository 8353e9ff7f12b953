"""L2 / L1: last-token gathering and shared-KV truncation, run in PyTorch against the untouched
program and against transformers' own ``logits_to_keep=1`` path."""

from __future__ import annotations

import pytest
import torch

from ep_profiles import get_profile
from exporter.load.layout import derive_layout
from exporter.load.presets import build_preset
from exporter.plan import export_settings, make_plan
from exporter.trace.decoder import GenAIDecoder, make_inputs, trace
from fx_passes import FX_PASSES, run_fx_passes
from fx_passes.analyses.graph_facts import PassDidNotApply
from tests.helpers.plan_settings import DECODER, pass_settings

LAST_TOKEN = torch.ops.genai_exporter.last_token.default
# vs the untouched program: the same ops on fewer rows, attention by GroupQueryAttention's
# reference kernel (the CPU profile's passes); observed <= 3e-6
TOLERANCE = 1e-5
# vs transformers' logits_to_keep path, which slices in other places and so runs other matmul
# shapes (other BLAS summation orders): observed 6e-5 on the 35-layer preset, logits up to ~30.
ORACLE_TOLERANCE = 1e-4
# The 35-layer preset's untempered logits reach ~30, and attention's other summation order adds up
# over 35 layers: observed 4e-5 vs the untouched program (relative ~1e-6).
DEEP_TOLERANCE = 1e-4


def _traced(name):
    model, _ = build_preset(name)
    layout = derive_layout(model)
    program, _ = trace(model, layout)
    return model, layout, program


def _cases(layout, window):
    generator = torch.Generator().manual_seed(0)
    long = window + 5  # prefill longer than the sliding window
    return [
        make_inputs(layout, 1, 7, 0, generator=generator),
        make_inputs(layout, 1, long, 0, generator=generator),
        make_inputs(layout, 2, 1, 9, generator=generator),
        make_inputs(layout, 1, 1, long, generator=generator),
        make_inputs(layout, 2, 6, 0, generator=generator, right_padding=(0, 3)),
        make_inputs(layout, 2, 4, 8, generator=generator, past_right_padding=(0, 3)),
    ]


def _last_real(logits, attention_mask):
    seq = logits.shape[1]
    chunk = attention_mask[:, attention_mask.shape[1] - seq :]
    rows = [max((j for j in range(seq) if chunk[b, j]), default=0) for b in range(len(chunk))]
    return torch.stack([logits[b, j] for b, j in enumerate(rows)])[:, None]


def _planned_fx_passes(layout) -> list[str]:
    """The FX passes the export plan runs for the CPU profile at fp32."""
    return [p.name for p in make_plan(export_settings(get_profile("cpu"), layout, "fp32")).sessions[0].fx_passes]


def _numbered_as_genai(inputs):
    """Position ids as ONNX Runtime GenAI writes them for a batch: right-padding tokens get 0
    (``make_inputs`` repeats the last real position)."""
    input_ids, attention_mask, position_ids, past = inputs
    chunk = attention_mask[:, attention_mask.shape[1] - position_ids.shape[1]:]
    return input_ids, attention_mask, position_ids * chunk, past


def _check_semantics(name, tolerance=TOLERANCE, graph_capture=False):
    """``graph_capture``: the passes' captured form, whose gathers read the position ids."""
    model, layout, program = _traced(name)
    cases = _cases(layout, model.config.sliding_window)
    if graph_capture:
        cases += [_numbered_as_genai(inputs) for inputs in cases]
    with torch.no_grad():
        before = [program.module()(*inputs) for inputs in cases]
    settings = pass_settings(get_profile("cpu"), layout, graph_capture=graph_capture)
    program, records = run_fx_passes(
        program, [FX_PASSES[n] for n in _planned_fx_passes(layout)], settings, DECODER
    )
    gathers = [node for node in program.graph.nodes if node.target is LAST_TOKEN]
    assert gathers and all((node.args[3] is not None) == graph_capture for node in gathers)
    oracle = GenAIDecoder(model, layout, logits_to_keep=1).eval()
    with torch.no_grad():
        for inputs, expected in zip(cases, before, strict=True):
            logits, *presents = program.module()(*inputs)
            assert logits.shape == (inputs[0].shape[0], 1, layout.vocab_size)
            torch.testing.assert_close(logits, _last_real(expected[0], inputs[1]), rtol=0, atol=tolerance)
            real = inputs[1].bool()
            for got, want in zip(presents, expected[1:], strict=True):
                for row in range(len(real)):  # GroupQueryAttention keeps a row's real tokens first
                    count = int(real[row].sum())
                    torch.testing.assert_close(got[row, :, :count], want[row][:, real[row]], rtol=0, atol=tolerance)
            if bool(inputs[1][:, -1].all()):  # transformers' truncation keeps the final position
                torch.testing.assert_close(logits, oracle(*inputs)[0], rtol=0, atol=ORACLE_TOLERANCE)
    return {r.name: r.changes for r in records}


@pytest.mark.l2
@pytest.mark.parametrize("graph_capture", [False, True], ids=["gathers from the mask", "captured: from positions"])
def test_tiny_gemma4_truncation_keeps_results(graph_capture):
    changes = _check_semantics("tiny-gemma-4", graph_capture=graph_capture)
    assert changes["gather_last_token"] == {"gathers": 1}
    truncation = changes["truncate_shared_kv_layers"]
    assert truncation["first_truncated_layer"] == 5  # the last KV-owning layer, after its attention
    assert truncation["layers_on_last_token"] == 4 and truncation["num_layers"] == 10
    # Layer 5's attention output and residual stream, and the per-layer inputs; no masks or rotary
    # tables, which GroupQueryAttention builds from the attention mask and its position caches.
    assert truncation["gathers"] == 3


@pytest.mark.l2
@pytest.mark.slow
def test_e2b_shape_truncation_keeps_results():
    changes = _check_semantics("gemma-4-e2b-shape", DEEP_TOLERANCE)
    truncation = changes["truncate_shared_kv_layers"]
    assert (truncation["first_truncated_layer"], truncation["layers_on_last_token"]) == (14, 20)


@pytest.mark.l2
def test_model_without_kv_sharing_gets_only_the_last_token_gather():
    _, layout, _ = _traced("tiny-llama")
    names = _planned_fx_passes(layout)
    assert names[-1] == "gather_last_token" and "truncate_shared_kv_layers" not in names


@pytest.mark.l1
def test_truncation_that_cannot_act_is_an_error():
    """A layout that declares KV sharing the graph does not have must fail, naming what it saw."""
    _, layout, program = _traced("tiny-llama")
    claimed = type(layout)(**{**layout.__dict__, "kv_layers": layout.kv_layers[:2], "num_kv_shared_layers": 2})
    settings = pass_settings(get_profile("cpu"), claimed)
    with pytest.raises(PassDidNotApply, match=r"layers \[2, 3\] also feed present KV outputs"):
        FX_PASSES["truncate_shared_kv_layers"](program, settings, DECODER)


@pytest.mark.l1
def test_report_says_where_truncation_happened(preset_exports):
    report = preset_exports.get("tiny-gemma-4").package.report
    assert (
        "prefill truncation at layer 6 of 10: 4 layers (6-9, KV-shared) run on the last token only, "
        "saving 4 layer-rows for every prompt token but the last (2044 for a 512-token prompt); "
        "the part of layer 5 that feeds no KV cache runs on it too"
    ) in report.notes
    names = [r["name"] for r in report.fx_passes]
    assert names[-2:] == ["gather_last_token", "truncate_shared_kv_layers"]
