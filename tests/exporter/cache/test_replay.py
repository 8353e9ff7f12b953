"""Command-line replays: a folder whose every input but its weight values was exported before is
re-exported by copying that package with the new checkpoint's bytes, without torch or
transformers; the package is byte-identical to one exported without any cache; anything that
could change the package misses; a package whose weights are more than one checkpoint tensor each,
copied, converted, cut, transposed or cast, is not recorded.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from exporter.cache import replay
from exporter.cli import main
from exporter.load.preset_names import DEFAULT_PRESET, PRESET_NAMES
from tests.helpers.checkpoints import save_checkpoint, training_run_checkpoint

pytestmark = pytest.mark.l1

PRESET = "tiny-gemma-4"  # layer_scalar scalars and norms small enough to sit inside model.onnx
REPORTS = ("export_report.json", "export_report.md")


def package_digests(folder: Path) -> dict[str, str]:
    """Every file of a package but its reports (which say how it was made)."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in REPORTS}


def cli(capsys, folder: Path | str, out: Path, *flags: str) -> tuple[dict, str]:
    """An export through the command line: its --json summary and what it said on stderr."""
    assert main([str(folder), "-o", str(out), "--json", *flags], replays=True) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("replay-checkpoints")
    return [save_checkpoint(*training_run_checkpoint(PRESET, seed), root / f"step{seed}") for seed in (0, 1)]


@pytest.fixture(scope="module")
def recorded(checkpoints, tmp_path_factory) -> Path:
    """The first checkpoint's command-line export (``package``) and the cache (``cache``) holding
    its replay."""
    root = tmp_path_factory.mktemp("replay-recorded")
    argv = [str(checkpoints[0]), "-o", str(root / "package"), "--cache-dir", str(root / "cache")]
    assert main(argv, replays=True) == 0
    assert len(list((root / "cache").glob(f"*/{replay.RECORD_FILENAME}"))) == 1
    return root


@pytest.fixture
def cache(recorded, tmp_path) -> Path:
    """A copy of the recorded cache, for a test to change."""
    return Path(shutil.copytree(recorded / "cache", tmp_path / "cache"))


@pytest.fixture(scope="module")
def uncached(checkpoints, tmp_path_factory) -> Path:
    """The second checkpoint exported without any cache: what a replay must give."""
    out = tmp_path_factory.mktemp("replay-uncached") / "package"
    assert main([str(checkpoints[1]), "-o", str(out), "--no-cache"]) == 0
    return out


def test_another_checkpoint_replays_byte_identical_to_an_uncached_export(checkpoints, recorded, cache, uncached,
                                                                          tmp_path, capsys):
    summary, _ = cli(capsys, checkpoints[1], tmp_path / "replayed", "--cache-dir", str(cache))
    assert summary["graph_cache"]["sessions"] == {"decoder": "replayed"}
    assert [stage["name"] for stage in summary["stages"]] == ["replay", "package"]
    replayed = tmp_path / "replayed"
    assert package_digests(replayed) == package_digests(uncached)
    # The weights inside model.onnx (layer_scalar, norms) were patched: the checkpoints' differ.
    record = json.loads(next(cache.glob(f"*/{replay.RECORD_FILENAME}")).read_text())
    assert len(record["inline_weights"]["model.onnx"]) > 0
    assert (recorded / "package" / "model.onnx").read_bytes() != (replayed / "model.onnx").read_bytes()
    report = json.loads((replayed / "export_report.json").read_text())
    exported = json.loads((uncached / "export_report.json").read_text())
    assert (report["source"], report["notes"]) == (exported["source"], exported["notes"])
    assert str(checkpoints[1]) in json.dumps(report["notes"])
    # The report's file records are this package's, as `check` reads them.
    from exporter.package.integrity import damaged_files, edited_files

    assert damaged_files(replayed, [replayed / "model.onnx"]) == [] and edited_files(replayed) == []


