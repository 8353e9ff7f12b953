"""L3: a KV-shared layer's GroupQueryAttention marker lowered with ``past_prefix`` (the cpu
profile's form) and run by ONNX Runtime on a KV buffer as ONNX Runtime GenAI shares it: more slots
than tokens, each row's real tokens first, the slots after them unwritten (NaN here). It must give
the marker kernel's output, and hand the kernel only the longest row's real tokens, so the present
it copies them into (which nobody reads) is that long, not the buffer's length. Both as a plain
layer and as Gemma 4's shared layers mostly are: a sliding window, queries rotated by the kernel."""

from __future__ import annotations

import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from exporter.lower import lower
from fx_passes import markers  # noqa: F401  (registers the marker ops)

NUM_HEADS, KV_HEADS, HEAD, SLOTS = 4, 2, 16, 32  # ONNX Runtime rotates heads of 16k
TOLERANCE = 1e-5  # fp32, one attention: different summation orders only


class SharedLayerAttention(torch.nn.Module):
    """A layer reading another layer's cache: no new K/V, the owner's buffer as its past."""

    def __init__(self, past_prefix: bool, window: int, rotary: bool):
        super().__init__()
        self.past_prefix, self.window = past_prefix, window
        self.caches = ()
        if rotary:
            angles = torch.arange(SLOTS)[:, None] * 0.5 ** torch.arange(HEAD // 2)[None, :]
            self.register_buffer("cos_cache", angles.cos())
            self.register_buffer("sin_cache", angles.sin())
            self.caches = ("cos_cache", "sin_cache")

    def forward(self, query, past_key, past_value, attention_mask):
        empty = query[:, :0, : KV_HEADS * HEAD]
        caches = [getattr(self, name) for name in self.caches]
        return torch.ops.genai_exporter.group_query_attention(
            query, empty, empty, past_key, past_value, attention_mask, NUM_HEADS, KV_HEADS, 1.0, 0.0, self.window,
            *caches, past_prefix=self.past_prefix)[:2]


# name: (local_window_size, queries rotated by the kernel)
VARIANTS = {"plain": (-1, False), "window of 4, rotary": (4, True)}


def _inputs(real: list[int], seq: int):
    """Row b holds ``real[b]`` real tokens in a buffer of SLOTS; the chunk's ``seq`` queries are
    each row's last ones (a decode step, a chunk after a past), or the whole right-padded prompt
    when ``seq`` is the longest row's length."""
    generator = torch.Generator().manual_seed(0)
    batch = len(real)
    query = torch.randn(batch, seq, NUM_HEADS * HEAD, generator=generator)
    past_key, past_value = (torch.randn(batch, KV_HEADS, SLOTS, HEAD, generator=generator) for _ in range(2))
    width = max(real)
    mask = torch.zeros(batch, width, dtype=torch.int64)
    for row, count in enumerate(real):
        mask[row, :count] = 1
        past_key[row, :, count:] = past_value[row, :, count:] = float("nan")
    return query, past_key, past_value, mask


# name: (each row's real tokens, queries in the chunk)
CASES = {
    "decode step, uneven rows": ([9, 5], 1),
    "one row": ([7], 1),
    "right-padded prompt, every query": ([6, 3], 6),
    "a chunk of 3 after a past of 6": ([9], 3),
}


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    made = {}
    folder = tmp_path_factory.mktemp("shared_kv_prefix")
    for variant, (window, rotary) in VARIANTS.items():
        for past_prefix in (False, True):
            sample = _inputs([5, 3], 2)
            batch, seq, total = (torch.export.Dim(n) for n in ("batch", "seq", "total"))
            slots = torch.export.Dim("slots")
            program = torch.export.export(SharedLayerAttention(past_prefix, window, rotary), sample, dynamic_shapes=(
                {0: batch, 1: seq}, {0: batch, 2: slots}, {0: batch, 2: slots}, {0: batch, 1: total}))
            model, _ = lower(program, sample, ["query", "past_key", "past_value", "attention_mask"],
                             ["output", "present_key"])
            path = folder / f"{len(made)}.onnx"
            ir.save(model, path)
            made[variant, past_prefix] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return made


@pytest.mark.l3
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", list(CASES))
def test_shared_layer_reads_only_the_real_tokens(sessions, case, variant):
    real, seq = CASES[case]
    inputs = _inputs(real, seq)
    feeds = dict(zip(("query", "past_key", "past_value", "attention_mask"), (t.numpy() for t in inputs)))
    # The kernel's own multiply would carry NaN from slots it masks; zeros there give what a
    # kernel that never reads them gives.
    query, past_key, past_value, mask = inputs
    kernel = SharedLayerAttention(True, *VARIANTS[variant])
    want = kernel(query, past_key.nan_to_num(0.0), past_value.nan_to_num(0.0), mask)[0]
    queries = torch.ones(len(real), seq, dtype=torch.bool)
    if seq > 1:  # a right-padded prompt's padding queries give nothing anyone reads
        for row, count in enumerate(real):
            queries[row, count:] = False
    output, present_key = sessions[variant, True].run(None, feeds)
    torch.testing.assert_close(torch.from_numpy(output)[queries], want[queries], rtol=0, atol=TOLERANCE)
    assert present_key.shape[2] == max(real)  # the copy ONNX Runtime makes: the real tokens only
    # Without the prefix, the kernel gives the same output but copies the whole buffer.
    output, present_key = sessions[variant, False].run(None, feeds)
    torch.testing.assert_close(torch.from_numpy(output)[queries], want[queries], rtol=0, atol=TOLERANCE)
    assert present_key.shape[2] == SLOTS
