"""L3 parity: an ONNX Runtime CPU session of a package against PyTorch on the logits and every
present KV, over prefill and decode steps, batched, left- and right-padded."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch

from exporter.trace.decoder import GenAIDecoder, input_names, make_inputs

# fp32 through different kernels (MLAS vs ATen) and different summation orders: observed max
# differences are ~5e-6; 1e-4 leaves room without hiding a wrong mask or a wrong position.
TOLERANCE = 1e-4

# (batch, seq, past, padding): padding is make_inputs' keyword arguments
CASES = [
    (1, 7, 0, {}),
    (2, 1, 9, {}),
    (3, 20, 0, {}),
    (1, 1, 30, {}),
    (2, 6, 0, {"left_padding": (0, 3)}),  # transformers' batching: a prompt left-padded by 3 (plain attention only)
    (2, 1, 8, {"left_padding": (0, 3)}),  # a decode step of that batch (plain attention only)
    (2, 6, 0, {"right_padding": (0, 3)}),  # ONNX Runtime GenAI's batching: right-padded prefill
    (2, 1, 8, {"past_right_padding": (0, 3)}),  # its decode step, with the padding as a hole
]


def last_real_token(logits: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """[batch, seq, vocab] -> [batch, 1, vocab] at each row's last unmasked position."""
    seq = logits.shape[1]
    chunk = attention_mask[:, attention_mask.shape[1] - seq :]
    rows = [max((j for j in range(seq) if chunk[b, j]), default=0) for b in range(len(chunk))]
    return np.stack([logits[b, j] for b, j in enumerate(rows)])[:, None, :]


def uses_group_query_attention(package) -> bool:
    return package.report.op_counts.get("com.microsoft.GroupQueryAttention", 0) > 0


def check_parity(package, model):
    layout = package.layout
    # GroupQueryAttention reads each row's real-token count (ONNX Runtime GenAI pads on the right)
    # and keeps every row's cache compact: real tokens first, no hole.
    compact_cache = uses_group_query_attention(package)
    # Layers GroupQueryAttention could not take keep transformers' attention and its cache layout.
    record = next((r for r in package.report.fx_passes if r["name"] == "substitute_group_query_attention"), None)
    plain_layers = {int(i) for i in record["changes"].get("plain_layers", {})} if record else set()
    session = ort.InferenceSession(str(package.model_path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == input_names(layout)
    reference = GenAIDecoder(model, layout).eval()
    generator = torch.Generator().manual_seed(0)
    for batch, seq, past, padding in CASES:
        if (compact_cache or plain_layers) and "left_padding" in padding:
            continue
        inputs = make_inputs(layout, batch, seq, past, generator=generator, **padding)
        with torch.no_grad():
            expected = [t.numpy() for t in reference(*inputs)]
        feeds = dict(zip(input_names(layout), [t.numpy() for t in (*inputs[:3], *inputs[3])], strict=True))
        actual = session.run(None, feeds)
        assert len(actual) == len(expected)
        real = inputs[1].numpy().astype(bool)  # [batch, past + seq]: False at padding
        if actual[0].shape[1] == 1:
            expected[0] = last_real_token(expected[0], real)
        for name, got, want in zip([o.name for o in session.get_outputs()], actual, expected, strict=True):
            assert got.shape == want.shape, name
            if name == "logits" and got.shape[1] == 1:
                pass  # already each row's last real token
            elif name == "logits":
                # A padded query position attends to nothing; its output is never read.
                keep = real[:, past:]
                got, want = got[keep], want[keep]
            else:
                # KV rows of padded positions are masked out of every later step
                first_slots = np.arange(real.shape[1])[None, :] < real.sum(axis=1, keepdims=True)
                compact = compact_cache and int(name.split(".")[1]) not in plain_layers
                got = got.transpose(0, 2, 1, 3)[first_slots if compact else real]
                want = want.transpose(0, 2, 1, 3)[real]
            diff = float(np.max(np.abs(got - want))) if got.size else 0.0
            assert diff <= TOLERANCE, f"{name} at (batch={batch}, seq={seq}, past={past}, pad={padding}): {diff:.2e}"
