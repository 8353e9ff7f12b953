"""Command-line replays: a folder whose every input but its weight values was exported before is
re-exported by copying that package with the new checkpoint's bytes, without torch or
transformers; the package is byte-identical to one exported without any cache; anything that
could change the package misses; a package whose weights are not copied as stored is not recorded.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.checkpoints import save_checkpoint, training_run_checkpoint

from exporter import replay
from exporter.cli import main
from exporter.preset_names import DEFAULT_PRESET, PRESET_NAMES

pytestmark = pytest.mark.l1

PRESET = "tiny-gemma-4"  # layer_scalar scalars and norms small enough to sit inside model.onnx
REPORTS = ("export_report.json", "export_report.md")


def package_digests(folder: Path) -> dict[str, str]:
    """Every file of a package but its reports (which say how it was made)."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in REPORTS}


def cli(capsys, folder: Path | str, out: Path, *flags: str) -> tuple[dict, str]:
    """An export through the command line: its --json summary and what it said on stderr."""
    assert main([str(folder), "-o", str(out), "--json", *flags]) == 0
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
    assert main(argv) == 0
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
    assert report["source"] == f"folder {checkpoints[1]}"
    assert str(checkpoints[0]) not in json.dumps(report["notes"]) and str(checkpoints[1]) in json.dumps(report["notes"])
    # The report's file records are this package's, as `check` reads them.
    from exporter.integrity import damaged_files, edited_files

    assert damaged_files(replayed, [replayed / "model.onnx"]) == [] and edited_files(replayed) == []


def test_a_replay_imports_neither_torch_nor_transformers(checkpoints, cache, tmp_path):
    code = ("import sys; from exporter.cli import main; "
            f"code = main([{str(checkpoints[1])!r}, '-o', {str(tmp_path / 'out')!r}, '--cache-dir', {str(cache)!r}]); "
            "print(code, sorted(m for m in ('torch', 'transformers', 'onnx', 'onnx_ir') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.stdout.splitlines()[-1] == "0 []", done.stdout + done.stderr
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
    (entry / replay.RECORD_FILENAME).write_text(json.dumps(record))
    summary, _ = cli(capsys, checkpoints[1], tmp_path / "code", "--cache-dir", str(cache))
    assert summary["graph_cache"]["sessions"] == {"decoder": "hit"}  # exported, and recorded anew

    literals = entry / replay.LITERALS_FILENAME
    literals.write_bytes(literals.read_bytes()[:-1] + b"\x01")
    summary, _ = cli(capsys, checkpoints[1], tmp_path / "torn", "--cache-dir", str(cache))
    assert summary["graph_cache"]["sessions"] == {"decoder": "hit"}
    assert package_digests(tmp_path / "torn") == package_digests(uncached)


def test_converted_weights_are_not_recorded(checkpoints, tmp_path, capsys):
    summary, said = cli(capsys, checkpoints[0], tmp_path / "int4", "--precision", "int4", "--cache-dir",
                        str(tmp_path / "cache"))
    assert summary["graph_cache"]["sessions"] == {"decoder": "written"}
    assert "replay: not recorded: a weight was converted" in said
    assert not list((tmp_path / "cache").glob(f"*/{replay.RECORD_FILENAME}"))


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
    from exporter.presets import PRESETS

    assert set(PRESETS) == PRESET_NAMES and DEFAULT_PRESET in PRESET_NAMES
