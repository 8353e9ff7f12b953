"""L2: the routed-experts substitution computes what the traced blocks did (the packages' L3 and L4
are the family tests, and the fused-vs-plain test in tests/exporter/test_more_architectures.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ep_profiles import get_profile
from exporter.int4_options import Int4Options
from exporter.load.layout import derive_layout
from exporter.load.presets import build_preset
from exporter.trace.decoder import make_inputs, trace
from fx_passes.base import run_fx_passes
from fx_passes.registry import FX_PASSES
from tests.helpers.families import FUSED_MIXTURE_OF_EXPERTS_FAMILIES
from tests.helpers.plan_settings import DECODER, pass_settings

MOE = torch.ops.genai_exporter.mixture_of_experts.default


def _substituted(name: str, dtype: torch.dtype = torch.float32, ep: str = "cpu", precision: str = "fp32",
                 int4: Int4Options | None = None, **config):
    model, _ = build_preset(name)
    model = model.to(dtype)
    for key, value in config.items():  # read by the modules at run time (gpt-oss's experts' limit)
        setattr(model.config, key, value)
        for module in model.modules():
            if hasattr(module, key.removeprefix("swiglu_")):
                setattr(module, key.removeprefix("swiglu_"), value)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # biases and sinks far from their init zeros, so a dropped one shows
        for parameter_name, parameter in model.named_parameters():
            if parameter_name.endswith(("bias", "sinks")):
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.5)
    layout = derive_layout(model)
    program, _ = trace(model, layout)
    generator = torch.Generator().manual_seed(0)
    cases = [make_inputs(layout, 1, 7, 0, generator=generator, dtype=dtype),
             make_inputs(layout, 2, 1, 5, generator=generator, dtype=dtype),
             make_inputs(layout, 2, 6, 0, generator=generator, dtype=dtype, right_padding=(0, 2))]
    with torch.no_grad():
        before = [program.module()(*inputs) for inputs in cases]
    settings = dataclasses.replace(pass_settings(get_profile(ep), layout, precision), int4=int4)
    passes = [FX_PASSES[n] for n in ("drop_runtime_asserts", "drop_noop_casts", "substitute_mixture_of_experts")]
    program, records = run_fx_passes(program, passes, settings, DECODER)
    return layout, program, cases, before, records[-1].changes


@pytest.mark.l2
@pytest.mark.parametrize("name", [*sorted(FUSED_MIXTURE_OF_EXPERTS_FAMILIES), "tiny-gpt-oss"])
def test_substitution_keeps_results(name):
    layout, program, cases, before, changes = _substituted(name)
    fused = [n for n in program.graph.nodes if n.target is MOE]
    assert len(fused) == layout.experts_modules == len(changes["substituted_layers"]) > 0
    assert changes["plain_blocks"] == {}
    # No expert's weights are gathered per token any more.
    assert not any(n.target is torch.ops.aten.index.Tensor and "experts" in str(n.args[0]) for n in program.graph.nodes)
    # The op takes [batch, seq, hidden] where the block flattened it: no reshape back reads the
    # batch and sequence sizes (shape work a captured graph cannot have).
    views = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)
    for node in fused:
        assert node.args[0].meta["val"].dim() == 3 and not any(user.target in views for user in node.users)
    with torch.no_grad():
        for inputs, want in zip(cases, before, strict=True):
            for got, expected in zip(program.module()(*inputs), want, strict=True):
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.l2
@pytest.mark.parametrize("name", [*sorted(FUSED_MIXTURE_OF_EXPERTS_FAMILIES), "tiny-gpt-oss"])
def test_blocks_traced_in_fp16_are_substituted_with_router_logits_of_the_op_dtype(name):
    """webgpu runs QMoE at int4, whose activations are fp16: the random-weight check holds an fp16
    block to fp16's rounding, and a router whose softmax runs in float32 (Mixtral's) gives the op
    logits of the input's dtype (ONNX Runtime's MoE types both alike)."""
    layout, program, cases, before, changes = _substituted(name, torch.float16, "webgpu", "int4")
    fused = [n for n in program.graph.nodes if n.target is MOE]
    assert len(fused) == layout.experts_modules == len(changes["substituted_layers"]) > 0
    for node in fused:
        assert node.args[0].meta["val"].dtype == node.args[1].meta["val"].dtype == torch.float16
    with torch.no_grad():
        for inputs, want in zip(cases, before, strict=True):
            got, expected = program.module()(*inputs)[0].float(), want[0].float()  # the logits
            assert torch.isfinite(got).all() and torch.isfinite(expected).all()
            # fp16 through another summation order: ~1e-3 of the logits' scale; a wrong routing is ~1e-1
            assert (got - expected).abs().max() <= 1e-2 * max(1.0, float(expected.abs().max()))


@pytest.mark.l2
def test_webgpu_keeps_experts_traced_where_qmoe_cannot_take_their_widths():
    """webgpu runs QMoE but places float MoE on the CPU: a block whose widths (hidden 64) the int4
    block size (128) does not divide would stay float MoE, so it stays traced instead, with why."""
    layout, program, cases, before, changes = _substituted("tiny-qwen3-moe", torch.float16, "webgpu", "int4",
                                                           Int4Options(block_size=128))
    assert changes["substituted_layers"] == [] and len(changes["plain_blocks"]) == layout.experts_modules
    assert all("int4 block size 128 does not divide" in why and "webgpu runs no float MoE" in why
               for why in changes["plain_blocks"].values())
    assert not any(n.target is MOE for n in program.graph.nodes)


@pytest.mark.l2
def test_gemma4_experts_stay_plain_and_say_why():
    """Gemma 4's router scales each expert's weight (per_expert_scale) and its experts are
    GELU-gated: not what the MoE op computes, so the blocks stay as traced."""
    layout, program, cases, before, changes = _substituted("tiny-gemma-4-moe")
    assert changes["substituted_layers"] == [] and len(changes["plain_blocks"]) == layout.experts_modules == 4
    assert all("SwiGLU-gated" in why for why in changes["plain_blocks"].values())
    assert not any(n.target is MOE for n in program.graph.nodes)


@pytest.mark.l2
def test_gpt_oss_experts_carry_biases_and_the_clamped_swiglu():
    """gpt-oss's experts: weights stored [experts, in, out] (transposed for the op), gate and up rows
    interleaved, biases on both projections, ``gate * sigmoid(1.702 * gate) * (up + 1)`` with both
    clamped to ``swiglu_limit``, routed by the softmax of the logits' top k (renormalised)."""
    config = build_preset("tiny-gpt-oss")[0].config
    _, program, *_ = _substituted("tiny-gpt-oss")
    for node in (n for n in program.graph.nodes if n.target is MOE):
        hidden, logits, gate_up, down, k, normalize, gate_up_bias, down_bias, interleaved, alpha, beta, limit = node.args
        assert gate_up.target is torch.ops.aten.transpose.int and down.target is torch.ops.aten.transpose.int
        assert gate_up_bias.name.endswith("gate_up_proj_bias") and down_bias.name.endswith("down_proj_bias")
        assert (k, normalize, interleaved) == (config.num_experts_per_tok, True, True)
        assert (alpha, beta, limit) == (pytest.approx(config.swiglu_alpha if hasattr(config, "swiglu_alpha") else 1.702),
                                        1.0, config.swiglu_limit)


@pytest.mark.l2
def test_a_clamp_the_op_cannot_compute_keeps_the_block_traced(monkeypatch):
    """gpt-oss's gating with its real limit (7) but only the up half clamped: ONNX Runtime's MoE
    clamps the gate too, so the blocks stay as traced (and compute what they did)."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    def up_clamped_only(self, gate_up):
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        return (up.clamp(min=-self.limit, max=self.limit) + 1) * gate * torch.sigmoid(gate * self.alpha)

    monkeypatch.setattr(modeling_gpt_oss.GptOssExperts, "_apply_gate", up_clamped_only)
    layout, program, cases, before, changes = _substituted("tiny-gpt-oss", swiglu_limit=7.0)
    assert changes["substituted_layers"] == [] and len(changes["plain_blocks"]) == layout.experts_modules == 4
    assert not any(n.target is MOE for n in program.graph.nodes)
    with torch.no_grad():
        for inputs, want in zip(cases, before, strict=True):
            for got, expected in zip(program.module()(*inputs), want, strict=True):
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
