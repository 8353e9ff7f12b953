"""L2 / L1: GroupQueryAttention substitution, run in PyTorch against the untouched program, and
the graph facts it relies on (attention cores, mask probing)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ep_profiles import get_profile
from exporter.load.layout import derive_layout
from exporter.load.presets import build_preset
from exporter.trace.decoder import make_inputs, trace
from fx_passes import FX_PASSES, run_fx_passes
from fx_passes.analyses.attention_cores import find_attention_cores
from fx_passes.analyses.graph_facts import PassDidNotApply
from fx_passes.analyses.mask_probe import causal_window, decode_step_agrees
from tests.helpers.families import FAMILIES, MIXTURE_OF_EXPERTS_FAMILIES, PLAIN_ATTENTION_LAYERS
from tests.helpers.plan_settings import DECODER, pass_settings

GQA = torch.ops.genai_exporter.group_query_attention.default
SDPA = torch.ops.aten.scaled_dot_product_attention.default
# The marker's reference kernel runs the same fp32 math in another order (one softmax over the
# whole compact cache instead of transformers' masked one): observed <= 3e-6 on logits.
TOLERANCE = 1e-5
PASSES = ["drop_runtime_asserts", "drop_noop_casts", "complex_as_real_pairs", "substitute_group_query_attention"]


def _cases(layout):
    """Shapes ONNX Runtime GenAI sends: past=0, seq=1, batch>1, longer than the sliding window,
    and its right padding (a padded prompt, then the hole it leaves before new tokens)."""
    generator = torch.Generator().manual_seed(0)
    long = (layout.sliding_window or 8) + 5
    return [
        make_inputs(layout, 1, 7, 0, generator=generator),
        make_inputs(layout, 1, long, 0, generator=generator),
        make_inputs(layout, 3, 1, 9, generator=generator),
        make_inputs(layout, 1, 1, long, generator=generator),
        make_inputs(layout, 1, 4, long, generator=generator),
        make_inputs(layout, 2, 6, 0, generator=generator, right_padding=(0, 3)),
        make_inputs(layout, 2, 1, long, generator=generator, past_right_padding=(0, 3)),
    ]


def assert_same_results(inputs, got, want, tolerance=TOLERANCE, holes=()):
    """Logits at real query positions; each row's present KV compared over its real tokens,
    which GroupQueryAttention keeps first in the row (transformers keeps them where the mask
    says, with the right-padding hole in between). ``holes``: indices of present outputs written
    by layers that keep transformers' attention, so kept with the hole."""
    real = inputs[1].bool()
    queries = real[:, real.shape[1] - inputs[0].shape[1] :]
    if got[0].shape[1] == 1 and want[0].shape[1] != 1:
        last = [int(torch.nonzero(row).max()) for row in queries]
        want = (torch.stack([want[0][b, j] for b, j in enumerate(last)])[:, None], *want[1:])
        queries = torch.ones(len(last), 1, dtype=torch.bool)
    torch.testing.assert_close(got[0][queries], want[0][queries], rtol=0, atol=tolerance)
    for index, (got_kv, want_kv) in enumerate(zip(got[1:], want[1:], strict=True)):
        for row in range(len(real)):
            count = int(real[row].sum())
            kept = got_kv[row][:, real[row]] if index in holes else got_kv[row, :, :count]
            torch.testing.assert_close(kept, want_kv[row][:, real[row]], rtol=0, atol=tolerance)


# Layers whose rotary embedding GroupQueryAttention does not apply itself, by family: Cohere
# rotates interleaved pairs, Phi and GPT-NeoX only part of each head (Phi-3's partial-rotary code
# path at full width is matched), so their q/k arrive rotated; SmolLM3's every fourth layer has no
# rotary at all.
ROTATED_OUTSIDE_ATTENTION = {"tiny-cohere": 4, "tiny-phi": 4, "tiny-gpt-neox": 4, "tiny-smollm3": 1,
                             "tiny-llama4": 1}  # Llama 4: its one GroupQueryAttention layer is NoPE


def _substituted(name, passes=PASSES, attention_rotary=True, profile=None, sinks=None):
    """``sinks``: gpt-oss's sink logits set to draws of this size (init leaves them near 0, where a
    dropped sink would not show)."""
    model, _ = build_preset(name)
    if sinks is not None:
        generator = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if parameter_name.endswith("sinks"):
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * sinks)
    layout = derive_layout(model)
    program, _ = trace(model, layout)
    cases = _cases(layout)
    with torch.no_grad():
        before = [program.module()(*inputs) for inputs in cases]
    profile = profile or dataclasses.replace(get_profile("cpu"), attention_rotary=attention_rotary)
    settings = pass_settings(profile, layout)
    program, records = run_fx_passes(program, [FX_PASSES[n] for n in passes], settings, DECODER)
    return layout, program, cases, before, records[-1].changes


