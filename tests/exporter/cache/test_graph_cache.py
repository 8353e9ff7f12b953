"""The graph cache: a re-export of the same architecture and options with other weights reuses the
lowered graph, and its package is byte-identical to one exported without the cache; anything that
changes the graph misses; a broken or unwritable cache costs time, never a wrong package."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ep_profiles import get_profile
from exporter import export
from exporter.cache import graph_cache
from exporter.load.presets import PRESETS, build_preset
from exporter.weights.stores import ModelWeights
from tests.helpers.checkpoints import save_checkpoint, take_training_step, training_run_checkpoint

PACKAGE_FILES = ("model.onnx", "model.onnx.data", "genai_config.json")
PRESET = "tiny-gemma-4"  # layer_scalar buffers, KV-shared layers, a tied head: every kind of saved tensor


def digests(folder: Path) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in PACKAGE_FILES}


def trained(seed: int):
    return training_run_checkpoint(PRESET, seed)


def stage_names(package) -> list[str]:
    return [stage["name"] for stage in package.report.stages]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("graph-cache-checkpoints")
    folders = []
    for seed in (0, 1):
        model, tokenizer = trained(seed)
        folders.append(save_checkpoint(model, tokenizer, root / f"step{seed}"))
    return folders


@pytest.fixture(scope="module")
def first_export(checkpoints, tmp_path_factory):
    """The first checkpoint exported into an empty cache (a copy per test that changes the cache)."""
    root = tmp_path_factory.mktemp("graph-cache-first")
    package = export(str(checkpoints[0]), output_dir=root / "package", cache=root / "cache")
    return package, root / "cache"


def cache_copy(first_export, tmp_path) -> Path:
    shutil.copytree(first_export[1], tmp_path / "cache")
    return tmp_path / "cache"


@pytest.mark.l1
def test_reexport_of_another_checkpoint_reuses_the_graph_and_is_byte_identical(first_export, checkpoints, tmp_path):
    first, cache = first_export
    assert first.report.graph_cache["sessions"] == {"decoder": "written"}
    assert "trace" in stage_names(first)

    again = export(str(checkpoints[1]), output_dir=tmp_path / "again", cache=cache_copy(first_export, tmp_path))
    assert again.report.graph_cache["sessions"] == {"decoder": "hit"}
    assert again.report.graph_cache["key"] == first.report.graph_cache["key"]
    assert stage_names(again) == ["load", "graph_cache", "onnx_passes", "package"]

    uncached = export(str(checkpoints[1]), output_dir=tmp_path / "uncached", cache=False)
    assert uncached.report.graph_cache == {"off": "cache=False (--no-cache)"}
    assert digests(again.path) == digests(uncached.path)
    # The hit read the second checkpoint's weights, not the first's.
    assert digests(again.path)["model.onnx.data"] != digests(first.path)["model.onnx.data"]


@pytest.mark.l1
def test_in_memory_model_after_more_training_steps_hits_with_its_new_weights(tmp_path):
    """A training loop's exports: the same model object, its weights changed in place."""
    model, tokenizer = trained(0)
    cache = tmp_path / "cache"
    first = export(model, tokenizer, output_dir=tmp_path / "first", cache=cache)
    take_training_step(model, seed=7)
    again = export(model, tokenizer, output_dir=tmp_path / "again", cache=cache)
    assert again.report.graph_cache["sessions"] == {"decoder": "hit"}
    uncached = export(model, tokenizer, output_dir=tmp_path / "uncached", cache=False)
    assert digests(again.path) == digests(uncached.path)
    assert digests(again.path)["model.onnx.data"] != digests(first.path)["model.onnx.data"]


