"""Open ONNX Runtime and ONNX Runtime GenAI sessions on a profile's EP, where it is installed.

Some EPs ship as plugin packages (WebGPU: ``onnxruntime-ep-webgpu``), registered with both
runtimes by library path before use. ONNX Runtime falls back to the CPU without a word when an
EP cannot take a node, so sessions here record the placement and callers read it.
"""

from __future__ import annotations

import importlib
import os
from collections import Counter
from pathlib import Path

import numpy as np

from ep_profiles import EpProfile

# Lets the WebGPU EP use a software adapter (Mesa's lavapipe) where no GPU is present.
_SOFTWARE_ADAPTER = "ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER"
_registered: set[tuple[str, str]] = set()  # (runtime, provider)


class EpUnavailable(RuntimeError):
    pass


def _plugin_library(profile: EpProfile) -> str:
    try:
        module = importlib.import_module(profile.ort_plugin)
    except ImportError as error:
        raise EpUnavailable(
            f"{profile.ort_provider} needs the Python package '{profile.ort_plugin.replace('_', '-')}'"
        ) from error
    return module.get_library_path()


def register(profile: EpProfile, genai: bool = False) -> None:
    """Make the profile's EP available to ONNX Runtime (and to ONNX Runtime GenAI); raises
    EpUnavailable if this machine's onnxruntime cannot offer it."""
    if not profile.ort_plugin:
        import onnxruntime as ort

        if profile.ort_provider not in ort.get_available_providers():
            raise EpUnavailable(f"{profile.ort_provider} is not available in this onnxruntime build")
        return
    os.environ.setdefault(_SOFTWARE_ADAPTER, "1")
    library = _plugin_library(profile)
    import onnxruntime as ort

    if ("ort", profile.ort_provider) not in _registered:
        ort.register_execution_provider_library(profile.genai_provider, library)
        _registered.add(("ort", profile.ort_provider))
    if genai and ("genai", profile.ort_provider) not in _registered:
        import onnxruntime_genai as og

        og.register_execution_provider_library(profile.ort_provider, library)
        _registered.add(("genai", profile.ort_provider))


def software_adapter(profile: EpProfile) -> bool:
    """Whether the profile's EP runs on a software adapter here (WebGPU on Mesa's lavapipe: ONNX
    Runtime lists its device as a CPU); False for EPs built into onnxruntime."""
    if not profile.ort_plugin:
        return False
    import onnxruntime as ort

    register(profile)
    devices = [d for d in ort.get_ep_devices() if d.ep_name == profile.ort_provider]
    return bool(devices) and devices[0].device.type == ort.OrtHardwareDeviceType.CPU


def prompt_chunk(profile: EpProfile) -> int | None:
    """The most tokens to append at once on this machine's adapter for the profile's EP: the
    kernel's ``software_adapter_query_rows`` where the EP runs on a software adapter, else None
    (the whole prompt)."""
    chunk = profile.attention_kernel.software_adapter_query_rows
    return chunk if chunk and software_adapter(profile) else None


def inference_session(model_path: Path, profile: EpProfile, provider_options: dict[str, str]):
    """An ONNX Runtime session on the profile's EP that records where each node runs; raises
    EpUnavailable if this onnxruntime cannot offer the EP."""
    import onnxruntime as ort

    register(profile)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    if profile.ort_plugin:
        devices = [d for d in ort.get_ep_devices() if d.ep_name == profile.ort_provider]
        if not devices:
            raise EpUnavailable(f"{profile.ort_provider} found no device (for a software adapter set {_SOFTWARE_ADAPTER}=1)")
        options.add_provider_for_devices(devices[:1], provider_options)
        return ort.InferenceSession(str(model_path), sess_options=options)
    return ort.InferenceSession(
        str(model_path), sess_options=options, providers=[(profile.ort_provider, provider_options)]
    )


def float32_outputs(session, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One run of ``session``, each output copied to the CPU as fp32. onnxruntime gives no numpy array
    for a bf16 output, so its bits are read off the tensor's memory and widened (exactly: bf16 is
    fp32's upper half)."""
    import ctypes

    binding = session.io_binding()
    for name, value in feed.items():
        binding.bind_cpu_input(name, value)
    names = [output.name for output in session.get_outputs()]
    for name in names:
        binding.bind_output(name, "cpu")
    session.run_with_iobinding(binding)
    outputs = {}
    for name, value in zip(names, binding.get_outputs(), strict=True):
        if value.data_type() == "tensor(bfloat16)":
            count = int(np.prod(value.shape()))
            bits = np.zeros(0, np.uint16)
            if count:
                bits = np.ctypeslib.as_array((ctypes.c_uint16 * count).from_address(value.data_ptr()))
            outputs[name] = (bits.astype(np.uint32) << 16).view(np.float32).reshape(value.shape())
        else:
            outputs[name] = value.numpy().astype(np.float32)
    return outputs


def placement(session) -> dict[str, Counter]:
    """Op types per EP that ran them, e.g. {"WebGpuExecutionProvider": Counter({"MatMul": 84})}."""
    placed: dict[str, Counter] = {}
    for assignment in session.get_provider_graph_assignment_info():
        placed.setdefault(assignment.ep_name, Counter()).update(n.op_type for n in assignment.get_nodes())
    return placed


def genai_config(package: Path, on_cpu: bool = False):
    """ONNX Runtime GenAI's config of ``package``; ``on_cpu``: every session on the CPU (its
    ``clear_providers`` clears the decoder's alone, so the other sessions' are overlaid empty)."""
    import json

    import onnxruntime_genai as og

    config = og.Config(str(package))
    if on_cpu:
        config.clear_providers()
        sections = json.loads((Path(package) / "genai_config.json").read_text())["model"]
        others = [name for name in ("embedding", "vision", "speech") if isinstance(sections.get(name), dict)]
        if others:
            config.overlay(json.dumps({"model": {name: {"session_options": {"provider_options": []}} for name in others}}))
    return config