def test_a_replay_imports_neither_torch_nor_transformers(checkpoints, cache, tmp_path):
    """The console command replays (``run``), and imports none of the libraries an export needs."""
    code = ("import atexit, sys; from exporter.cli import run; "
            "atexit.register(lambda: print(sorted(m for m in ('torch', 'transformers', 'onnx', 'onnx_ir') "
            "if m in sys.modules))); "
            f"sys.argv = ['exporter', {str(checkpoints[1])!r}, '-o', {str(tmp_path / 'out')!r}, '--cache-dir', "
            f"{str(cache)!r}]; run()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "[]", done.stdout + done.stderr
    assert "decoder replayed" in done.stdout


def test_what_the_package_depends_on_misses(checkpoints, cache, tmp_path, capsys):
    """A changed config, tokenizer or option is exported, never replayed; the checkpoint's own
    per-save files that no export reads do not count."""
    changed_tokenizer = Path(shutil.copytree(checkpoints[1], tmp_path / "tokenizer"))
    tokenizer_config = json.loads((changed_tokenizer / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = 777
    (changed_tokenizer / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    summary, _ = cli(capsys, changed_tokenizer, tmp_path / "t", "--cache-dir", str(cache))
    assert summary["graph_cache"]["sessions"] == {"decoder": "hit"}  # the same graph, another package
    summary, _ = cli(capsys, checkpoints[1], tmp_path / "f", "--cache-dir", str(cache), "--full-logits")
    assert summary["graph_cache"]["sessions"] == {"decoder": "written"}

    trainer_files = Path(shutil.copytree(checkpoints[1], tmp_path / "trainer"))
    (trainer_files / "trainer_state.json").write_text('{"global_step": 10}')
    (trainer_files / "optimizer.pt").write_bytes(b"state")
    summary, _ = cli(capsys, trainer_files, tmp_path / "r", "--cache-dir", str(cache))
    assert summary["graph_cache"]["sessions"] == {"decoder": "replayed"}


def test_fingerprint_reads_headers_without_offsets_and_every_other_file(checkpoints, tmp_path):
    folder = Path(shutil.copytree(checkpoints[0], tmp_path / "ckpt"))
    before = replay.fingerprint(folder, {})
    assert replay.fingerprint(checkpoints[1], {}) == before  # other weights, the same everything else
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    assert replay.fingerprint(folder, {}) != before
    (folder / "chat_template.jinja").unlink()
    assert replay.fingerprint(folder, {"max_length": 64}) != before
    config = json.loads((folder / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (folder / "config.json").write_text(json.dumps(config))
    assert replay.fingerprint(folder, {}) != before


def test_a_broken_entry_or_changed_model_code_exports_instead(checkpoints, cache, uncached, tmp_path, capsys):
    entry = next(cache.glob(f"*/{replay.RECORD_FILENAME}")).parent
    record = json.loads((entry / replay.RECORD_FILENAME).read_text())
    model_file = next(iter(record["model_files"]))
    record["model_files"][model_file] = "0" * 64  # as if transformers' modeling file had been edited
    record["sha256"] = replay._record_digest(record)  # a whole record: only the model code's digest differs
    (entry / replay.RECORD_FILENAME).write_text(json.dumps(record))
    summary, _ = cli(capsys, checkpoints[1], tmp_path / "code", "--cache-dir", str(cache))
    assert summary["graph_cache"]["sessions"] == {"decoder": "hit"}  # exported, and recorded anew

    literals = entry / replay.LITERALS_FILENAME
    literals.write_bytes(literals.read_bytes()[:-1] + b"\x01")
    summary, _ = cli(capsys, checkpoints[1], tmp_path / "torn", "--cache-dir", str(cache))
    assert summary["graph_cache"]["sessions"] == {"decoder": "hit"}
    assert package_digests(tmp_path / "torn") == package_digests(uncached)


def not_recorded_because(capsys, folder: Path, tmp_path: Path, *flags: str) -> str:
    """What the command says when it does not record an export of ``folder`` as a replay."""
    _, said = cli(capsys, folder, tmp_path / "package", "--cache-dir", str(tmp_path / "cache"), *flags)
    assert not list((tmp_path / "cache").glob(f"*/{replay.RECORD_FILENAME}")), said
    return next(line for line in said.splitlines() if line.startswith("replay: "))


def test_weights_made_otherwise_are_not_recorded(checkpoints, tmp_path, capsys):
    """Weights a pass makes from values (int4 blocks), tensors transformers' converters build from
    several stored ones (per-expert weights stacked), and tied copies whose values the export
    compared all depend on more than what a replay repeats."""
    from safetensors.torch import load_file, save_file

    assert "int4 blocks" in not_recorded_because(capsys, checkpoints[0], tmp_path / "a", "--precision", "int4")
    # fp16 activations: another checkpoint may need another residual scale, which only an export measures.
    assert "activations are fp16" in not_recorded_because(capsys, checkpoints[0], tmp_path / "f", "--ep", "webgpu")

    moe = save_checkpoint(*training_run_checkpoint("tiny-qwen3-moe", 0), tmp_path / "moe")
    assert "a way a replay does not repeat" in not_recorded_because(capsys, moe, tmp_path / "b")

    tied = Path(shutil.copytree(checkpoints[1], tmp_path / "tied"))
    tensors = load_file(tied / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, tied / "model.safetensors", metadata={"format": "pt"})
    assert "tied tensor under two keys" in not_recorded_because(capsys, tied, tmp_path / "d")


@pytest.mark.parametrize("ep,precision", [("cpu", "fp32"), ("webgpu", "fp32"), ("cuda", "bf16")])
def test_converted_cast_and_transposed_weights_replay_byte_identical(ep, precision, tmp_path, capsys, monkeypatch):
    """A bf16 checkpoint, as Google saves Gemma 4 and a bf16 training run saves its steps: cpu
    fp32 converts every weight (exact), webgpu fp32 also transposes the matrices, and cuda bf16
    from an fp32 checkpoint rounds and transposes them. A replay makes them all with numpy, byte for byte; a NaN it
    would have to narrow is exported instead; and a record keeps only what numpy made as the export
    did."""
    import torch

    from exporter.weights import derived_weights

    saved = []
    dtype = torch.float32 if precision == "bf16" else torch.bfloat16  # the package narrows, or widens
    for seed in (0, 1):
        model, tokenizer = training_run_checkpoint(PRESET, seed)
        saved.append(save_checkpoint(model.to(dtype), tokenizer, tmp_path / f"ckpt-{seed}"))
    cache = str(tmp_path / "cache")
    flags = ("--ep", ep, "--precision", precision)
    cli(capsys, saved[0], tmp_path / "first", *flags, "--cache-dir", cache)
    record = json.loads(next((tmp_path / "cache").glob(f"*/{replay.RECORD_FILENAME}")).read_text())
    steps = {step for data in record["data_files"].values() for piece in data["pieces"] if "derive" in piece
             for step, _ in piece["derive"]["steps"]}
    assert steps == ({"transpose"} if ep != "cpu" else set())
    summary, _ = cli(capsys, saved[1], tmp_path / "replayed", *flags, "--cache-dir", cache)
    assert summary["graph_cache"]["sessions"] == {"decoder": "replayed"}
    cli(capsys, saved[1], tmp_path / "uncached", *flags, "--no-cache")
    assert package_digests(tmp_path / "replayed") == package_digests(tmp_path / "uncached")
    if precision != "bf16":
        return

    from safetensors.torch import load_file, save_file

    nan = Path(shutil.copytree(saved[1], tmp_path / "nan"))
    tensors = load_file(nan / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, nan / "model.safetensors", metadata={"format": "pt"})
    summary, said = cli(capsys, nan, tmp_path / "nan-package", *flags, "--cache-dir", cache)
    assert summary["graph_cache"]["sessions"] == {"decoder": "hit"}, said
    assert "not replayed: weight model.layers.0.mlp.down_proj.weight: it holds a NaN" in said
    assert "replay: not recorded: weight " in said and said.count("it holds a NaN") == 2

    made_otherwise = derived_weights.derived_chunks

    def off_by_one_bit(*args):
        for chunk in made_otherwise(*args):
            chunk[0] ^= 1  # a flat array of the weight's bytes
            yield chunk

    monkeypatch.setattr(derived_weights, "derived_chunks", off_by_one_bit)
    assert "numpy does not make its bytes as torch did" in not_recorded_because(
        capsys, saved[0], tmp_path / "differs", *flags)


@pytest.mark.slow
def test_a_multimodal_package_replays_byte_identical(tmp_path, capsys):
    """Gemma 4 as Google publishes it (text, image and audio, bf16): four sessions, whose towers
    keep the nodes that would fold a weight (the position table's Gathers, the audio layers'
    ``per_dim_scale``) for run time, so every weight is its checkpoint tensor's."""
    import torch

    from exporter.load.presets import PRESETS

    multimodal = "tiny-gemma-4-multimodal"
    folders = []
    for seed in (0, 1):
        model, tokenizer = training_run_checkpoint(multimodal, seed)
        folder = save_checkpoint(model.to(torch.bfloat16), tokenizer, tmp_path / f"step{seed}")
        (folder / "processor_config.json").write_text(json.dumps(PRESETS[multimodal].processor_settings))
        folders.append(folder)
    cache = str(tmp_path / "cache")
    cli(capsys, folders[0], tmp_path / "first", "--cache-dir", cache)
    summary, said = cli(capsys, folders[1], tmp_path / "replayed", "--cache-dir", cache)
    assert summary["graph_cache"]["sessions"] == dict.fromkeys(("decoder", "embedding", "vision", "speech"),
                                                               "replayed"), said
    cli(capsys, folders[1], tmp_path / "uncached", "--no-cache")
    assert package_digests(tmp_path / "replayed") == package_digests(tmp_path / "uncached")


def test_a_damaged_checkpoint_is_refused_as_without_a_cache(checkpoints, cache, tmp_path, capsys):
    """A replay reads the checkpoint's header only where safetensors reads the whole file as valid:
    a truncated one gets the export's own one-line error."""
    damaged = Path(shutil.copytree(checkpoints[1], tmp_path / "damaged"))
    data = (damaged / "model.safetensors").read_bytes()
    (damaged / "model.safetensors").write_bytes(data[:-100])
    code = main([str(damaged), "-o", str(tmp_path / "out"), "--cache-dir", str(cache)], replays=True)
    assert code == 2 and "not a readable safetensors file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # The replay itself checks the file it copies from, not only the fingerprint taken before it.
    entry = next(cache.glob(f"*/{replay.RECORD_FILENAME}")).parent
    intact = replay.fingerprint(checkpoints[1], json.loads((entry / replay.KEY_FILENAME).read_text())["options"])
    assert replay.replay(cache, intact, checkpoints[1], tmp_path / "intact", overwrite=False) is not None
    assert replay.replay(cache, intact, damaged, tmp_path / "from-damaged", overwrite=False) is None
    assert not (tmp_path / "from-damaged").exists()


def test_hidden_safetensors_count_like_any_other(checkpoints, tmp_path):
    """The loader opens every ``*.safetensors``, hidden ones too: the key reads them, and one that
    is no safetensors file (a macOS ``._`` file) stops the replay, and the export says why."""
    folder = Path(shutil.copytree(checkpoints[0], tmp_path / "hidden"))
    (folder / "model.safetensors").rename(folder / ".model.safetensors")
    assert ".model.safetensors" in replay.fingerprint(folder, {})["folder"]
    (folder / "._model.safetensors").write_bytes(b"\x00\x05\x16\x07 resource fork")
    with pytest.raises(Exception, match="header"):
        replay.fingerprint(folder, {})


def test_only_the_console_command_replays_and_a_failed_record_keeps_the_package(checkpoints, cache, tmp_path,
                                                                                 capsys, monkeypatch):
    """``main`` in a caller's process neither replays nor records (its process may have patched the
    model's classes); a record that fails costs the replay, never the written package."""
    entries = set(cache.iterdir())
    assert main([str(checkpoints[1]), "-o", str(tmp_path / "in-process"), "--cache-dir", str(cache), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["graph_cache"]["sessions"] == {"decoder": "hit"}
    assert set(cache.iterdir()) == entries

    def failing_record(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(replay, "record", failing_record)
    other_tokenizer = Path(shutil.copytree(checkpoints[1], tmp_path / "tokenizer"))
    (other_tokenizer / "chat_template.jinja").write_text("{{ messages }}")  # not replayed: exported
    summary, said = cli(capsys, other_tokenizer, tmp_path / "recorded", "--cache-dir", str(cache))
    assert "replay: not recorded: unexpected RuntimeError: disk on fire" in said
    assert summary["ok"] and (tmp_path / "recorded" / "model.onnx.data").is_file()


def test_a_checkpoint_whose_data_moved_replays_byte_identical(checkpoints, cache, uncached, tmp_path, capsys):
    """Pieces are found by key in the new checkpoint's own header: metadata that moves every
    tensor's bytes changes nothing."""
    from safetensors.numpy import load_file, save_file

    moved = Path(shutil.copytree(checkpoints[1], tmp_path / "moved"))
    save_file(load_file(moved / "model.safetensors"), moved / "model.safetensors",
              metadata={"format": "pt", "written_by": "a trainer with a long name " * 8})
    summary, _ = cli(capsys, moved, tmp_path / "replayed", "--cache-dir", str(cache))
    assert summary["graph_cache"]["sessions"] == {"decoder": "replayed"}
    assert package_digests(tmp_path / "replayed") == package_digests(uncached)


def test_the_report_names_the_new_folder_wherever_the_recorded_one_stood(checkpoints, tmp_path, capsys, monkeypatch):
    """A folder named ``e`` recorded, another replayed: the report's source and notes are those of
    an export of the new folder without a cache (``e`` inside words untouched)."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(checkpoints[0], tmp_path / "e")
    shutil.copytree(checkpoints[1], tmp_path / "f")
    cli(capsys, "e", tmp_path / "first", "--cache-dir", str(tmp_path / "cache"))
    summary, _ = cli(capsys, "f", tmp_path / "replayed", "--cache-dir", str(tmp_path / "cache"))
    assert summary["graph_cache"]["sessions"] == {"decoder": "replayed"}
    uncached, _ = cli(capsys, "f", tmp_path / "uncached", "--no-cache")
    assert (summary["source"], summary["notes"]) == (uncached["source"], uncached["notes"])


def test_tidy_deduplicates_constants_and_keeps_equal_weights_apart():
    """Two equal weights stay two initializers (no weight value decides the graph) and are never
    read; equal constants become one; the order of what remains is kept."""
    import numpy as np
    import onnx_ir as ir

    from exporter.onnx_passes.tidy import DeduplicateConstantsPass
    from exporter.weights.placeholders import WEIGHT_PLACEHOLDER, attach
    from exporter.weights.stores import RandomWeights

    values = {}
    for name in ("c1", "w1", "w2", "c2", "w3"):
        tensor = (ir.Tensor(np.ones(4, np.float32), name=name) if name.startswith("c") else
                  ir.ExternalTensor(WEIGHT_PLACEHOLDER, offset=None, length=None, dtype=ir.DataType.FLOAT,
                                    shape=ir.Shape([4]), name=name))
        values[name] = ir.Value(name=name, shape=ir.Shape([4]), type=ir.TensorType(ir.DataType.FLOAT),
                                const_value=tensor)
    nodes = [ir.node("Add", [values[a], values[b]]) for a, b in (("c1", "w1"), ("w2", "c2"), ("w3", "c1"))]
    graph = ir.Graph([], [node.outputs[0] for node in nodes], nodes=nodes, initializers=list(values.values()))
    model = ir.Model(graph, ir_version=10)
    readers = attach(model, RandomWeights({"w": (4,)}, std=0.0), {n: ("w", None) for n in ("w1", "w2", "w3")})
    DeduplicateConstantsPass()(model)
    assert list(graph.initializers) == ["c1", "w1", "w2", "w3"]
    assert nodes[1].inputs[1] is values["c1"]
    assert [reader.reads for reader in readers] == [0, 0, 0]


def test_a_folder_named_like_a_preset_exports_the_preset(checkpoints, cache, tmp_path, capsys, monkeypatch):
    """A preset's name exports the preset even where a folder of that name exists, so it never
    replays that folder's package."""
    shutil.copytree(checkpoints[1], tmp_path / PRESET)
    monkeypatch.chdir(tmp_path)
    summary, _ = cli(capsys, Path(PRESET), tmp_path / "out", "--cache-dir", str(cache))
    assert summary["source"].startswith(f"preset {PRESET}")
    assert "replay" not in summary["graph_cache"]
    summary, _ = cli(capsys, f"./{PRESET}", tmp_path / "folder", "--cache-dir", str(cache))
    assert summary["graph_cache"]["sessions"] == {"decoder": "replayed"}


def test_the_command_line_knows_every_preset_without_importing_them():
    from exporter.load.presets import PRESETS

    assert set(PRESETS) == PRESET_NAMES and DEFAULT_PRESET in PRESET_NAMES
