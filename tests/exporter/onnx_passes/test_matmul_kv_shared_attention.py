"""L3: KV-shared layers' GroupQueryAttention on one query per row rewritten as MatMul/Softmax over
the owner's slots (the cpu profile's ``matmul_kv_shared_attention``), run by ONNX Runtime against
the GroupQueryAttention node it replaces and against the marker kernel.

The owner writes one new token per row into a KV buffer with more slots than tokens, each row's
real tokens first and the slots after them unwritten (NaN here), its present bound onto its past
as ONNX Runtime GenAI shares one buffer; two KV-shared layers then read the owner's present. Rows of uneven length, a
window that hides part of one row and none of another, rotary queries, a soft cap and a scale, two
query heads per KV head."""

from __future__ import annotations

from types import SimpleNamespace

import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

import fx_passes.custom_ops.ops  # noqa: F401  (registers the custom ops)
from ep_profiles import get_profile
from exporter.lower.torch_onnx import lower
from exporter.onnx_passes.matmul_kv_shared_attention import MatmulKvSharedAttention
from exporter.onnx_passes.tidy import Tidy

NUM_HEADS, KV_HEADS, HEAD, SLOTS = 4, 2, 16, 32  # ONNX Runtime rotates heads of 16k
TOLERANCE = 1e-5  # fp32, one attention: different summation orders only
INPUTS = ("query", "new_key", "new_value", "past_key", "past_value", "attention_mask")
OUTPUTS = ["first_shared", "second_shared", "present_key", "present_value"]


class OwnerAndSharedLayers(torch.nn.Module):
    """A cache owner taking one new token per row, then two layers reading its cache (no new K/V,
    the owner's present as their past)."""

    def __init__(self, window: int, rotary: bool, scale: float = 1.0, softcap: float = 0.0):
        super().__init__()
        self.window, self.scale, self.softcap = window, scale, softcap
        self.caches = ()
        if rotary:
            angles = torch.arange(SLOTS + 1)[:, None] * 0.5 ** torch.arange(HEAD // 2)[None, :]
            self.register_buffer("cos_cache", angles.cos())
            self.register_buffer("sin_cache", angles.sin())
            self.caches = ("cos_cache", "sin_cache")

    def forward(self, query, new_key, new_value, past_key, past_value, attention_mask):
        gqa = torch.ops.genai_exporter.group_query_attention
        caches = [getattr(self, name) for name in self.caches]
        settings = (NUM_HEADS, KV_HEADS, self.scale, self.softcap, self.window)
        _, present_key, present_value = gqa(query, new_key, new_value, past_key, past_value, attention_mask,
                                            *settings, *caches)
        empty = new_key[:, :0]
        first = gqa(query, empty, empty, present_key, present_value, attention_mask, *settings, *caches)[0]
        second = gqa(query * 0.5, empty, empty, present_key, present_value, attention_mask, *settings, *caches)[0]
        return first, second, present_key, present_value


# name: (local_window_size, rotary, scale, softcap)
VARIANTS = {
    "plain": (-1, False, 1.0, 0.0),
    "window of 4, rotary": (4, True, 1.0, 0.0),
    "scaled, soft-capped": (-1, True, 0.25, 2.0),
    "scale 0: ONNX Runtime's 1 / sqrt(head)": (-1, False, 0.0, 0.0),
    "window of 4, interleaved rotary": (4, True, 1.0, 0.0),
}
# Lowered with rotary_interleaved=1 set on the nodes afterwards (the marker rotates rotate_half
# pairs only): compared with ONNX Runtime's kernel alone.
INTERLEAVED = "window of 4, interleaved rotary"

# name: each row's real tokens after this step (its last one the step's new token)
CASES = {
    "decode step, uneven rows": [9, 5],
    "one row": [7],
    "a one-token prompt": [1],
    "the window hides part of one row only": [12, 3],
}


def _inputs(real: list[int], seq: int = 1):
    generator = torch.Generator().manual_seed(0)
    batch = len(real)
    query = torch.randn(batch, seq, NUM_HEADS * HEAD, generator=generator)
    new_key, new_value = (torch.randn(batch, seq, KV_HEADS * HEAD, generator=generator) for _ in range(2))
    past_key, past_value = (torch.randn(batch, KV_HEADS, SLOTS, HEAD, generator=generator) for _ in range(2))
    mask = torch.zeros(batch, max(real), dtype=torch.int64)
    for row, count in enumerate(real):
        mask[row, :count] = 1
        past_key[row, :, count - 1:] = past_value[row, :, count - 1:] = float("nan")
    return query, new_key, new_value, past_key, past_value, mask


def _lowered(module: torch.nn.Module, one_query: bool = True) -> ir.Model:
    sample = _inputs([5, 3], seq=1 if one_query else 2)  # the owner takes as many new tokens as queries
    batch, total, slots = (torch.export.Dim(n) for n in ("batch", "total", "slots"))
    query_dims = {0: batch} if one_query else {0: batch, 1: torch.export.Dim("seq")}
    program = torch.export.export(module, sample, dynamic_shapes=(
        query_dims, query_dims, query_dims, {0: batch, 2: slots}, {0: batch, 2: slots}, {0: batch, 1: total}))
    model, _ = lower(program, sample, list(INPUTS), OUTPUTS)
    Tidy()(model, settings=None, session=None)  # as the pipeline runs it first: one mask count for every call
    return model


def _count(model: ir.Model, op_type: str) -> int:
    return sum(1 for node in model.graph.all_nodes() if node.op_type == op_type)


def _cache_slices(model: ir.Model) -> int:
    return sum(1 for node in model.graph.all_nodes() if node.op_type == "Slice"
               and (producer := node.inputs[0].producer()) is not None and producer.op_type == "GroupQueryAttention")


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    """(variant, rewritten) -> an ONNX Runtime CPU session of the lowered owner and shared layers."""
    made = {}
    folder = tmp_path_factory.mktemp("matmul_kv_shared_attention")
    for variant, settings in VARIANTS.items():
        for rewritten in (False, True):
            model = _lowered(OwnerAndSharedLayers(*settings))
            if variant == INTERLEAVED:
                for node in model.graph.all_nodes():
                    if node.op_type == "GroupQueryAttention":
                        node.attributes["rotary_interleaved"] = ir.AttrInt64("rotary_interleaved", 1)
            if rewritten:
                assert MatmulKvSharedAttention()(model, settings=None, session=None) == {"layers": 2}
                # Only the owner's GroupQueryAttention is left; both readers share one span and
                # one Slice of each cache.
                assert (_count(model, "GroupQueryAttention"), _count(model, "Range"), _cache_slices(model)) == (1, 1, 2)
            path = folder / f"{len(made)}.onnx"
            ir.save(model, path)
            made[variant, rewritten] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return made


def _run_on_shared_buffer(session: ort.InferenceSession, inputs) -> list:
    """The shared layers' outputs and the owner's buffers after the call, its presents written
    into its past's buffers in place (so their unwritten slots keep their NaN)."""
    binding = session.io_binding()
    arrays = {name: t.numpy().copy() for name, t in zip(INPUTS, inputs, strict=True)}  # the OrtValues' memory
    values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in arrays.items()}
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    binding.bind_output("first_shared")
    binding.bind_output("second_shared")
    binding.bind_ortvalue_output("present_key", values["past_key"])
    binding.bind_ortvalue_output("present_value", values["past_value"])
    session.run_with_iobinding(binding)
    return [*binding.copy_outputs_to_cpu()[:2], arrays["past_key"], arrays["past_value"]]  # bound order