@pytest.mark.l1
@pytest.mark.slow
def test_what_changes_the_graph_changes_the_key(first_export, checkpoints, tmp_path):
    """An option, and a config value that changes no tensor's shape, each miss."""
    first, cache = first_export
    window = tmp_path / "window"
    shutil.copytree(checkpoints[0], window)
    config = json.loads((window / "config.json").read_text())
    config["sliding_window"] //= 2
    (window / "config.json").write_text(json.dumps(config))
    keys = {first.report.graph_cache["key"]}
    for name, source, options in (("full logits", checkpoints[0], {"full_logits": True}),
                                  ("half the window", window, {})):
        package = export(str(source), output_dir=tmp_path / name / "package",
                         cache=cache_copy(first_export, tmp_path / name), **options)
        assert package.report.graph_cache["sessions"] == {"decoder": "written"}, name
        keys.add(package.report.graph_cache["key"])
    assert len(keys) == 3


@pytest.mark.l1
def test_models_running_code_no_key_sees_are_not_cached(tmp_path):
    model, tokenizer = build_preset("tiny-llama")
    handle = model.model.layers[0].mlp.register_forward_hook(lambda module, args, output: output * 2)
    try:
        package = export(model, tokenizer, output_dir=tmp_path / "hooked", cache=tmp_path / "cache")
    finally:
        handle.remove()
    assert package.report.graph_cache == {"off": "module 'model.layers.0.mlp' has forward hooks"}
    assert not (tmp_path / "cache").exists()


@pytest.mark.l1
def test_a_torn_entry_is_a_miss_and_is_rewritten(first_export, checkpoints, tmp_path):
    first, _ = first_export
    cache = cache_copy(first_export, tmp_path)
    graph = cache / first.report.graph_cache["key"] / "decoder.onnx"
    graph.write_bytes(graph.read_bytes()[:-10])
    again = export(str(checkpoints[0]), output_dir=tmp_path / "again", cache=cache)
    assert again.report.graph_cache["sessions"] == {"decoder": "written"}
    assert digests(again.path) == digests(first.path)
    third = export(str(checkpoints[0]), output_dir=tmp_path / "third", cache=cache)
    assert third.report.graph_cache["sessions"] == {"decoder": "hit"}


@pytest.mark.l1
def test_an_unwritable_cache_does_not_fail_the_export(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    model, tokenizer = build_preset("tiny-llama")
    package = export(model, tokenizer, output_dir=tmp_path / "out", cache=blocker / "cache")
    assert package.report.graph_cache["sessions"]["decoder"].startswith("not written")
    uncached = export(model, tokenizer, output_dir=tmp_path / "uncached", cache=False)
    assert digests(package.path) == digests(uncached.path)


@pytest.mark.l1
def test_an_altered_record_is_a_miss(first_export, checkpoints, tmp_path):
    """The entry's digest covers the weight recipes too: one pointing an initializer at another
    tensor must not be used."""
    first, _ = first_export
    cache = cache_copy(first_export, tmp_path)
    record_path = cache / first.report.graph_cache["key"] / "decoder.json"
    record = json.loads(record_path.read_text())
    names = sorted(record["recipes"])
    record["recipes"][names[0]], record["recipes"][names[1]] = record["recipes"][names[1]], record["recipes"][names[0]]
    record_path.write_text(json.dumps(record))
    entry = graph_cache.GraphCache(cache, first.report.graph_cache["key"])
    assert entry.read("decoder") is None
    del record["recipes"]
    record_path.write_text(json.dumps(record))
    assert entry.read("decoder") is None


def cache_key(model) -> str | dict:
    """The key an fp32 cpu export of ``model`` in memory gets (or why it gets none)."""
    from exporter.load.layout import derive_layout
    from exporter.plan import export_settings, make_plan

    settings = export_settings(get_profile("cpu"), derive_layout(model), "fp32")
    ingredients = graph_cache.key_ingredients(model, ModelWeights(model), settings, make_plan(settings))
    return ingredients if isinstance(ingredients, str) else graph_cache.key_of(ingredients)


@pytest.mark.l1
def test_code_and_attributes_a_trace_reads_are_in_the_key(monkeypatch):
    """What changes the traced graph without changing the config or any tensor's shape: a module
    attribute set after the model was built, a method or a module function patched at run time
    (as Liger or Unsloth patch models), the attention implementation."""
    from transformers.models.llama import modeling_llama

    model, _ = build_preset("tiny-llama")
    base = cache_key(model)
    assert base == cache_key(model)

    model.model.layers[0].self_attn.scaling = 0.5
    assert cache_key(model) != base
    model, _ = build_preset("tiny-llama")
    assert cache_key(model) == base
    model.model.layers[0].self_attn.scaling = np.float32(0.5)
    assert cache_key(model) != base
    model, _ = build_preset("tiny-llama")

    original_forward = modeling_llama.LlamaMLP.forward
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: original_forward(self, x) * 2)
    assert cache_key(model) != base
    monkeypatch.undo()
    assert cache_key(model) == base

    monkeypatch.setattr(modeling_llama, "rotate_half", lambda x: -x)
    assert cache_key(model) != base
    monkeypatch.undo()

    model.set_attn_implementation("eager")
    assert cache_key(model) != base


