"""L3: the webgpu profile's sliding-window attention (``sliding_window_slots`` + ``window_attention``)
lowered to ONNX and run by ONNX Runtime, against the GroupQueryAttention marker's kernel with
``local_window_size`` (itself checked against ONNX Runtime's kernel in test_gqa_reference_kernel),
on KV buffers as GenAI's graph capture leaves them: max_length slots, the unused ones holding
anything (NaN here), so a slot outside the window that leaked in would show."""

from __future__ import annotations

import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

import fx_passes.custom_ops.ops  # noqa: F401  (registers the custom ops)
from exporter.lower.torch_onnx import lower

pytestmark = pytest.mark.unit

NUM_HEADS, HEAD, WINDOW, SCALE = 4, 8, 4, 0.3
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}  # one attention: summation order; fp16's rounding
# (KV heads, soft-cap, attention sinks): one KV head (Gemma 4's sliding layers: no query
# transposes), query-head groups regrouped per KV head, soft-capping (Gemma 2), a sink logit per
# head (gpt-oss: one more Softmax column, dropped), with one KV head and with groups.
LAYOUTS = [(1, 0.0, False), (2, 0.0, False), (2, 50.0, False), (1, 0.0, True), (2, 0.0, True)]
# Sinks of order 1 and more, as trained gpt-oss's: a dropped or misplaced sink moves outputs by O(0.1).
SINKS = torch.randn(NUM_HEADS, generator=torch.Generator().manual_seed(1)) * 2.0

# name: (query tokens, each row's real tokens, buffer slots, mask columns: None = the longest row's
# real tokens, as GenAI feeds without capture; a number = zero-padded, as its captured mask buffer)
CASES = {
    "decode past the window, max_length buffer": (1, [12, 9], 64, None),
    "decode inside the window": (1, [3, 2], 64, None),
    "decode, mask zero-padded to the buffer": (1, [12], 64, 64),
    "decode past 2048 tokens (fp16 counts would stop there)": (1, [3001], 3072, 3072),
    "right-padded first prompt longer than the window": (7, [7, 3], 32, None),
    "chunk after a past": (3, [10, 10], 16, None),
    "buffer shorter than the span": (6, [6, 6], 7, None),
}


class WindowAttention(torch.nn.Module):
    def __init__(self, kv_heads: int, softcap: float, sink: bool, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.kv_heads, self.softcap = kv_heads, softcap
        self.sinks = torch.nn.Parameter(SINKS.to(dtype)) if sink else None

    def forward(self, query, key_buffer, value_buffer, attention_mask):
        ops = torch.ops.genai_exporter
        index, bias = ops.sliding_window_slots(query, attention_mask, WINDOW, self.kv_heads, HEAD,
                                               NUM_HEADS // self.kv_heads)
        return ops.window_attention(query, key_buffer, value_buffer, index, bias, NUM_HEADS, SCALE, self.softcap,
                                    self.sinks)


def _inputs(kv_heads: int, seq: int, real: list[int], slots: int, dtype: torch.dtype, columns: int | None = None):
    generator = torch.Generator().manual_seed(0)
    batch = len(real)
    query = torch.randn(batch, seq, NUM_HEADS * HEAD, generator=generator).to(dtype)
    buffers = [torch.randn(batch, kv_heads, slots, HEAD, generator=generator).to(dtype) for _ in range(2)]
    for buffer in buffers:
        for row, count in enumerate(real):
            buffer[row, :, count:] = float("nan")  # unused slots: whatever the buffer held
    width = columns or max(real)
    mask = torch.tensor([[1] * count + [0] * (width - count) for count in real], dtype=torch.int64)
    return query, *buffers, mask


def _reference(kv_heads: int, softcap: float, sink: bool, query, key_buffer, value_buffer, mask) -> torch.Tensor:
    """GroupQueryAttention's window over each row's real slots, the chunk's keys already in the
    buffer: passed as a KV-shared layer passes them, no new tokens and the buffer as the past."""
    longest = int(mask.sum(-1).max())
    keys, values = (b[:, :, :longest].nan_to_num(0.0).float() for b in (key_buffer, value_buffer))
    empty = query.new_zeros(query.shape[0], 0, kv_heads * HEAD).float()
    sinks = (None, None, SINKS) if sink else ()
    return torch.ops.genai_exporter.group_query_attention(
        query.float(), empty, empty, keys, values, mask[:, :longest], NUM_HEADS, kv_heads, SCALE, softcap, WINDOW,
        *sinks)[0]


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    made = {}
    folder = tmp_path_factory.mktemp("window")
    for kv_heads, softcap, sink in LAYOUTS:
        for dtype in TOLERANCE:
            sample = _inputs(kv_heads, 2, [5, 3], 16, dtype)
            batch, seq, slots, total = (torch.export.Dim(n) for n in ("batch", "seq", "slots", "total"))
            program = torch.export.export(WindowAttention(kv_heads, softcap, sink, dtype), sample, dynamic_shapes=(
                {0: batch, 1: seq}, {0: batch, 2: slots}, {0: batch, 2: slots}, {0: batch, 1: total}))
            path = folder / f"{kv_heads}-{softcap}-{sink}-{dtype}.onnx"
            model, _ = lower(program, sample, ["query", "key_buffer", "value_buffer", "attention_mask"], ["output"])
            ir.save(model, path)
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            made[kv_heads, softcap, sink, dtype] = session, [node.op_type for node in model.graph]
    return made


@pytest.mark.l3
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("layout", LAYOUTS,
                         ids=lambda layout: f"kv{layout[0]}-softcap{layout[1]:g}" + ("-sinks" if layout[2] else ""))
@pytest.mark.parametrize("case", list(CASES))
def test_lowered_window_attention_matches_the_group_query_attention_window(sessions, case, layout, dtype):
    kv_heads, softcap, sink = layout
    seq, real, slots, columns = CASES[case]
    inputs = _inputs(kv_heads, seq, real, slots, dtype, columns)
    session, ops = sessions[kv_heads, softcap, sink, dtype]
    # On the device under graph capture: no shape arithmetic; one KV head needs no transposed query.
    assert not {"Shape", "Range"} & set(ops)
    assert ops.count("Transpose") == (1 if kv_heads == 1 else 3)
    feeds = dict(zip(("query", "key_buffer", "value_buffer", "attention_mask"), (t.numpy() for t in inputs)))
    got = torch.from_numpy(session.run(None, feeds)[0]).float()
    want = _reference(kv_heads, softcap, sink, *inputs)
    kernel = WindowAttention(kv_heads, softcap, sink, dtype)(*inputs).float()  # the marker's own kernel, which the L2 tests trust
    # A right-padded first prompt's trailing queries are padding, with no defined output.
    for row, count in enumerate(real):
        rows = slice(0, min(seq, count) if seq == max(real) else seq)
        for name, value in (("ONNX Runtime", got), ("marker kernel", kernel)):
            assert torch.isfinite(value[row, rows]).all(), name
            difference = (value[row, rows] - want[row, rows]).abs().max().item()
            assert difference <= TOLERANCE[dtype], f"{name}, row {row}: {difference}"
