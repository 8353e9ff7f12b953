"""The record every EP profile fills in."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EpProfile:
    """What the exporter needs to know about one ONNX Runtime execution provider.

    name: the value of ``--ep``.
    genai_provider: the provider name genai_config.json uses in ``provider_options``; empty for
        the default CPU provider, which genai_config expresses as an empty list.
    ort_provider: the ONNX Runtime provider name a plain InferenceSession uses.
    precisions: precisions a package for this EP can be exported at; the first is the default.
    provider_options: options written under the provider in genai_config.json.
    fx_passes: names of FX passes (see ``fx_passes.registry``) to run, in order.
    fused_ops: ONNX Runtime contrib ops the graph is fused into: "GroupQueryAttention" replaces
        every layer's attention (an FX pass); the norms are ONNX fusions (``exporter.onnx_fusions``).
        A profile without "GroupQueryAttention" keeps the plain MatMul/Softmax attention.
    attention_rotary: whether GroupQueryAttention also applies the rotary embedding (``do_rotary``
        with cos/sin caches) where the model's rotary has transformers' rotate_half form.
    max_buffer_size: the largest single weight the EP can hold, in bytes; None means no limit.
    past_present_share_buffer: whether generation shares one KV buffer between past and present
        (written to genai_config only when every layer's attention is GroupQueryAttention).
    """

    name: str
    genai_provider: str
    ort_provider: str
    precisions: tuple[str, ...]
    description: str
    provider_options: dict[str, str] = field(default_factory=dict)
    fx_passes: tuple[str, ...] = ()
    fused_ops: tuple[str, ...] = ()
    attention_rotary: bool = True
    max_buffer_size: int | None = None
    past_present_share_buffer: bool = False

    @property
    def default_precision(self) -> str:
        return self.precisions[0]

    def with_plain_attention(self) -> EpProfile:
        """This profile without GroupQueryAttention: transformers' MatMul/Softmax attention, with
        separate past and present KV buffers (for EPs without the op, and for comparisons)."""
        return dataclasses.replace(
            self,
            name=f"{self.name}-plain-attention",
            fused_ops=tuple(op for op in self.fused_ops if op != "GroupQueryAttention"),
            past_present_share_buffer=False,
        )
