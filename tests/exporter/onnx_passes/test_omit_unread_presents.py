"""L3: a KV-shared layer's GroupQueryAttention written without its unread present outputs (the
cpu profile's ``omit_unread_presents``), run by ONNX Runtime on a KV buffer as ONNX Runtime GenAI
shares it: more slots than tokens, each row's real tokens first, the slots after them unwritten
(NaN here). It must give the marker kernel's output, as the node with presents does. Both as a
plain layer and as Gemma 4's shared layers mostly are: a sliding window, queries rotated by the
kernel. A node whose present is read (a cache owner's, a graph output) keeps it."""

from __future__ import annotations

from types import SimpleNamespace

import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

import fx_passes.custom_ops.ops  # noqa: F401  (registers the custom ops)
from ep_profiles import get_profile
from exporter.lower.torch_onnx import lower
from exporter.onnx_passes.omit_unread_presents import OmitUnreadPresents

pytestmark = pytest.mark.unit

NUM_HEADS, KV_HEADS, HEAD, SLOTS = 4, 2, 16, 32  # ONNX Runtime rotates heads of 16k
TOLERANCE = 1e-5  # fp32, one attention: different summation orders only
INPUTS = ("query", "past_key", "past_value", "attention_mask")


class SharedLayerAttention(torch.nn.Module):
    """A layer reading another layer's cache: no new K/V, the owner's buffer as its past; only its
    attention output is read."""

    def __init__(self, window: int, rotary: bool):
        super().__init__()
        self.window = window
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
            *caches)[0]


class OwnerAttention(torch.nn.Module):
    """A layer writing its own cache: its present is a graph output."""

    def forward(self, query, past_key, past_value, attention_mask):
        new = query[:, :, : KV_HEADS * HEAD]
        return torch.ops.genai_exporter.group_query_attention(
            query, new, new, past_key, past_value, attention_mask, NUM_HEADS, KV_HEADS, 1.0, 0.0, -1)


class ConsumedPresentAttention(torch.nn.Module):
    """A KV-shared call whose present key another node reads (not a graph output itself)."""

    def forward(self, query, past_key, past_value, attention_mask):
        empty = query[:, :0, : KV_HEADS * HEAD]
        output, present_key, _ = torch.ops.genai_exporter.group_query_attention(
            query, empty, empty, past_key, past_value, attention_mask, NUM_HEADS, KV_HEADS, 1.0, 0.0, -1)
        return output, present_key.sum(-1)


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


def _lowered(module: torch.nn.Module, outputs: list[str]) -> ir.Model:
    sample = _inputs([5, 3], 2)
    batch, seq, total, slots = (torch.export.Dim(n) for n in ("batch", "seq", "total", "slots"))
    program = torch.export.export(module, sample, dynamic_shapes=(
        {0: batch, 1: seq}, {0: batch, 2: slots}, {0: batch, 2: slots}, {0: batch, 1: total}))
    model, _ = lower(program, sample, list(INPUTS), outputs)
    return model


def _attention_outputs(model: ir.Model) -> list[int]:
    return [len(node.outputs) for node in model.graph.all_nodes() if node.op_type == "GroupQueryAttention"]


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    """(variant, presents omitted) -> an ONNX Runtime CPU session of the lowered shared layer."""
    made = {}
    folder = tmp_path_factory.mktemp("omit_unread_presents")
    for variant, (window, rotary) in VARIANTS.items():
        for omitted in (False, True):
            model = _lowered(SharedLayerAttention(window, rotary), ["output"])
            if omitted:
                assert OmitUnreadPresents()(model, settings=None, session=None) == {"presents_omitted": 1}
            assert _attention_outputs(model) == [1 if omitted else 3]
            path = folder / f"{len(made)}.onnx"
            ir.save(model, path)
            made[variant, omitted] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return made


@pytest.mark.l3
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", list(CASES))
def test_shared_layer_without_presents_reads_its_past(sessions, case, variant):
    real, seq = CASES[case]
    inputs = _inputs(real, seq)
    feeds = dict(zip(INPUTS, (t.numpy() for t in inputs)))
    # The kernel's own multiply would carry NaN from slots it masks; zeros there give what a
    # kernel that never reads them gives.
    query, past_key, past_value, mask = inputs
    want = SharedLayerAttention(*VARIANTS[variant])(query, past_key.nan_to_num(0.0), past_value.nan_to_num(0.0), mask)
    queries = torch.ones(len(real), seq, dtype=torch.bool)
    if seq > 1:  # a right-padded prompt's padding queries give nothing anyone reads
        for row, count in enumerate(real):
            queries[row, count:] = False
    for omitted in (True, False):
        (output,) = sessions[variant, omitted].run(None, feeds)
        torch.testing.assert_close(torch.from_numpy(output)[queries], want[queries], rtol=0, atol=TOLERANCE)


@pytest.mark.l3
@pytest.mark.parametrize("module, outputs", [(OwnerAttention(), ["output", "present_key", "present_value"]),
                                             (ConsumedPresentAttention(), ["output", "key_sums"])],
                         ids=["graph outputs", "read by a node"])
def test_a_read_present_is_kept(module, outputs):
    model = _lowered(module, outputs)
    assert OmitUnreadPresents()(model, settings=None, session=None) == {"presents_omitted": 0}
    assert _attention_outputs(model) == [3]


@pytest.mark.l3
def test_a_kv_shared_call_whose_present_is_read_fails():
    """Its past is an owner's present (a KV-shared call), and a node reads its own present: the
    pass says so rather than leave it."""

    class SharedAfterOwner(torch.nn.Module):
        def forward(self, query, past_key, past_value, attention_mask):
            new, empty = query[:, :, : KV_HEADS * HEAD], query[:, :0, : KV_HEADS * HEAD]
            gqa = torch.ops.genai_exporter.group_query_attention
            _, owner_key, owner_value = gqa(query, new, new, past_key, past_value, attention_mask, NUM_HEADS,
                                            KV_HEADS, 1.0, 0.0, -1)
            output, shared_key, _ = gqa(query, empty, empty, owner_key, owner_value, attention_mask, NUM_HEADS,
                                        KV_HEADS, 1.0, 0.0, -1)
            return output, owner_key, owner_value, shared_key.sum(-1)

    model = _lowered(SharedAfterOwner(), ["output", "present_key", "present_value", "key_sums"])
    with pytest.raises(RuntimeError, match="KV-shared GroupQueryAttention .* has its present read"):
        OmitUnreadPresents()(model, settings=None, session=None)


@pytest.mark.l1
def test_only_kv_shared_decoders_on_profiles_that_say_so_omit_presents():
    def settings_for(ep: str, shared_layers: int = 4, attention_op: bool = True):
        return SimpleNamespace(profile=get_profile(ep), attention_op=attention_op,
                               layout=SimpleNamespace(num_kv_shared_layers=shared_layers))

    decoder, embedding = SimpleNamespace(is_decoder=True), SimpleNamespace(is_decoder=False)
    assert OmitUnreadPresents().applies(settings_for("cpu"), decoder)
    assert OmitUnreadPresents().applies(settings_for("cuda"), decoder) is None  # its kernel was not run
    assert OmitUnreadPresents().applies(settings_for("cpu"), embedding) is None
    assert OmitUnreadPresents().applies(settings_for("cpu", shared_layers=0), decoder) is None
    assert OmitUnreadPresents().applies(settings_for("cpu", attention_op=False), decoder) is None