@pytest.mark.l2
@pytest.mark.parametrize("name", FAMILIES)
def test_substitution_keeps_results(name):
    layout, program, cases, before, changes = _substituted(name)
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    plain = PLAIN_ATTENTION_LAYERS.get(name, [])
    assert targets.count(GQA) == layout.num_layers - len(plain) and changes["layers"] == layout.num_layers
    assert sorted(changes["plain_layers"]) == plain
    assert targets.count(SDPA) == len(plain)  # the layers GroupQueryAttention cannot take keep theirs
    # Every softmax left is a mixture-of-experts router's (transformers' ...Router modules).
    softmaxes = [n for n in program.graph.nodes if n.target is torch.ops.aten.softmax.int]
    assert bool(softmaxes) == (name in MIXTURE_OF_EXPERTS_FAMILIES)
    assert all(list(n.meta["nn_module_stack"].values())[-1][1].endswith("Router") for n in softmaxes)
    assert changes["rotary_in_attention_layers"] == layout.num_layers - len(plain) - ROTATED_OUTSIDE_ATTENTION.get(name, 0)
    # The present outputs (keys, values per KV layer) of the layers that keep their attention.
    holes = {2 * slot + i for slot, layer in enumerate(layout.kv_layer_indices) if layer in plain for i in (0, 1)}
    with torch.no_grad():
        for inputs, want in zip(cases, before, strict=True):
            assert_same_results(inputs, program.module()(*inputs), want, holes=holes)


@pytest.mark.l2
def test_substitution_on_rotated_inputs_keeps_results():
    """Profiles with attention_rotary off pass rotated q/k (the baseline form)."""
    _, program, cases, before, changes = _substituted("tiny-gemma-4", attention_rotary=False)
    assert changes["rotary_in_attention_layers"] == 0
    assert all(len(n.args) == 11 for n in program.graph.nodes if n.target is GQA)  # no cos/sin caches
    with torch.no_grad():
        for inputs, want in zip(cases, before, strict=True):
            assert_same_results(inputs, program.module()(*inputs), want)


WINDOWED = torch.ops.genai_exporter.window_attention.default
WINDOW_SLOTS = torch.ops.genai_exporter.sliding_window_slots.default
ROTARY = torch.ops.genai_exporter.rotary_embedding.default


@pytest.mark.l2
@pytest.mark.parametrize("name", ["tiny-gemma-4", "tiny-gemma2"])
def test_window_mask_profile_keeps_results(name):
    """A profile whose GroupQueryAttention cannot be trusted with windows or softcaps (webgpu):
    sliding layers attend through ``window_attention`` over the window's slots of the cache buffer,
    and soft-capped full layers (Gemma 2) over every slot of it; owners still write it with
    GroupQueryAttention (no window), KV-shared sliding layers have no GroupQueryAttention."""
    layout, program, cases, before, changes = _substituted(name, profile=get_profile("webgpu"))
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    sliding, full_span = changes["sliding_window_layers"], changes["full_span_layers"]
    assert full_span == (2 if name == "tiny-gemma2" else 0)  # Gemma 2's two full layers are soft-capped
    assert sliding > 0 and changes["window_mask_layers"] == sliding + full_span == targets.count(WINDOWED)
    # One span per window and KV shape, computed once per step: the sliding window's, and the
    # buffer's (the context GenAI allocates) for full-span layers.
    windows = sorted(n.args[2] for n in program.graph.nodes if n.target is WINDOW_SLOTS)
    assert windows == [layout.sliding_window] + ([get_profile("webgpu").capped_context(layout.context_length)]
                                                 if full_span else [])
    # Sliding owners' GroupQueryAttention only writes the cache: one head per KV head, the key as query.
    writers = [n for n in program.graph.nodes if n.target is GQA and not any(u.args[1] == 0 for u in n.users)]
    assert writers and all(n.args[0] is n.args[1] and n.args[6] == n.args[7] for n in writers)
    if name == "tiny-gemma-4":  # queries rotated by ONNX Runtime's RotaryEmbedding, keys by GroupQueryAttention
        assert targets.count(ROTARY) == sliding + full_span
        assert changes["rotary_in_attention_layers"] == layout.num_layers
    types = build_preset(name)[0].config.layer_types
    sliding_shared = sum(1 for i in layout.shared_layer_indices if types[i] == "sliding_attention")
    assert targets.count(GQA) == layout.num_layers - sliding_shared
    assert all(n.args[10] == 0 for n in program.graph.nodes if n.target is GQA)  # no window left to GQA
    with torch.no_grad():
        for inputs, want in zip(cases, before, strict=True):
            assert_same_results(inputs, program.module()(*inputs), want)


