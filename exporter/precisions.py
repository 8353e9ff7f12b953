"""The precision policy, in one place: what each ``--precision`` computes in, how many bytes a
stored weight takes, and how far its packages may differ from the CPU and from transformers.

``fp32``, ``fp16`` and ``bf16`` trace the model in that dtype (the graph computes what transformers
computes in it). ``int4`` stores 4-bit weights and computes in the profile's ``int4_activations``
(fp16 on GPUs, fp32 on the CPU, whose 4-bit kernels take fp32 best).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ep_profiles import EpProfile
from exporter.errors import ExporterError
from exporter.int4_options import Int4Options

if TYPE_CHECKING:
    import torch


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
# and 0.402 from its own CPU run over a 528-token prompt, with the same tokens: WebGPU's fp16
# MatMul sums in fp16, an error that grows with the logits, so fp16's bound is 3% of the step's
# largest |logit| where that is more than 0.25 (0.9 there; 0.25 on the tiny models).
# source_*: fp32 differs from PyTorch by kernels and summation order (~1e-5 on the suite's
# models); fp16 on a trained tiny Gemma 4 by 4.7e-3, on the real Gemma 3 270M by up to 0.26; bf16 keeps 3 fewer
# mantissa bits than fp16; int4's weights themselves differ (trained tiny Gemma 4: 0.54 at logit
# std 1.5).
PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", "float32", 4, ep_near_tie=1e-3, ep_logits=1e-3, source_logits=1e-3, source_near_tie=1e-3),
        Precision("fp16", "float16", 2, ep_near_tie=0.25, ep_logits=0.25, source_logits=0.25, source_near_tie=0.25,
                  relative_logits=0.03),
        Precision("bf16", "bfloat16", 2, ep_near_tie=0.5, ep_logits=1.0, source_logits=1.0, source_near_tie=0.5),
        Precision("int4", None, 0.5625, ep_near_tie=0.5, ep_logits=3.0, source_logits=3.0, source_near_tie=1.0),
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
    """The int4 settings of an export: ``given``, or the defaults with the profile's accuracy level;
    None for other precisions (where options given are an error)."""
    if precision != "int4":
        if given is not None:
            raise ExporterError(f"int4 options apply to --precision int4, not {precision}")
        return None
    return given or Int4Options(accuracy_level=profile.int4_accuracy_level)
