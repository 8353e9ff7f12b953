"""The precision policy, in one place: what each ``--precision`` computes in, how many bytes a
stored weight takes, and how far its packages may differ from the CPU and from transformers.

``fp32``, ``fp16`` and ``bf16`` trace the model in that dtype (the graph computes what transformers
computes in it). ``int4`` stores 4-bit weights (some 8-bit where ``Int4Options.eight_bit`` says)
and ``int8`` 8-bit weights, both computing in the profile's ``int4_activations`` (fp16 on GPUs,
fp32 on the CPU, whose block-quantized kernels take fp32 best).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ep_profiles import EpProfile
from exporter.errors import ExporterError
from exporter.int4_options import Int4Options

if TYPE_CHECKING:
    import torch

    from exporter.verify.distribution import DistributionTotals


@dataclass(frozen=True)
class DistributionBounds:
    """What a quantized package must keep of transformers' distribution (``check --against``):
    mean KL at most ``mean_kl``, top-1 agreement (near ties counted as agreeing) at least
    ``top1``, perplexity at most ``perplexity_ratio`` times transformers'."""

    mean_kl: float
    top1: float
    perplexity_ratio: float

    def failures(self, totals: DistributionTotals) -> list[str]:
        found = []
        if not totals.mean_kl <= self.mean_kl:
            found.append(f"mean KL {totals.mean_kl:.3g} > {self.mean_kl}")
        if not totals.top1_near_tie_share >= self.top1:
            found.append(f"top-1 agreement {totals.top1_near_tie_share:.1%} < {self.top1:.0%}")
        if totals.scored and not totals.perplexity_ratio <= self.perplexity_ratio:
            found.append(f"perplexity {totals.perplexity_ratio:.3g}x transformers' > {self.perplexity_ratio}x")
        return found


@dataclass(frozen=True)
class Precision:
    name: str
    # What the graph computes in, as torch names it (a name, so that the command line reads this
    # policy without importing torch); None: the profile's int4_activations.
    dtype_name: str | None
    weight_bytes: float  # bytes per stored weight element (int4: 4 bits + an fp16 scale per 32)
    # How far below the CPU's best logit an EP's token may be where the two generations part
    # (``check``): EPs sum in other orders, so a near tie may go either way.
    ep_near_tie: float
    # ``check``: max |EP logit - CPU logit| of one package while the two generations agree.
    ep_logits: float
    # ``check --against``: max |package logit - transformers fp32 logit| at any step, and how far
    # below transformers' best the package's token may be.
    source_logits: float
    source_near_tie: float
    # Both logit bounds grow with the logits' size: at least this share of the step's largest
    # |logit| (fp16 on WebGPU, whose MatMul sums in fp16: 1.05 off at K=2048 for sums of ~125,
    # against 0.031 on the CPU EP, measured on lavapipe).
    relative_logits: float = 0.0
    # Bits of a block-quantized weight (MatMulNBits, GatherBlockQuantized); None: float weights.
    weight_bits: int | None = None
    # ``check --against`` of a quantized package: bounds on its distribution against transformers
    # (``exporter.verify.distribution``) in place of the per-step logit and token rules.
    distribution: DistributionBounds | None = None

    def logit_bound(self, absolute: float, reference: np.ndarray) -> float:
        """``absolute`` (``ep_logits`` or ``source_logits``), or ``relative_logits`` of the largest
        |logit| of ``reference`` where that is more."""
        return max(absolute, self.relative_logits * float(np.abs(reference).max()))

    def compute_dtype(self, profile: EpProfile) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name or PRECISIONS[profile.int4_activations].dtype_name)


