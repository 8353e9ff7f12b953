"""Mixture-of-experts blocks run through transformers' ``batched_mm`` experts implementation while
an export probes and traces the model.

transformers picks the experts kernel with a switch of its own (``set_experts_implementation``).
Its default, ``grouped_mm``, calls ``torch._grouped_mm``, which takes only bfloat16 on the CPU and
on meta tensors, and ``eager`` loops over the experts the router picked, a data-dependent loop
torch.export cannot trace. ``batched_mm`` gathers each routed (token, expert) pair's weights and
multiplies them in one batched product: static control flow that traces, and the form ONNX Runtime's
MoE kernel replaces. The model gets its own implementation back afterwards (a caller's in-memory
model is left as it was).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

TRACEABLE_EXPERTS = "batched_mm"


def has_switchable_experts(model: torch.nn.Module) -> bool:
    can_set = getattr(model, "_can_set_experts_implementation", None)
    return bool(can_set and can_set())


@contextlib.contextmanager
def traceable_experts(model: torch.nn.Module) -> Iterator[None]:
    if not has_switchable_experts(model):
        yield
        return
    original = model.get_experts_implementation()
    model.set_experts_implementation(TRACEABLE_EXPERTS)
    try:
        yield
    finally:
        model.set_experts_implementation(original)
