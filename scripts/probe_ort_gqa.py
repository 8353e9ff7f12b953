"""Probe ONNX Runtime's GroupQueryAttention (CPU) against a NumPy reference of the semantics the
exporter plans to rely on (maintenance script, not a test; run it after upgrading onnxruntime).

    python scripts/probe_ort_gqa.py

Semantics probed (com.microsoft.GroupQueryAttention, separate past/present buffers):
- seqlens_k[b] = (real tokens of row b so far) - 1, total_sequence_length = the mask's width (the
  exporter's lowering; equal to the longest row + 1 here, as in GenAI's batches, where one row is unpadded);
  new K/V of row b are written right after its own past (right padding leaves no hole);
- a first prompt (as many queries as total_sequence_length, so also a KV-shared layer's whole
  prompt) of a right-padded batch: query i sits at position i; row b's real tokens are its first
  seqlens_k[b] + 1 positions; queries past them are padding and never read;
- local_window_size = W: each query sees the last W keys including itself (HF sliding_window = W);
- softcap: scores -> softcap * tanh(scores / softcap) before the softmax;
- KV-shared layers: empty new K/V, the source layer's present as past, total = its length.
Prints one line per case with the max abs difference; exits 1 if any exceeds 1e-5.
"""

from __future__ import annotations

import sys

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

TOLERANCE = 1e-5


def gqa_session(num_heads, kv_heads, head_dim, window=-1, softcap=0.0):
    def tensor(name, dtype, shape):
        return helper.make_tensor_value_info(name, dtype, shape)

    inputs = [
        tensor("query", TensorProto.FLOAT, ["B", "S", num_heads * head_dim]),
        tensor("key", TensorProto.FLOAT, ["B", "N", kv_heads * head_dim]),
        tensor("value", TensorProto.FLOAT, ["B", "N", kv_heads * head_dim]),
        tensor("past_key", TensorProto.FLOAT, ["B", kv_heads, "P", head_dim]),
        tensor("past_value", TensorProto.FLOAT, ["B", kv_heads, "P", head_dim]),
        tensor("seqlens_k", TensorProto.INT32, ["B"]),
        tensor("total_sequence_length", TensorProto.INT32, []),
    ]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("output", "present_key", "present_value")]
    node = helper.make_node(
        "GroupQueryAttention", [i.name for i in inputs], [o.name for o in outputs], domain="com.microsoft",
        num_heads=num_heads, kv_num_heads=kv_heads, local_window_size=window, softcap=softcap,
    )
    model = helper.make_model(
        helper.make_graph([node], "gqa", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
    )
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def reference(query, key, value, past_key, past_value, seqlens_k, total_length, kv_heads, head_dim, window,
              softcap):
    batch, seq, _ = query.shape
    new, past_len = key.shape[1], past_key.shape[2]
    num_heads = query.shape[2] // head_dim
    first_prompt = seq == total_length
    key = key.reshape(batch, new, kv_heads, head_dim).transpose(0, 2, 1, 3)
    value = value.reshape(batch, new, kv_heads, head_dim).transpose(0, 2, 1, 3)
    length = max(past_len + new, new) if new else past_len
    keys = np.zeros((batch, kv_heads, length, head_dim), np.float32)
    values = np.zeros_like(keys)
    out = np.zeros_like(query)
    for b in range(batch):
        total = int(seqlens_k[b]) + 1
        before = 0 if first_prompt and new else (total - new if new else total)
        keys[b, :, :before], values[b, :, :before] = past_key[b, :, :before], past_value[b, :, :before]
        keys[b, :, before : before + new], values[b, :, before : before + new] = key[b], value[b]
        q = query[b].reshape(seq, num_heads, head_dim)
        for h in range(num_heads):
            g = h // (num_heads // kv_heads)
            for i in range(seq):
                position = i if first_prompt else total - seq + i
                visible = np.arange(position + 1)
                if window > 0:
                    visible = visible[visible > position - window]
                scores = keys[b, g, visible] @ q[i, h] / np.sqrt(head_dim)
                if softcap > 0:
                    scores = softcap * np.tanh(scores / softcap)
                weights = np.exp(scores - scores.max())
                out[b, i, h * head_dim : (h + 1) * head_dim] = (weights / weights.sum()) @ values[b, g, visible]
    return out, keys


# name: (batch, query tokens, past, seqlens_k, window, softcap, KV-shared)
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
}


def main() -> int:
    rng = np.random.default_rng(0)
    num_heads, kv_heads, head_dim = 4, 2, 8
    worst = 0.0
    for name, (batch, seq, past, seqlens, window, softcap, shared) in CASES.items():
        new = 0 if shared else seq

        def normal(*shape):
            return rng.standard_normal(shape).astype(np.float32)

        feeds = {
            "query": normal(batch, seq, num_heads * head_dim),
            "key": normal(batch, new, kv_heads * head_dim),
            "value": normal(batch, new, kv_heads * head_dim),
            "past_key": normal(batch, kv_heads, past, head_dim),
            "past_value": normal(batch, kv_heads, past, head_dim),
            "seqlens_k": np.array(seqlens, np.int32),
            "total_sequence_length": np.array(past if shared else max(seqlens) + 1, np.int32),
        }
        output, present_key, _ = gqa_session(num_heads, kv_heads, head_dim, window, softcap).run(None, feeds)
        expected_output, expected_keys = reference(
            *(feeds[k] for k in ("query", "key", "value", "past_key", "past_value", "seqlens_k")),
            int(feeds["total_sequence_length"]), kv_heads, head_dim, window, softcap,
        )
        diff = 0.0
        for b in range(batch):
            total = seqlens[b] + 1
            read = total if seq == feeds["total_sequence_length"] else seq  # padded queries are never read
            diff = max(diff, float(np.abs(output[b, :read] - expected_output[b, :read]).max()))
            if not shared:
                diff = max(diff, float(np.abs(present_key[b, :, :total] - expected_keys[b, :, :total]).max()))
        worst = max(worst, diff)
        print(f"{'ok ' if diff <= TOLERANCE else 'BAD'} {name:<36} max abs diff {diff:.1e}")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