@pytest.mark.l2
def test_substitution_reads_each_model_from_its_graph():
    """Windows, soft-caps and KV sharing come from the graph: Gemma 4 slides in 8 of 10 layers and
    shares 4 caches; gemma2 alternates windows and soft-caps every layer."""
    _, program, *_, gemma4 = _substituted("tiny-gemma-4")
    # One cos/sin cache pair per rotary table: sliding layers and (proportional) full layers.
    assert sorted(k for k in program.state_dict if k.startswith("rotary_")) == [
        "rotary_0.cos_cache", "rotary_0.sin_cache", "rotary_1.cos_cache", "rotary_1.sin_cache"]
    assert gemma4 == {"layers": 10, "kv_shared_layers": 4, "sliding_window_layers": 8, "soft_capped_layers": 0,
                      "attention_sink_layers": 0, "rotary_in_attention_layers": 10, "window_mask_layers": 0, "full_span_layers": 0,
                      "substituted_layers": list(range(10)),
                      "plain_layers": {}}
    layout, program, *_, gemma2 = _substituted("tiny-gemma2")
    assert (gemma2["sliding_window_layers"], gemma2["soft_capped_layers"]) == (2, 4)
    markers = [n for n in program.graph.nodes if n.target is GQA]
    window = layout.sliding_window
    assert [m.args[8:11] for m in markers] == [(0.0625, 50.0, window), (0.0625, 50.0, 0)] * 2  # scale, softcap, window


@pytest.mark.l2
@pytest.mark.parametrize("profile", ["cpu", "webgpu"])
def test_substitution_works_with_prefill_truncation(profile):
    """webgpu: the window attention's shared slots and bias, and the position ids its rotary
    reads, cross into the layers that run on the last token only."""
    passes = [*PASSES, "gather_last_token", "truncate_shared_kv_layers"]
    _, program, cases, before, _ = _substituted("tiny-gemma-4", passes, profile=get_profile(profile))
    with torch.no_grad():
        for inputs, want in zip(cases, before, strict=True):
            got = program.module()(*inputs)
            assert got[0].shape[1] == 1
            assert_same_results(inputs, got, want)


@pytest.mark.l2
@pytest.mark.parametrize("profile", ["cpu", "webgpu"])
def test_attention_sinks_become_head_sink(profile):
    """gpt-oss appends a learned logit per head to the scores, shifts by the row maximum, and drops
    the sink's column after the softmax: every layer's attention takes the sinks as [heads]
    (GroupQueryAttention's ``head_sink``; on webgpu, whose kernel drops windows, the sliding
    layers' ``window_attention``), and computes what transformers' eager attention did."""
    layout, program, cases, before, changes = _substituted("tiny-gpt-oss", profile=get_profile(profile), sinks=2.0)
    assert changes["plain_layers"] == {} and changes["attention_sink_layers"] == layout.num_layers == 4
    heads = build_preset("tiny-gpt-oss")[0].config.num_attention_heads
    attending = [n for n in program.graph.nodes
                 if n.target is WINDOWED or (n.target is GQA and any(u.args[1] == 0 and u.users for u in n.users))]
    assert len(attending) == layout.num_layers
    sinks = [n.args[13] if n.target is GQA else n.args[8] for n in attending]
    assert all(tuple(sink.meta["val"].shape) == (heads,) for sink in sinks) and len(set(sinks)) == layout.num_layers
    assert sum(n.target is WINDOWED for n in attending) == (changes["sliding_window_layers"] if profile == "webgpu" else 0)
    assert not any(n.target is torch.ops.aten.softmax.int for n in program.graph.nodes
                   if "self_attn" in str(n.meta.get("nn_module_stack", "")))
    with torch.no_grad():
        for inputs, want in zip(cases, before, strict=True):
            assert_same_results(inputs, program.module()(*inputs), want)


