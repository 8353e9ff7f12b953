"""L1 / L2: decoder layers copied from the traced layer of the same structure
(``exporter.trace.layer_replicas``) give the graph a trace of every layer gives, and the model's numbers.

Every checkpoint here is the family's test checkpoint (every init constant moved, saved by
``save_pretrained``), so a copy that read the first layer's weights, norms or ``layer_scalar``
instead of its own would show."""

from __future__ import annotations

import json
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch

from exporter import export
from exporter.load.layout import derive_layout
from exporter.load.presets import PRESETS
from exporter.trace import layer_replicas
from exporter.trace.decoder import REPLICATED_LAYERS, GenAIDecoder, make_inputs, trace
from tests.helpers.onnx_graphs import canonical_graph

# A preset for every replicated class, its EP profile, and how many of its layers are traced.
CASES = [
    ("tiny-gemma-4", "cpu", "Gemma4TextDecoderLayer", 5),  # owners, the two storing ones, shared sliding and full
    ("tiny-gemma-4", "webgpu", "Gemma4TextDecoderLayer", 5),
    ("tiny-gemma-4-multimodal", "cpu", "Gemma4TextDecoderLayer", 5),
    ("tiny-llama", "cpu", "LlamaDecoderLayer", 1),
    ("tiny-mistral", "cpu", "MistralDecoderLayer", 1),
    ("tiny-qwen3", "cpu", "Qwen3DecoderLayer", 1),
    ("tiny-phi3", "cpu", "Phi3DecoderLayer", 1),
    ("tiny-gemma2", "cpu", "Gemma2DecoderLayer", 2),  # sliding and full
    ("tiny-granite", "cpu", "GraniteDecoderLayer", 1),
    ("tiny-cohere", "cpu", "CohereDecoderLayer", 1),
    ("tiny-smollm3", "cpu", "SmolLM3DecoderLayer", 2),  # with and without rotary
    ("tiny-gpt-neox", "cpu", "GPTNeoXLayer", 1),
    ("tiny-phi", "cpu", "PhiDecoderLayer", 1),
]


def _graph(path) -> tuple:
    """``canonical_graph``, with the past values' size symbols (``s42``: a copied layer shares its traced
    layer's, where a full trace gives each its own) all one name, and weights folded from a node
    (Gemma 2's ``1 + weight`` norm scales), which carry the node's generated name (``add_9``),
    numbered by first use."""
    nodes, outputs, io = canonical_graph(path)
    folded: dict[str, str] = {}

    def named(item: str) -> str:
        if re.fullmatch(r"weight:[a-z_]+(_\d+)?", item):
            return folded.setdefault(item, f"folded{len(folded)}")
        return item

    nodes = [(domain, op, tuple(named(i) for i in inputs), attributes) for domain, op, inputs, attributes in nodes]
    return nodes, outputs, [(name, re.sub(r'dim_param: "s\d+"', 'dim_param: "free"', kind)
                             if re.fullmatch(r"past_key_values\.\d+\.value", name) else kind) for name, kind in io]


def _checkpoint_folder(name: str, preset_exports, tmp_path: Path) -> Path:
    """The family's test checkpoint; a multimodal one with its processor settings beside it."""
    folder = preset_exports.checkpoint(name).folder
    if not PRESETS[name].processor_settings:
        return folder
    copy = shutil.copytree(folder, tmp_path / "checkpoint")
    (copy / "processor_config.json").write_text(json.dumps(PRESETS[name].processor_settings))
    return copy


@pytest.mark.l1
def test_every_replicated_class_is_compared_with_a_full_trace():
    assert {case[2] for case in CASES} == layer_replicas.REPLICATED_CLASSES


@pytest.mark.l2
@pytest.mark.parametrize(("name", "ep", "traced"), [
    pytest.param(name, ep, traced, marks=pytest.mark.xdist_group(name), id=f"{name}-{ep}")
    for name, ep, _, traced in CASES])
def test_copied_layers_give_the_graph_of_a_full_trace(name, ep, traced, preset_exports, tmp_path, monkeypatch):
    """The same graph node for node (inputs, attributes, weights read; the I/O's named sizes), and
    the same weights file, for every session of the package."""
    folder = str(_checkpoint_folder(name, preset_exports, tmp_path))
    copied = export(folder, ep=ep, output_dir=tmp_path / "copied", cache=False)
    layers = copied.report.layout["num_layers"]
    assert copied.report.sessions["decoder"].tracing == (
        f"{traced} of {layers} decoder layers traced, the other {layers - traced} copied from the traced layer "
        "of the same structure")
    monkeypatch.setattr(layer_replicas, "REPLICATED_CLASSES", frozenset())
    full = export(folder, ep=ep, output_dir=tmp_path / "full", cache=False)
    assert full.report.sessions["decoder"].tracing == "every decoder layer traced"
    models = sorted(p.relative_to(copied.path) for p in copied.path.rglob("*.onnx"))
    assert models == sorted(p.relative_to(full.path) for p in full.path.rglob("*.onnx"))
    for model in models:
        assert _graph(copied.path / model) == _graph(full.path / model), model
        data = model.with_name(model.name + ".data")
        assert (copied.path / data).read_bytes() == (full.path / data).read_bytes(), data