@pytest.mark.l1
def test_gradient_checkpointing_input_hook_keeps_the_cache():
    """transformers puts a forward hook on the input embeddings for gradient checkpointing (PEFT
    training does it): it makes the output require grads and changes no traced value."""
    model, _ = build_preset("tiny-llama")
    model.enable_input_require_grads()
    assert re.fullmatch("[0-9a-f]{32}", cache_key(model))
    model.model.layers[0].mlp.register_forward_hook(lambda module, args, output: output)
    assert cache_key(model) == "module 'model.layers.0.mlp' has forward hooks"


@pytest.mark.l1
def test_a_key_that_cannot_be_computed_turns_the_cache_off(monkeypatch, tmp_path):
    def unreadable(*args, **kwargs):
        raise RuntimeError("an attribute that cannot be read")

    monkeypatch.setattr(graph_cache, "key_ingredients", unreadable)
    model, tokenizer = build_preset("tiny-llama")
    package = export(model, tokenizer, output_dir=tmp_path / "out", cache=tmp_path / "cache")
    assert package.report.graph_cache == {
        "off": "the key could not be computed (RuntimeError: an attribute that cannot be read)"}
    assert (package.path / "model.onnx").is_file()


@pytest.mark.l1
def test_a_class_without_source_file_is_not_cached():
    model, _ = build_preset("tiny-llama")
    namespace = {"__name__": "notebook_cell"}
    exec("import torch\nclass Doubled(torch.nn.Module):\n    def forward(self, x):\n        return 2 * x\n", namespace)
    model.model.layers[0].mlp.act_fn = namespace["Doubled"]()
    assert cache_key(model) == ("class notebook_cell.Doubled has no source file (defined in a notebook, on stdin or "
                                "by exec), so no key can see its code")


@pytest.mark.l1
@pytest.mark.slow
def test_cli_default_folder_follows_xdg_and_serves_another_process(first_export, checkpoints, tmp_path):
    """The key is stable across processes (another string-hash seed); ``--no-cache`` turns the
    cache off."""
    env = {key: value for key, value in os.environ.items() if key != graph_cache.NO_CACHE_VARIABLE}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    graphs = tmp_path / "xdg" / "genai-exporter" / "graphs"
    shutil.copytree(first_export[1], graphs)  # written by this process

    def cli(folder, out, *flags):
        result = subprocess.run([sys.executable, "-m", "exporter", str(folder), "-o", str(tmp_path / out), "--json",
                                 *flags], env=dict(env, PYTHONHASHSEED="12345"), capture_output=True, text=True,
                                check=False)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["graph_cache"]

    hit = cli(checkpoints[1], "second")
    assert hit["folder"] == str(graphs)
    assert hit["sessions"] == {"decoder": "hit"}
    assert cli(checkpoints[1], "off", "--no-cache") == {"off": "cache=False (--no-cache)"}