@pytest.mark.l2
def test_a_kernel_that_drops_sinks_keeps_plain_attention():
    """A profile whose GroupQueryAttention ignores ``head_sink``: the sink layers keep transformers'
    attention, with the reason, and compute what they did."""
    cpu = get_profile("cpu")
    profile = dataclasses.replace(cpu, attention_kernel=dataclasses.replace(cpu.attention_kernel, head_sink=False))
    layout, program, cases, before, changes = _substituted("tiny-gpt-oss", profile=profile, sinks=2.0)
    assert sorted(changes["plain_layers"]) == list(range(layout.num_layers))
    assert all("drops its attention sinks" in why for why in changes["plain_layers"].values())
    assert not any(n.target is GQA for n in program.graph.nodes)
    holes = set(range(2 * layout.num_layers))
    with torch.no_grad():
        for inputs, want in zip(cases, before, strict=True):
            assert_same_results(inputs, program.module()(*inputs), want, holes=holes)


class _SinkAttention(torch.nn.Module):
    """Eager attention with a sink column, the row-max shift placed where ``shift_at`` says."""

    def __init__(self, shift_at: str, sinks_dtype=torch.float32):
        super().__init__()
        self.shift_at = shift_at
        self.sinks = torch.nn.Parameter(torch.randn(4).to(sinks_dtype))

    def forward(self, query, key, value, mask):
        scores = torch.matmul(query, key.transpose(2, 3)) * 0.25 + mask
        if self.shift_at == "before the sink":
            scores = scores - scores.max(dim=-1, keepdim=True).values
        sinks = self.sinks
        combined = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
        if self.shift_at == "before the softmax":
            combined = combined - combined.max(dim=-1, keepdim=True).values
        weights = torch.softmax(combined, dim=-1)[..., :-1]
        return torch.matmul(weights if weights.dtype == value.dtype else weights.to(value.dtype), value)


@pytest.mark.unit
@pytest.mark.parametrize(("shift_at", "cores"), [("before the softmax", 1), ("before the sink", 0), ("none", 1)])
def test_a_sink_core_is_read_only_where_its_shift_changes_nothing(shift_at, cores):
    """The shift by the row maximum is what a softmax does anyway only where the softmax reads it;
    before the sink column is appended it changes the result, and the chain is not a core."""
    inputs = (torch.randn(1, 4, 3, 8), torch.randn(1, 4, 5, 8), torch.randn(1, 4, 5, 8), torch.zeros(1, 1, 3, 5))
    program = torch.export.export(_SinkAttention(shift_at), inputs)
    found = find_attention_cores(program)
    assert len(found) == cores
    assert all(core.sink is not None and tuple(core.sink.meta["val"].shape) == (1, 4, 1, 1) for core in found)


@pytest.mark.unit
def test_sinks_in_another_dtype_than_the_scores_are_refused():
    """GroupQueryAttention takes head_sink in the query's type: fp32 sinks beside fp16 scores (the
    cat promotes, as eager attention would) are not taken, so the model's layers stay plain."""
    inputs = tuple(t.half() for t in (torch.randn(1, 4, 3, 8), torch.randn(1, 4, 5, 8), torch.randn(1, 4, 5, 8),
                                      torch.zeros(1, 1, 3, 5)))
    program = torch.export.export(_SinkAttention("none", torch.float32), inputs)
    with pytest.raises(PassDidNotApply, match="sink logits in torch.float32, scores in torch.float16"):
        find_attention_cores(program)


@pytest.mark.l1
def test_mask_probe_reads_causal_and_sliding_masks():
    positions = torch.arange(10)
    causal = positions[None, :] <= positions[:, None]
    assert causal_window(causal, "m") == 0
    assert causal_window(causal & (positions[None, :] > positions[:, None] - 4), "m") == 4
    additive = torch.zeros(10, 10).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert causal_window(additive[None, None], "m") == 0
    with pytest.raises(PassDidNotApply, match="neither causal nor a causal sliding window"):
        causal_window(torch.ones(10, 10, dtype=torch.bool), "bidirectional")
    with pytest.raises(PassDidNotApply, match="adds a bias"):  # e.g. ALiBi: 0 on the diagonal only
        causal_window(-(positions[:, None] - positions[None, :]).abs().float()[None, None], "alibi")
    # A window wider than the prompt probe shows on a decode step at the end of the context.
    last_step = torch.arange(100)[None, :] >= 100 - 40
    decode_step_agrees(last_step, 40, "m")
    with pytest.raises(PassDidNotApply, match="query see 40 of 100 keys, not 100"):
        decode_step_agrees(last_step, 0, "m")


