"""The profiles the exporter targets: one record per ONNX Runtime execution provider.

Facts behind the values: ONNX Runtime 1.32's contrib-op kernels per EP (CUDA's and TensorRT-RTX's
GroupQueryAttention run fp16/bf16 only), ONNX Runtime GenAI 0.18's provider names and graph-capture
options (its model builder writes the same ones), and WebGPU's default maxBufferSize of 256 MiB.
"""

from __future__ import annotations

from ep_profiles.profile import GROUP_QUERY_ATTENTION, AttentionKernel, EpProfile

_NORMS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")

# scripts/probe_attention_kernels.py --ep cpu, 2026-12-06: window in every layout, softcap and
# head_sink exact (<= 5e-7 at fp32); q/k norm weights refused ("implemented only on the CUDA and
# WebGPU EPs"); an 8-bit per-tensor KV cache runs.
_CPU_ATTENTION = AttentionKernel(
    kv_cache_bit_widths=(8,),
    # Measured: a KV-shared call without presents gives the same output and skips their zero-fill
    # and copy (the pass exporter/onnx_passes/omit_unread_presents.py acts on it).
    fills_requested_presents=True,
    # Measured at Gemma 4 E2B's shapes: a KV-shared call on one query is faster as MatMul/Softmax
    # reading each KV head once (exporter/onnx_passes/matmul_kv_shared_attention.py acts on it).
    reads_kv_head_per_query_head=True,
    measured="ONNX Runtime 1.32 CPU EP, 2026-12-06",
)

# scripts/probe_attention_kernels.py --ep webgpu, 2026-12-06 (table in docs/measurements.md): the
# window is ignored in a KV-shared call and under graph capture (2.7 off, exact without it);
# softcap is ignored (2.0 off); head_sink and q/k norm weights (with do_rotary, epsilon from
# qk_norm_epsilon) are exact; an 8-bit KV cache fails at run time, a 4-bit one is refused.
# GroupQueryAttention and MultiHeadAttention are exact up to 31 query rows and 0.1-0.5 off from 32,
# where ONNX Runtime's WebGPU kernel switches from its decode kernels to one prefill kernel built
# on subgroup shuffles; the error moves with lavapipe's subgroup size (0.50, 0.23, 0.12 at 4, 8,
# 16 lanes: LP_NATIVE_VECTOR_WIDTH 128, 256, 512), so it is taken as the software adapter's fault,
# not routed around for GPUs (which were not at hand to measure).
_WEBGPU_ATTENTION = AttentionKernel(
    window_in_every_call=False,
    softcap=False,
    fused_qk_norm=True,
    software_adapter_query_rows=31,
    multi_head_attention_rows=31,
    measured="onnxruntime-ep-webgpu 0.4.0 on ONNX Runtime 1.32, Mesa lavapipe (software Vulkan), 2026-12-06",
)

# MatMulNBits (1 and 40 rows) and GatherBlockQuantized at 4 and 8 bits, with and without zero
# points, fp32 and fp16: exact on ONNX Runtime 1.32's CPU EP and on onnxruntime-ep-webgpu 0.4.0
# over Mesa lavapipe, 2026-12-07 (scripts/probe_quantized_kernels.py). CUDA, DML and TensorRT-RTX
# list 8-bit kernels too but were not run.
_MEASURED_BIT_WIDTHS = (4, 8)

CPU = EpProfile(
    name="cpu",
    genai_provider="",
    ort_provider="CPUExecutionProvider",
    precisions=("fp32", "int4", "int8"),
    description="ONNX Runtime's default CPU provider",
    attention_op=GROUP_QUERY_ATTENTION,
    norm_fusions=_NORMS,
    past_present_share_buffer=True,
    attention_kernel=_CPU_ATTENTION,
    int4_activations="fp32",
    int4_accuracy_level=4,
    weight_bit_widths=_MEASURED_BIT_WIDTHS,
    # 4-bit MatMulNBits with float zero points (of the activation dtype): exact, on a slow kernel
    # (ONNX Runtime 1.32 refuses them at 8 bits); onnxruntime-ep-webgpu 0.4.0 places such a node on
    # the CPU, so WEBGPU keeps False. 2026-12-07 (scripts/probe_quantized_kernels.py).
    weight_float_zero_points=True,
    # Verified here; CUDA and DML list the kernel too but were not run. WebGPU (plugin 0.4.0) places
    # FusedMatMul on the CPU.
    transposed_matmul=True,
    # ONNX Runtime 1.32's CPU MoE, measured here: SwiGLU-gated experts (SiLU, and gpt-oss's clamped
    # form with biases) as interleaved fc1 rows match transformers at fp32; at int4 its QMoE takes the experts in 4-bit blocks. Other EPs' kernels
    # were not run, so their experts stay MatMuls.
    # int8 keeps the experts float in MoE (QMoE is taken at 4 bits only), counted in the report.
    mixture_of_experts_precisions=("fp32", "int4", "int8"),
)