@pytest.mark.l3
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", list(CASES))
def test_matmul_form_gives_the_kernels_output(sessions, case, variant):
    inputs = _inputs(CASES[case])
    rewritten = _run_on_shared_buffer(sessions[variant, True], inputs)
    replaced = _run_on_shared_buffer(sessions[variant, False], inputs)
    # The marker kernel's own multiply would carry NaN from slots it masks; zeros there give what
    # a kernel that never reads them gives.
    clean = [t.nan_to_num(0.0) if t.dim() == 4 else t for t in inputs]
    window, rotary, scale, softcap = VARIANTS[variant]
    want = OwnerAndSharedLayers(window, rotary, scale or HEAD**-0.5, softcap)(*clean)
    for index in (0, 1):  # both shared layers' outputs
        got = torch.from_numpy(rewritten[index])
        assert not got.isnan().any()
        torch.testing.assert_close(got, torch.from_numpy(replaced[index]), rtol=0, atol=TOLERANCE)
        if variant != INTERLEAVED:
            torch.testing.assert_close(got, want[index], rtol=0, atol=TOLERANCE)
    for index in (2, 3):  # the owner's presents are untouched
        torch.testing.assert_close(torch.from_numpy(rewritten[index]), torch.from_numpy(replaced[index]),
                                   rtol=0, atol=0, equal_nan=True)


@pytest.mark.l3
def test_several_queries_per_row_fail():
    """--full-logits runs the whole prompt through the KV-shared layers, and the plan leaves the
    pass out; a KV-shared call it meets on several queries means the truncation did not cut it."""
    model = _lowered(OwnerAndSharedLayers(-1, False), one_query=False)
    with pytest.raises(RuntimeError, match="is not a float32 call on one query per row"):
        MatmulKvSharedAttention()(model, settings=None, session=None)


@pytest.mark.l3
def test_a_kv_shared_call_whose_present_is_read_fails():
    """Nothing should read a KV-shared layer's own present; where something does, the pass says so."""

    class SharedPresentRead(OwnerAndSharedLayers):
        def forward(self, query, new_key, new_value, past_key, past_value, attention_mask):
            gqa = torch.ops.genai_exporter.group_query_attention
            settings = (NUM_HEADS, KV_HEADS, 1.0, 0.0, -1)
            _, owner_key, owner_value = gqa(query, new_key, new_value, past_key, past_value, attention_mask, *settings)
            empty = new_key[:, :0]
            first, shared_key, _ = gqa(query, empty, empty, owner_key, owner_value, attention_mask, *settings)
            second = gqa(query * 0.5, empty, empty, owner_key, owner_value, attention_mask, *settings)[0]
            return first + shared_key.sum(), second, owner_key, owner_value

    model = _lowered(SharedPresentRead(-1, False))
    with pytest.raises(RuntimeError, match="with unread presents"):
        MatmulKvSharedAttention()(model, settings=None, session=None)


@pytest.mark.l1
def test_only_kv_shared_decoders_with_truncated_prefill_on_profiles_that_say_so():
    def settings_for(ep: str, shared: tuple[int, ...] = (4, 5), attention_op: bool = True, full_logits: bool = False):
        return SimpleNamespace(profile=get_profile(ep), attention_op=attention_op, full_logits=full_logits,
                               layout=SimpleNamespace(shared_layer_indices=shared))

    decoder, embedding = SimpleNamespace(is_decoder=True), SimpleNamespace(is_decoder=False)
    attention = MatmulKvSharedAttention()
    assert attention.applies(settings_for("cpu"), decoder)
    assert attention.applies(settings_for("cuda"), decoder) is None  # its kernel was not measured
    assert attention.applies(settings_for("cpu"), embedding) is None
    assert attention.applies(settings_for("cpu", shared=()), decoder) is None
    assert attention.applies(settings_for("cpu", attention_op=False), decoder) is None
    assert attention.applies(settings_for("cpu", full_logits=True), decoder) is None