@pytest.mark.l1
def test_attention_it_cannot_express_stays_plain_not_dropped():
    """An op between the scores and the softmax that GroupQueryAttention has no input for (here
    an extra bias added to the gemma2 scores) is never dropped: the pass leaves every layer with
    transformers' attention, that op included, and says why (a model the pass was not built for
    exports plain instead of failing)."""
    model, _ = build_preset("tiny-gemma2")
    layout = derive_layout(model)
    program, _ = trace(model, layout)
    tanh = next(n for n in program.graph.nodes if n.target is torch.ops.aten.tanh.default)
    with program.graph.inserting_after(tanh):
        bias = program.graph.call_function(torch.ops.aten.sub.Tensor, (tanh, tanh))
    tanh.replace_all_uses_with(bias, delete_user_cb=lambda user: user is not bias)
    settings = pass_settings(get_profile("cpu"), layout)
    program, changes = FX_PASSES["substitute_group_query_attention"](program, settings, DECODER)
    assert sorted(changes["plain_layers"]) == list(range(layout.num_layers)) and not changes["substituted_layers"]
    assert all("attention scores pass through aten.sub.Tensor" in why for why in changes["plain_layers"].values())
    assert bias in program.graph.nodes and not any(n.target is GQA for n in program.graph.nodes)
    assert FX_PASSES["substitute_group_query_attention"].findings(changes) == {
        "plain_attention_layers": changes["plain_layers"]}


@pytest.mark.l1
def test_rotary_stays_outside_attention_for_head_sizes_ort_cannot_rotate():
    """ONNX Runtime 1.32's GroupQueryAttention rotates only head sizes that are multiples of 16."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    model = transformers.LlamaForCausalLM(config).eval()
    layout = derive_layout(model)
    program, _ = trace(model, layout)
    settings = pass_settings(get_profile("cpu"), layout)
    program, records = run_fx_passes(program, [FX_PASSES[n] for n in PASSES], settings, DECODER)
    assert records[-1].changes["layers"] == 2
    assert records[-1].changes["rotary_in_attention_layers"] == 0


@pytest.mark.l1
@pytest.mark.parametrize(("facts", "window", "softcap", "expected"), [
    ({}, 8, 50.0, 0),  # a kernel that honours both: GroupQueryAttention takes the layer
    ({"window_in_every_call": False}, 8, 0.0, 8),  # the window is dropped: the graph's own over 8 slots
    ({"window_in_every_call": False}, 0, 0.0, 0),  # a full layer without softcap keeps the kernel
    ({"softcap": False}, 0, 50.0, 4096),  # a soft-capped full layer: every slot of the buffer
    ({"softcap": False}, 8, 50.0, 8),  # a soft-capped sliding layer: its window
    ({"softcap": False}, 0, 0.0, 0),
    ({"exact_query_rows": 31}, 0, 0.0, 4096),  # a kernel wrong on long prompts everywhere: every layer
    ({"software_adapter_query_rows": 31}, 0, 0.0, 0),  # a software adapter's fault is not routed around
])
def test_each_layer_attends_where_the_kernel_keeps_its_semantics(facts, window, softcap, expected):
    from ep_profiles import AttentionKernel
    from fx_passes.substitute_group_query_attention import _graph_window

    core = dataclasses.make_dataclass("Core", ["softcap"])(softcap)
    assert _graph_window(core, window, AttentionKernel(**facts), 4096) == expected


@pytest.mark.l1
def test_layers_without_a_layers_n_path_still_take_group_query_attention(monkeypatch):
    """A core's layer number comes from a ``layers.N`` module path; blocks named otherwise (GPT-2's
    ``transformer.h.N``) give none. One core per decoder layer is what the pass needs: every layer
    still takes GroupQueryAttention, none falls back."""
    from fx_passes.analyses import attention_cores

    model, _ = build_preset("tiny-llama")
    layout = derive_layout(model)
    program, _ = trace(model, layout)
    monkeypatch.setattr(attention_cores, "layer_index", lambda node: None)
    program, changes = FX_PASSES["substitute_group_query_attention"](program, pass_settings(get_profile("cpu"), layout),
                                                                     DECODER)
    assert not changes["plain_layers"]
    assert sum(n.target is GQA for n in program.graph.nodes) == layout.num_layers