CUDA = EpProfile(
    name="cuda",
    genai_provider="cuda",
    ort_provider="CUDAExecutionProvider",
    precisions=("fp16", "bf16", "fp32", "int4"),
    description="NVIDIA GPUs through CUDA",
    attention_op=GROUP_QUERY_ATTENTION,
    attention_op_precisions=("fp16", "bf16", "int4"),
    norm_fusions=_NORMS,
    past_present_share_buffer=True,
    graph_capture_option="enable_cuda_graph",
)

DML = EpProfile(
    name="dml",
    genai_provider="dml",
    ort_provider="DmlExecutionProvider",
    precisions=("fp16", "fp32", "int4"),
    description="DirectML on Windows GPUs",
    attention_op=GROUP_QUERY_ATTENTION,
    norm_fusions=_NORMS,
    past_present_share_buffer=True,
    graph_capture_option="enable_graph_capture",
)

WEBGPU = EpProfile(
    name="webgpu",
    genai_provider="webgpu",
    ort_provider="WebGpuExecutionProvider",
    ort_plugin="onnxruntime_ep_webgpu",
    precisions=("fp16", "fp32", "int4", "int8"),
    description="WebGPU (Dawn: Vulkan, Metal, D3D12), with graph capture",
    attention_op=GROUP_QUERY_ATTENTION,
    norm_fusions=_NORMS,
    attention_kernel=_WEBGPU_ATTENTION,
    max_buffer_size=256 * 2**20,
    weight_bit_widths=_MEASURED_BIT_WIDTHS,
    past_present_share_buffer=True,
    graph_capture_option="enableGraphCapture",
    graph_capture=True,
    # Dawn's validation of every WebGPU call, a CPU cost per dispatch, off for captured graphs as
    # ONNX Runtime GenAI's model builder (and mobius) write it. Measured on lavapipe, tiny-gemma-4:
    # no change on an idle machine (0.98x), 1.63x decode while the CPU was busy with other work.
    captured_provider_options={"validationMode": "disabled"},
    # Under graph capture GenAI allocates the KV buffer for max_length slots up front: Gemma 4
    # E2B's own 131072 positions would be 2304 MiB of fp16 KV (72 MiB at 4096). The sliding
    # layers read only their window of it, but the full layers attend over every real token. 4096
    # is a usual on-device chat context; --max-length sets another.
    max_length=4096,
    # onnxruntime-ep-webgpu 0.4.0 on lavapipe: QMoE (4-bit experts, SwiGLU, gpt-oss's clamped form
    # with biases) runs on the EP, tiny-gpt-oss's logits within 0.0009 of the CPU EP's; MoE (float
    # experts) is placed on the CPU, so fp16 and fp32 keep the experts traced. 2026-12-07.
    mixture_of_experts_precisions=("int4",),
)

TRT_RTX = EpProfile(
    name="trt-rtx",
    genai_provider="NvTensorRtRtx",
    ort_provider="NvTensorRTRTXExecutionProvider",
    precisions=("fp16", "bf16", "fp32", "int4"),
    description="NVIDIA RTX GPUs through TensorRT-RTX",
    attention_op=GROUP_QUERY_ATTENTION,
    attention_op_precisions=("fp16", "bf16", "int4"),
    norm_fusions=_NORMS,
    past_present_share_buffer=True,
    graph_capture_option="enable_cuda_graph",
)

PROFILES: dict[str, EpProfile] = {p.name: p for p in (CPU, CUDA, DML, WEBGPU, TRT_RTX)}


class UnknownProfileError(ValueError):
    pass


def get_profile(name: str) -> EpProfile:
    if name in PROFILES:
        return PROFILES[name]
    raise UnknownProfileError(f"unknown EP '{name}'; use one of: {', '.join(PROFILES)}")