def _outputs(program, model, layout, **padding) -> tuple[list, list]:
    inputs = make_inputs(layout, 2, 4, 7, generator=torch.Generator().manual_seed(1), **padding)
    with torch.no_grad():
        return list(program.module()(*inputs)), list(GenAIDecoder(model, layout)(*inputs))


@pytest.mark.l2
@pytest.mark.xdist_group("tiny-gemma-4")
@pytest.mark.parametrize("padding", [{}, {"past_right_padding": (0, 2)}, {"left_padding": (3, 0)}],
                         ids=["unpadded", "hole-in-past", "left-padded"])
def test_the_copied_program_computes_what_the_model_does(padding, preset_exports):
    """Run in PyTorch, the traced program with 5 of tiny-gemma-4's 10 layers copied gives the
    model's logits and every present key and value, bit for bit (the same ops in the same order)."""
    model = preset_exports.checkpoint("tiny-gemma-4").model
    layout = derive_layout(model)
    program, _ = trace(model, layout)
    assert program.graph_module.meta[REPLICATED_LAYERS] == 5
    assert not any("forward" in vars(layer) for layer in model.model.layers)  # each its class's again
    got, want = _outputs(program, model, layout, **padding)
    assert len(got) == len(want) == 1 + 2 * len(layout.kv_layers)
    for index, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(mine, theirs), index


@pytest.mark.l2
@pytest.mark.xdist_group("tiny-llama")
def test_a_hooked_layer_is_traced_with_its_hook(preset_exports):
    """A forward hook on one layer (a steering vector) would never run in a stand-in: every layer
    is traced, and the hook's addition is in the program."""
    model = preset_exports.checkpoint("tiny-llama").model
    layout = derive_layout(model)
    handle = model.model.layers[2].register_forward_hook(lambda module, args, output: output + 0.5)
    try:
        program, _ = trace(model, layout)
        assert program.graph_module.meta[REPLICATED_LAYERS] == "a decoder layer or one of its modules has a forward hook"
        got, want = _outputs(program, model, layout)
    finally:
        handle.remove()
    without_hook = list(GenAIDecoder(model, layout)(*make_inputs(
        layout, 2, 4, 7, generator=torch.Generator().manual_seed(1))))
    assert not torch.equal(want[0], without_hook[0])
    for mine, theirs in zip(got, want, strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.l1
@pytest.mark.parametrize(("name", "layer_class", "reason"), [
    # Gemma 3n's activation sparsity makes a tensor constant inside the layer, which only the
    # traced layer's program holds.
    pytest.param("tiny-gemma-3n", "Gemma3nTextDecoderLayer", r"layer 0 reads graph input c_\w+ directly",
                 marks=pytest.mark.xdist_group("tiny-gemma-3n")),
    # Gemma 4's mixture-of-experts block: a value made in the layer is read outside it.
    pytest.param("tiny-gemma-4-moe", "Gemma4TextDecoderLayer",
                 r"layer 0's \w+ is read outside it other than through its outputs",
                 marks=pytest.mark.xdist_group("tiny-gemma-4-moe")),
])
def test_a_layer_unsafe_to_copy_is_traced(name, layer_class, reason, preset_exports, monkeypatch):
    """Where the first layer's nodes cannot stand for the others', every layer is traced instead
    and the report says why."""
    monkeypatch.setattr(layer_replicas, "REPLICATED_CLASSES", frozenset({layer_class}))
    model = preset_exports.checkpoint(name).model
    program, _ = trace(model, derive_layout(model))
    said = program.graph_module.meta[REPLICATED_LAYERS]
    assert isinstance(said, str) and re.fullmatch(reason, said), said
    assert not any(n.target in (layer_replicas._BOUNDARY, layer_replicas._STAND_IN) for n in program.graph.nodes)


@pytest.mark.l1
def test_a_stand_in_never_runs_outside_a_trace():
    with pytest.raises(RuntimeError, match="only exists while tracing"):
        layer_replicas.layer_stand_in([torch.zeros(1)], 0, 0, 1)


@pytest.mark.l1
def test_only_transformers_own_classes_are_copied():
    """A remote-code class named like a replicated one was never compared with a full trace."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    remote = type("LlamaDecoderLayer", (torch.nn.Module,), {"__module__": "transformers_modules.someone.model"})
    assert layer_replicas._replicated_class(LlamaDecoderLayer)
    assert not layer_replicas._replicated_class(remote)



@pytest.mark.l2
@pytest.mark.xdist_group("tiny-llama")
def test_a_second_thread_tracing_the_same_model_traces_every_layer(preset_exports):
    """While one trace has stand-ins in a model's layers, another thread's trace of that model
    runs the layers' own forwards (and says why it copied none), leaving the first trace's records
    alone."""
    model = preset_exports.checkpoint("tiny-llama").model
    layout = derive_layout(model)
    wrapper = GenAIDecoder(model, layout)
    results = {}
    with layer_replicas.stand_ins(wrapper, wrapper.cache_entry) as replicas:
        assert isinstance(replicas, layer_replicas.Replicas)
        thread = threading.Thread(target=lambda: results.update(program=trace(model, layout)[0]))
        thread.start()
        thread.join()
        assert replicas.traced == {}
    program = results["program"]
    assert program.graph_module.meta[REPLICATED_LAYERS] == "another thread is tracing the same model"
    got, want = _outputs(program, model, layout)
    for mine, theirs in zip(got, want, strict=True):
        assert torch.equal(mine, theirs)