# ep_near_tie: fp32 kernels agree to ~1e-5; fp16 logits round at ~0.015 near Gemma's soft cap of
# 30 and differences add up over layers (a random tiny Gemma 4 in fp16: 0.17 between CPU and
# WebGPU); int4 kernels differ by ~0.05 per MatMul.
# ep_logits: kernels alone, as for source_logits (the same package on both EPs; measured on
# lavapipe: fp32 <= 3e-6 on the tiny families once every layer's attention is exact, 7e-5 on the
# real Gemma 3 270M). fp16 logits of a real model are ~30 wide: the real Gemma 3 270M's webgpu
# fp16 package is 0.080 from transformers fp32 on the CPU EP, up to 0.741 on WebGPU (lavapipe),
# and 0.402 from its own CPU run over a 528-token prompt, with the same tokens (2026-12-06); the
# same package bytes gave 0.418 on another host's lavapipe (2026-12-07, twice): WebGPU's fp16
# MatMul sums in fp16, an error that grows with the logits and moves with the host's vector
# width, so fp16's bound is 3.5% of the step's largest |logit| where that is more than 0.25 (0.47
# there; 0.25 on the tiny models). A dropped softcap or window is 2.0 or more off.
# source_*: fp32 differs from PyTorch by kernels and summation order (~1e-5 on the suite's
# models); fp16 on a trained tiny Gemma 4 by 4.7e-3, on the real Gemma 3 270M by up to 0.26; bf16 keeps 3 fewer
# mantissa bits than fp16; int4's weights themselves differ (trained tiny Gemma 4: 0.54 at logit
# std 1.5).
# distribution (check --against of quantized packages, on Pride and Prejudice's opening and the
# generations' steps; 2026-12-07): the real Gemma 3 270M's default int4 package: mean KL 0.317,
# top-1 89.2% (near ties within 1.0 agreeing), perplexity 1.48x; with the 8-bit head and sensitive
# layers 0.183, 93.8%, 1.27x; its former default (symmetric) 0.417, 82.7%, 1.64x; broken the ways
# an exporter breaks (every MatMulNBits' scales one block off; the embedding scale dropped)
# 10.9-11.1, 2-4%, >5e4x. Qwen2.5-Coder 0.5B: default 0.083, 98.9%, 1.07x; 8-bit roles 0.051,
# 99.3%, 1.06x; former default 0.124, 95.3%, 1.10x; broken (scales; transposed attention output
# projections) 7.8-12.5, 3-8%, >2e3x. The int4 bounds sit between a lossy-but-right package
# and a broken one, with a wide margin on each side; int8 (0.003 and 0.0008; 99.8% and 100%;
# 1.005x and 1.004x) has its own.
PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", "float32", 4, ep_near_tie=1e-3, ep_logits=1e-3, source_logits=1e-3, source_near_tie=1e-3),
        Precision("fp16", "float16", 2, ep_near_tie=0.25, ep_logits=0.25, source_logits=0.25, source_near_tie=0.25,
                  relative_logits=0.035),
        Precision("bf16", "bfloat16", 2, ep_near_tie=0.5, ep_logits=1.0, source_logits=1.0, source_near_tie=0.5),
        Precision("int4", None, 0.5625, ep_near_tie=0.5, ep_logits=3.0, source_logits=3.0, source_near_tie=1.0,
                  weight_bits=4, distribution=DistributionBounds(mean_kl=1.0, top1=0.6, perplexity_ratio=2.0)),
        Precision("int8", None, 1.0625, ep_near_tie=0.5, ep_logits=1.0, source_logits=1.0, source_near_tie=0.5,
                  weight_bits=8, distribution=DistributionBounds(mean_kl=0.02, top1=0.9, perplexity_ratio=1.02)),
    )
}


def choose_precision(profile: EpProfile, asked: str | None) -> str:
    """``asked``, checked against what the profile's EP runs; without one, the EP's preferred."""
    if asked is None:
        return profile.default_precision
    if asked not in profile.precisions:
        what = f"EP '{profile.name}' does not run precision '{asked}'" if asked in PRECISIONS else f"unknown precision '{asked}'"
        raise ExporterError(f"{what}; use one of: " + ", ".join(profile.precisions))
    return asked


def int4_options(profile: EpProfile, precision: str, given: Int4Options | None) -> Int4Options | None:
    """The block-quantization settings of an export: at int4 ``given``, or the defaults with the
    profile's accuracy level; at int8 the defaults (8 bits everywhere, symmetric round-to-nearest,
    the profile's accuracy level); None for float precisions. Options given for another precision
    than int4 are an error."""
    if precision != "int4" and given is not None:
        raise ExporterError(f"int4 options apply to --precision int4, not {precision}")
    if PRECISIONS[precision].weight_bits is None:
        return None
    options = given or Int4Options()
    if options.accuracy_level is None:
        options = dataclasses.replace(options, accuracy_level=profile.int4_accuracy_level)
    if options.eight_bit and 8 not in profile.weight_bit_widths:
        raise ExporterError(f"EP '{profile.name}' was not measured running 8-bit weights; store every weight in "
                            f"4 bits (--int4-8bit none)")
    if options.method == "hqq" and not profile.weight_float_zero_points:
        raise ExporterError(f"EP '{profile.name}' was not measured running MatMulNBits with float zero points, "
                            f"which HQQ's blocks need; use --int4-method rtn or k_quant")
    return options
