"""The profiles the exporter targets: one record per ONNX Runtime execution provider.

Facts behind the values: ONNX Runtime 1.32's contrib-op kernels per EP (CUDA's and TensorRT-RTX's
GroupQueryAttention run fp16/bf16 only), ONNX Runtime GenAI 0.18's provider names and graph-capture
options (its model builder writes the same ones), and WebGPU's default maxBufferSize of 256 MiB.
"""

from __future__ import annotations

from ep_profiles.profile import GROUP_QUERY_ATTENTION, WINDOW_BY_MASK, EpProfile

_NORMS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")

CPU = EpProfile(
    name="cpu",
    genai_provider="",
    ort_provider="CPUExecutionProvider",
    precisions=("fp32", "int4"),
    description="ONNX Runtime's default CPU provider",
    attention_op=GROUP_QUERY_ATTENTION,
    norm_fusions=_NORMS,
    past_present_share_buffer=True,
    # ONNX Runtime 1.32's CPU kernel, measured: a KV-shared call without presents gives the same
    # output and skips their zero-fill and copy (exporter/onnx_passes/omit_unread_presents.py).
    omit_unread_presents=True,
    # Measured on ONNX Runtime 1.32's CPU kernel at Gemma 4 E2B's shapes (8 query heads per KV head,
    # heads of 256 and 512): a KV-shared call on one query is faster as MatMul/Softmax reading the
    # KV head once (exporter/onnx_passes/matmul_kv_shared_attention.py).
    matmul_kv_shared_attention=True,
    int4_activations="fp32",
    int4_accuracy_level=4,
    # Verified here; CUDA and DML list the kernel too but were not run. WebGPU (plugin 0.4.0) places
    # FusedMatMul on the CPU.
    transposed_matmul=True,
    # ONNX Runtime 1.32's CPU MoE, measured here: SiLU-gated experts as interleaved fc1 rows match
    # transformers at fp32; at int4 its QMoE takes the experts in 4-bit blocks. Other EPs' kernels
    # were not run, so their experts stay MatMuls.
    mixture_of_experts_precisions=("fp32", "int4"),
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
    precisions=("fp16", "fp32", "int4"),
    description="WebGPU (Dawn: Vulkan, Metal, D3D12), with graph capture",
    attention_op=GROUP_QUERY_ATTENTION,
    norm_fusions=_NORMS,
    # onnxruntime-ep-webgpu 0.4.0's GroupQueryAttention ignores local_window_size for KV-shared
    # calls, and for every call under graph capture (scripts/webgpu_gqa_window_repro.py).
    sliding_window=WINDOW_BY_MASK,
    max_buffer_size=256 * 2**20,
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
