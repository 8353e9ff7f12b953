"""L3: the GroupQueryAttention marker's PyTorch kernel (the reference every L2 test trusts) against
ONNX Runtime's ``com.microsoft.GroupQueryAttention`` itself, on one node, for the cases the
exporter relies on: right-padded prefill, uneven decode, sliding windows, soft-capping, attention
sinks (``head_sink``, gpt-oss) and KV-shared layers (empty new K/V, another layer's present as
past)."""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import fx_passes.custom_ops.ops  # noqa: F401  (registers the custom ops)

pytestmark = pytest.mark.unit

NUM_HEADS, KV_HEADS, HEAD = 4, 2, 8
TOLERANCE = 1e-5  # fp32, one attention: different summation orders only

# name: (batch, query tokens, past, seqlens_k, window, softcap, KV-shared[, head_sink])
CASES = {
    "prefill, right-padded batch": (2, 6, 0, [5, 2], -1, 0.0, False),
    "decode, uneven batch": (2, 1, 7, [7, 4], -1, 0.0, False),
    "decode past the window": (2, 1, 12, [12, 9], 4, 0.0, False),
    "prefill longer than the window": (1, 10, 0, [9], 4, 0.0, False),
    "soft-capping": (1, 5, 3, [7], -1, 50.0, False),
    "KV-shared decode": (2, 1, 8, [7, 5], -1, 0.0, True),
    "KV-shared decode past the window": (2, 1, 12, [11, 8], 4, 0.0, True),
    "KV-shared, one query over a prompt": (2, 1, 6, [5, 2], -1, 0.0, True),
    "KV-shared, whole right-padded prompt": (2, 6, 6, [5, 2], 4, 0.0, True),
    # Sinks of order 1 and more (gpt-oss's), beside a few keys: a dropped sink moves the output by O(1).
    "sinks, right-padded prefill": (2, 6, 0, [5, 2], -1, 0.0, False, True),
    "sinks, decode past the window": (2, 1, 12, [12, 9], 4, 0.0, False, True),
}


def _session(window: int, softcap: float, sink: bool) -> ort.InferenceSession:
    def tensor(name, dtype, shape):
        return helper.make_tensor_value_info(name, dtype, shape)

    inputs = [
        tensor("query", TensorProto.FLOAT, ["B", "S", NUM_HEADS * HEAD]),
        tensor("key", TensorProto.FLOAT, ["B", "N", KV_HEADS * HEAD]),
        tensor("value", TensorProto.FLOAT, ["B", "N", KV_HEADS * HEAD]),
        tensor("past_key", TensorProto.FLOAT, ["B", KV_HEADS, "P", HEAD]),
        tensor("past_value", TensorProto.FLOAT, ["B", KV_HEADS, "P", HEAD]),
        tensor("seqlens_k", TensorProto.INT32, ["B"]),
        tensor("total_sequence_length", TensorProto.INT32, []),
    ]
    names = [i.name for i in inputs]
    if sink:  # inputs 7-10 (rotary caches, position ids, attention bias) left out
        inputs.append(tensor("head_sink", TensorProto.FLOAT, [NUM_HEADS]))
        names += ["", "", "", "", "head_sink"]
    outputs = [tensor(n, TensorProto.FLOAT, None) for n in ("output", "present_key", "present_value")]
    node = helper.make_node("GroupQueryAttention", names, [o.name for o in outputs],
                            domain="com.microsoft", num_heads=NUM_HEADS, kv_num_heads=KV_HEADS,
                            local_window_size=window, softcap=softcap)
    model = helper.make_model(helper.make_graph([node], "gqa", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.l3
@pytest.mark.parametrize("case", list(CASES))
def test_marker_kernel_matches_onnx_runtime(case):
    batch, seq, past, seqlens, window, softcap, shared, *sink = CASES[case]
    sink = bool(sink and sink[0])
    new = 0 if shared else seq
    rng = np.random.default_rng(0)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    feeds = {
        "query": normal(batch, seq, NUM_HEADS * HEAD),
        "key": normal(batch, new, KV_HEADS * HEAD),
        "value": normal(batch, new, KV_HEADS * HEAD),
        "past_key": normal(batch, KV_HEADS, past, HEAD),
        "past_value": normal(batch, KV_HEADS, past, HEAD),
        "seqlens_k": np.array(seqlens, np.int32),
        # The exporter's lowering: the longest row's real tokens (a KV-shared layer: its source's length).
        "total_sequence_length": np.array(past if shared else max(seqlens) + 1, np.int32),
    }
    head_sink = normal(NUM_HEADS) * 2.0 if sink else None
    if sink:
        feeds["head_sink"] = head_sink
    output, present_key, present_value = _session(window, softcap, sink).run(None, feeds)

    # The marker reads seqlens_k and total_sequence_length off the attention mask: row b's real
    # tokens are seqlens_k[b] + 1, the mask as wide as the total.
    real = [s + 1 for s in seqlens]
    mask = torch.tensor([[1] * r + [0] * (int(feeds["total_sequence_length"]) - r) for r in real])
    tensors = [torch.from_numpy(feeds[k]) for k in ("query", "key", "value", "past_key", "past_value")]
    sink_args = (None, None, torch.from_numpy(head_sink)) if sink else ()
    want = torch.ops.genai_exporter.group_query_attention(
        *tensors, mask, NUM_HEADS, KV_HEADS, 1 / math.sqrt(HEAD), softcap, window, *sink_args)
    assert torch.isfinite(want[0]).all() and np.isfinite(output).all()
    first_prompt = seq == int(feeds["total_sequence_length"])
    for b in range(batch):
        read = real[b] if first_prompt else seq  # a first prompt's padded queries are never read
        np.testing.assert_allclose(output[b, :read], want[0][b, :read].numpy(), rtol=0, atol=TOLERANCE, equal_nan=False)
        if not shared:
            for got, expected in ((present_key, want[1]), (present_value, want[2])):
                np.testing.assert_allclose(got[b, :, : real[b]], expected[b, :, : real[b]].numpy(), rtol=0, atol=TOLERANCE, equal_nan=False)