@pytest.mark.l1
def test_where_the_cache_is(monkeypatch, tmp_path):
    monkeypatch.delenv(graph_cache.NO_CACHE_VARIABLE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert graph_cache.chosen_folder(True) == tmp_path / "genai-exporter" / "graphs"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert graph_cache.chosen_folder(True) == Path.home() / ".cache" / "genai-exporter" / "graphs"
    assert graph_cache.chosen_folder(tmp_path / "mine") == tmp_path / "mine"
    assert graph_cache.chosen_folder(False) is None
    monkeypatch.setenv(graph_cache.NO_CACHE_VARIABLE, "1")
    assert graph_cache.chosen_folder(True) is None


@pytest.mark.l1
def test_prune_removes_least_recently_used_entries_and_nothing_else(tmp_path):
    """Only entries go: a folder given with --cache-dir may hold a user's checkpoints."""
    entries = {}
    for age, name in enumerate(("old", "middle", "new", "kept")):
        folder = entries[name] = tmp_path / hashlib.sha256(name.encode()).hexdigest()[:32]
        folder.mkdir()
        (folder / graph_cache.KEY_FILENAME).write_text("{}")
        (folder / "decoder.onnx").write_bytes(b"x" * 98)
        os.utime(folder, (1000 + age, 1000 + age))
    for foreign in ("checkpoint-500", "0" * 32):  # a user's folder; a key-named folder that is no entry
        (tmp_path / foreign).mkdir()
        (tmp_path / foreign / "model.safetensors").write_bytes(b"w" * 1000)
        os.utime(tmp_path / foreign, (1, 1))
    # A replay record written as a hidden folder: one left by a killed write an hour ago goes, one
    # being written now stays.
    killed, writing = tmp_path / f".{'a' * 32}.x1", tmp_path / f".{'b' * 32}.x2"
    for folder in (killed, writing):
        folder.mkdir()
        (folder / "literals.bin").write_bytes(b"l")
    os.utime(killed, (1, 1))
    removed = graph_cache.prune(tmp_path, keep=entries["kept"], max_bytes=250)
    assert removed == [entries["old"], entries["middle"]]
    assert {p.name for p in tmp_path.iterdir()} == {entries["new"].name, entries["kept"].name, "checkpoint-500", "0" * 32,
                                                    writing.name}


@pytest.mark.l1
def test_bad_cache_arguments_are_one_line_errors(tmp_path):
    from exporter import ExporterError
    from exporter.cli import main

    with pytest.raises(ExporterError, match="cache must be True, False or a folder, not None"):
        export("tiny-llama", output_dir=tmp_path / "out", cache=None)
    with pytest.raises(SystemExit) as exit_info:
        main(["tiny-llama", "-o", str(tmp_path / "cli"), "--no-cache", "--cache-dir", str(tmp_path / "c")])
    assert exit_info.value.code == 2
    assert not (tmp_path / "out").exists() and not (tmp_path / "cli").exists()


@pytest.mark.l1
@pytest.mark.slow
def test_a_multimodal_package_hits_in_every_session(tmp_path):
    """Four sessions, four entries: the model in memory re-exported after a training step hits in
    each, reads its new weights in each, and every file of the package but the report equals an
    export without the cache."""
    def files(folder: Path) -> dict[str, str]:
        return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.startswith("export_report")}

    preset = "tiny-gemma-4-multimodal"
    model, tokenizer = build_preset(preset)
    processor = tmp_path / "processor"
    processor.mkdir()
    (processor / "processor_config.json").write_text(json.dumps(PRESETS[preset].processor_settings))
    cache, sessions = tmp_path / "cache", ("decoder", "embedding", "vision", "speech")
    first = export(model, tokenizer, processor=processor, output_dir=tmp_path / "first", cache=cache)
    assert first.report.graph_cache["sessions"] == dict.fromkeys(sessions, "written")
    take_training_step(model, seed=3)
    again = export(model, tokenizer, processor=processor, output_dir=tmp_path / "again", cache=cache)
    assert again.report.graph_cache["sessions"] == dict.fromkeys(sessions, "hit")
    uncached = export(model, tokenizer, processor=processor, output_dir=tmp_path / "uncached", cache=False)
    assert files(again.path) == files(uncached.path)
    assert again.report.notes == uncached.report.notes
    weights_files = [name for name in files(again.path) if name.endswith(".onnx.data")]
    assert len(weights_files) == len(sessions)
    assert all(files(again.path)[name] != files(first.path)[name] for name in weights_files)
