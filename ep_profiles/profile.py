"""The record every EP profile fills in."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# What a profile's attention becomes (``EpProfile.attention_op``).
GROUP_QUERY_ATTENTION = "GroupQueryAttention"
PLAIN_ATTENTION = ""  # transformers' own MatMul/Softmax attention


@dataclass(frozen=True)
class AttentionKernel:
    """What an EP's ``com.microsoft.GroupQueryAttention`` kernel computes, as facts measured by
    ``scripts/probe_attention_kernels.py`` where ``measured`` says so; the defaults assume a kernel
    that honours every attribute (as ONNX Runtime 1.32's CPU kernel does) and nothing past it (no
    fused norms, no quantized cache): a profile whose EP was never run here keeps them. The export plan routes a layer whose semantics the kernel would drop to a form
    that keeps them; a fact here never names a pass.

    window_in_every_call: ``local_window_size`` is honoured in every call ONNX Runtime GenAI makes:
        over its shared past/present buffer, in a KV-shared layer's call (no new K/V) and under
        graph capture. False: sliding layers attend over their window's slots in the graph.
    softcap: the ``softcap`` attribute is honoured. False: soft-capped layers attend in the graph.
    head_sink: the ``head_sink`` input (a per-head logit in the softmax's denominator) is honoured.
    fused_qk_norm: the ``q_norm_weight``/``k_norm_weight`` inputs (per-head RMS norms before the
        rotary, which they need) are honoured, with the epsilon of ``qk_norm_epsilon`` (WebGPU
        reads no ``q_norm_epsilon``/``k_norm_epsilon``). ONNX Runtime's own session optimizer
        folds such norms into the node where the EP takes them, so the exporter writes them as
        norms.
    kv_cache_bit_widths: the quantized KV caches the kernel runs (``kv_cache_bit_width``); empty:
        only a cache in the activation dtype. (The exporter writes none yet.)
    exact_query_rows: the most query rows (tokens per call) for which the kernel's output is
        right on every adapter; None: any number. Where set, every layer attends in the graph
        (prompts are longer than any such limit).
    software_adapter_query_rows: the same limit where it holds on a software adapter only (Mesa's
        lavapipe: a fault that moves with the adapter's subgroup size, not seen on a GPU). The plan
        does not route by it (GPU users would pay for the adapter's fault); ``check`` feeds prompts
        on such an adapter in chunks of this many tokens.
    fills_requested_presents: the kernel writes every present output it is asked for, zero-filled
        as long as the past (``max_length`` slots when the buffer is shared) with each row's real
        tokens copied in, at every step, and it runs without them, reading the past in place.
        ONNX Runtime 1.32's CPU kernel does both (tests/exporter/onnx_passes/test_omit_unread_presents.py).
    reads_kv_head_per_query_head: a call reads each KV head once per query head, not once per
        group of query heads that share it (ONNX Runtime 1.32's CPU kernel, at Gemma 4 E2B's
        shapes: 8 query heads per KV head, heads of 256 and 512; scripts/benchmark.py
        --kv-shared-attention).
    multi_head_attention_rows: the most query rows for which ``com.microsoft.MultiHeadAttention``
        with an attention bias was right on the adapter ``measured`` names (on lavapipe the same
        prefill kernel as GroupQueryAttention's fault; the exporter writes no MultiHeadAttention).
    measured: where, when and on what the facts were measured; empty: not measured (the defaults).
    """

    window_in_every_call: bool = True
    softcap: bool = True
    head_sink: bool = True
    fused_qk_norm: bool = False
    kv_cache_bit_widths: tuple[int, ...] = ()
    exact_query_rows: int | None = None
    software_adapter_query_rows: int | None = None
    multi_head_attention_rows: int | None = None
    fills_requested_presents: bool = False
    reads_kv_head_per_query_head: bool = False
    measured: str = ""


@dataclass(frozen=True)
class EpProfile:
    """What the exporter needs to know about one ONNX Runtime execution provider.

    name: the value of ``--ep``.
    genai_provider: the provider name genai_config.json uses in ``provider_options``; empty for
        the default CPU provider, which genai_config expresses as an empty list.
    ort_provider: the ONNX Runtime provider name a plain InferenceSession uses.
    ort_plugin: the Python package that ships the provider as an ONNX Runtime plugin library
        (registered with ``register_execution_provider_library``); empty when onnxruntime has it built in.
    precisions: precisions the EP runs, the preferred first.
    provider_options: options written under the provider in genai_config.json.
    captured_provider_options: further options written when the graph is captured.
    attention_op: the ONNX Runtime contrib op every layer's attention becomes
        (``GROUP_QUERY_ATTENTION``), or ``PLAIN_ATTENTION`` for transformers' MatMul/Softmax.
    attention_op_precisions: the precisions the EP runs ``attention_op`` at (CUDA's
        GroupQueryAttention has no fp32 kernel); empty: every precision.
    norm_fusions: the norm contrib ops the EP runs: "SimplifiedLayerNormalization" (RMSNorm),
        "SkipSimplifiedLayerNormalization" (residual Add + RMSNorm).
    attention_rotary: whether GroupQueryAttention also applies the rotary embedding (``do_rotary``
        with cos/sin caches) where the model's rotary has transformers' rotate_half form.
    attention_kernel: what the EP's GroupQueryAttention kernel honours (``AttentionKernel``).
    max_buffer_size: the largest single weight the EP can hold, in bytes; None means no limit.
    past_present_share_buffer: whether generation shares one KV buffer between past and present
        (written to genai_config only when every layer's attention is GroupQueryAttention).
    graph_capture_option: the provider option that turns on graph capture (CUDA graphs, WebGPU's
        command recording), empty if the EP has none.
    graph_capture: whether packages for this profile capture the decoder's graph. A captured graph
        must run every node on the EP, with no shape computed on the CPU; the export fails if it
        cannot make the graph so.
    max_length: a cap on genai_config's context_length / max_length, None for the model's own.
    transposed_matmul: whether the EP runs ``com.microsoft.FusedMatMul`` with ``transB`` (a MatMul
        reading its weight transposed): a float linear weight is then read as its checkpoint stores
        it (nothing transposed when the package is written), and a tied LM head reads the
        embedding table itself, kept once instead of twice; int4 packages keep MatMuls for their
        quantizer. False stores transposed copies.
    mixture_of_experts_precisions: the precisions at which routed-experts blocks with SwiGLU-gated
        experts become ONNX Runtime's ``com.microsoft.MoE``; empty: never (they stay MatMuls over
        weights gathered per routed token).
    int4_activations: the precision an int4 package (4-bit weights) computes in: "fp16" on GPUs,
        "fp32" where the EP's 4-bit kernels take fp32 activations best (CPU).
    int4_accuracy_level: MatMulNBits' default accuracy level (4: int8 compute, ONNX Runtime's fast
        CPU path; 0: the activation dtype).
    weight_bit_widths: the bit widths at which the EP's ``MatMulNBits`` and ``GatherBlockQuantized``
        were measured exact, with and without zero points, at fp32 and fp16 activations
        (``scripts/probe_quantized_kernels.py``). ``int8`` packages and the 8-bit weights of an
        int4 package need 8; a profile whose EP was not run keeps 4, which every EP has shipped.
    weight_float_zero_points: the EP's 4-bit ``MatMulNBits`` was measured exact with zero points of
        the activation dtype (not packed integers), the form HQQ's fitted zero points take
        (``--int4-method hqq``); False where it was not run, or placed the node elsewhere.
    """

    name: str
    genai_provider: str
    ort_provider: str
    precisions: tuple[str, ...]
    description: str
    ort_plugin: str = ""
    provider_options: dict[str, str] = field(default_factory=dict)
    captured_provider_options: dict[str, str] = field(default_factory=dict)
    attention_op: str = PLAIN_ATTENTION
    attention_op_precisions: tuple[str, ...] = ()
    norm_fusions: tuple[str, ...] = ()
    attention_rotary: bool = True
    attention_kernel: AttentionKernel = AttentionKernel()
    max_buffer_size: int | None = None
    past_present_share_buffer: bool = False
    graph_capture_option: str = ""
    graph_capture: bool = False
    max_length: int | None = None
    transposed_matmul: bool = False
    mixture_of_experts_precisions: tuple[str, ...] = ()
    int4_activations: str = "fp16"
    int4_accuracy_level: int = 0
    weight_bit_widths: tuple[int, ...] = (4,)
    weight_float_zero_points: bool = False

    def __post_init__(self):
        if self.graph_capture and not self.graph_capture_option:
            raise ValueError(f"profile {self.name}: graph_capture needs a graph_capture_option")
        if "int8" in self.precisions and 8 not in self.weight_bit_widths:
            raise ValueError(f"profile {self.name}: precision int8 needs 8 in weight_bit_widths")

    def capped_context(self, model_context: int) -> int:
        """The positions a package allocates and generates to: the model's own, capped by
        ``max_length`` (genai_config's context_length and search.max_length)."""
        return model_context if self.max_length is None else min(model_context, self.max_length)

    @property
    def default_precision(self) -> str:
        return self.precisions[0]

    def runs_attention_op_at(self, precision: str) -> bool:
        """Whether the EP runs ``attention_op`` at ``precision``."""
        return self.attention_op != PLAIN_ATTENTION and (
            not self.attention_op_precisions or precision in self.attention_op_precisions
        )

    def genai_provider_options(self, graph_capture: bool | None = None) -> dict[str, str]:
        """The provider's options for genai_config.json, graph capture included (the profile's
        own setting unless ``graph_capture`` says otherwise)."""
        options = dict(self.provider_options)
        if self.graph_capture_option:
            capture = self.graph_capture if graph_capture is None else graph_capture and self.graph_capture
            options[self.graph_capture_option] = "1" if capture else "0"
            if capture:
                options.update(self.captured_provider_options)
        return options

    def with_plain_attention(self) -> EpProfile:
        """This profile without its attention op: transformers' MatMul/Softmax attention, with
        separate past and present KV buffers (for EPs without the op, and for comparisons)."""
        return dataclasses.replace(
            self,
            name=f"{self.name}-plain-attention",
            attention_op=PLAIN_ATTENTION,
            past_present_share_buffer=False,
            graph_capture=False,
        )
