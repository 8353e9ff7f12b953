"""Repro of the WebGPU EP bug behind the webgpu profile's ``sliding_window="explicit_mask"``.

onnxruntime-ep-webgpu 0.4.0's ``com.microsoft.GroupQueryAttention`` ignores ``local_window_size``
for a KV-shared call (a layer that reads another layer's cache: its new K/V are empty), so such a
layer attends to the whole past instead of the last W tokens. This script builds one
GroupQueryAttention node, runs the same KV-shared decode step on the CPU EP (which applies the
window) and on the WebGPU EP, and prints how far they differ, with and without a window.

    python scripts/webgpu_gqa_window_repro.py    # needs scripts/install_webgpu_stack.sh first

Measured on lavapipe with the bug: "window 4: max |WebGPU - CPU| = 2.09" (differs) and "no window: ... 2.38e-07"
(agrees). When the EP is fixed both agree, and the webgpu profile can go back to
``sliding_window="local_window_size"``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ep_profiles import get_profile
from exporter.ep_runtime import inference_session

HEADS, HEAD_SIZE, PAST = 2, 16, 12


def attention_node_model(window: int) -> onnx.ModelProto:
    attributes = {"num_heads": HEADS, "kv_num_heads": HEADS, "scale": 1.0}
    if window > 0:
        attributes["local_window_size"] = window
    node = helper.make_node("GroupQueryAttention", ["query", "key", "value", "past_key", "past_value",
                                                    "seqlens_k", "total_sequence_length"],
                            ["output", "present_key", "present_value"], domain="com.microsoft", **attributes)
    width = HEADS * HEAD_SIZE

    def tensor(name, dtype, shape):
        return helper.make_tensor_value_info(name, dtype, shape)

    inputs = [tensor("query", TensorProto.FLOAT, [1, 1, width]), tensor("key", TensorProto.FLOAT, [1, 0, width]),
              tensor("value", TensorProto.FLOAT, [1, 0, width]),
              tensor("past_key", TensorProto.FLOAT, [1, HEADS, PAST, HEAD_SIZE]),
              tensor("past_value", TensorProto.FLOAT, [1, HEADS, PAST, HEAD_SIZE]),
              tensor("seqlens_k", TensorProto.INT32, [1]), tensor("total_sequence_length", TensorProto.INT32, [])]
    outputs = [tensor(name, TensorProto.FLOAT, None) for name in ("output", "present_key", "present_value")]
    graph = helper.make_graph([node], "kv_shared_decode_step", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def feeds() -> dict[str, np.ndarray]:
    """A KV-shared decode step: one query at the end of a full past, no new K/V."""
    rng = np.random.default_rng(0)
    width = HEADS * HEAD_SIZE
    return {
        "query": rng.standard_normal((1, 1, width), dtype=np.float32),
        "key": np.zeros((1, 0, width), np.float32),
        "value": np.zeros((1, 0, width), np.float32),
        "past_key": rng.standard_normal((1, HEADS, PAST, HEAD_SIZE), dtype=np.float32),
        "past_value": rng.standard_normal((1, HEADS, PAST, HEAD_SIZE), dtype=np.float32),
        "seqlens_k": np.array([PAST - 1], np.int32),
        "total_sequence_length": np.array(PAST, np.int32),
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        for window in (4, 0):
            path = Path(scratch) / f"gqa-window-{window}.onnx"
            onnx.save(attention_node_model(window), path)
            cpu = inference_session(path, get_profile("cpu"), {}).run(["output"], feeds())[0]
            webgpu = inference_session(path, get_profile("webgpu"), {}).run(["output"], feeds())[0]
            label = f"window {window}" if window else "no window"
            print(f"{label}: max |WebGPU - CPU| = {float(np.abs(webgpu - cpu).max()):.3g}")


if __name__ == "__main__":
    main()
