"""Nothing corrupt, nothing lost: bad checkpoints, damaged packages, unwritable or full
destinations, a destination changed during the export, SIGTERM, and environment errors. Each
case asserts the exit code, the one-line message and what is left on disk."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from exporter import pipeline
from exporter.cli import main
from exporter.load.presets import build_preset
from exporter.package import destination
from exporter.package import files as package
from exporter.verify.check import check_package
from tests.helpers.checkpoints import save_checkpoint

pytestmark = pytest.mark.l1
ROOT = Path(__file__).resolve().parents[2]


def _run_cli(args, capsys) -> tuple[int, list[str]]:
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err.strip().splitlines()


def _left_beside(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def _assert_one_line_error(lines: list[str], *parts: str) -> str:
    message = lines[-1]
    assert message.startswith("error: "), lines
    assert "Traceback" not in "\n".join(lines)
    for part in parts:
        assert part in message, message
    return message


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    model, tokenizer = build_preset("tiny-llama")
    return save_checkpoint(model, tokenizer, tmp_path_factory.mktemp("nothing_lost") / "tiny-llama")


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("exported") / "package"
    assert main([str(checkpoint), "-o", str(out)]) == 0
    return out


# -- safetensors surgery: the header is 8 bytes of length, then JSON, then the data -----------

def _read_safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _write_safetensors(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _copy(checkpoint: Path, folder: Path) -> Path:
    shutil.copytree(checkpoint, folder)
    return folder


def _replace_tensor(folder: Path, key: str, array: np.ndarray, dtype: str = "F32") -> None:
    """Rewrite ``key`` with another shape/dtype, moving every other tensor's offsets."""
    path = folder / "model.safetensors"
    header, data = _read_safetensors(path)
    metadata = header.pop("__metadata__", None)
    tensors, offset, chunks = {}, 0, []
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        start, end = entry["data_offsets"]
        blob = array.tobytes() if name == key else data[start:end]
        shape = list(array.shape) if name == key else entry["shape"]
        tensors[name] = {"dtype": dtype if name == key else entry["dtype"], "shape": shape,
                         "data_offsets": [offset, offset + len(blob)]}
        chunks.append(blob)
        offset += len(blob)
    if metadata is not None:
        tensors["__metadata__"] = metadata
    _write_safetensors(path, tensors, b"".join(chunks))


def _add_tensor(folder: Path, key: str, array: np.ndarray) -> None:
    path = folder / "model.safetensors"
    header, data = _read_safetensors(path)
    header[key] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [len(data), len(data) + array.nbytes]}
    _write_safetensors(path, header, data + array.astype(np.float32).tobytes())


# -- 1. a tensor the config does not fit ------------------------------------------------------

@pytest.mark.parametrize("key, array, dtype, expected", [
    ("model.layers.0.self_attn.q_proj.weight", np.zeros((32, 64), np.float32), "F32", "has shape [32, 64]"),
    ("model.layers.0.self_attn.q_proj.weight", np.zeros((128, 64), np.float32), "F32", "has shape [128, 64]"),
    ("model.embed_tokens.weight", np.zeros((100, 64), np.float32), "F32", "has shape [100, 64]"),
    ("model.layers.0.self_attn.q_proj.weight", np.zeros((64, 64), np.int32), "I32", "cannot become"),
])
def test_a_tensor_the_config_does_not_fit_is_refused(checkpoint, tmp_path, capsys, key, array, dtype, expected):
    folder = _copy(checkpoint, tmp_path / "bad")
    _replace_tensor(folder, key, array, dtype)
    code, lines = _run_cli([folder, "-o", tmp_path / "out"], capsys)
    assert code == 2
    _assert_one_line_error(lines, f"'{key}'", expected, "model.safetensors")
    assert not (tmp_path / "out").exists() and _left_beside(tmp_path) == []


def test_a_config_with_more_layers_than_the_checkpoint_says_so(checkpoint, tmp_path, capsys):
    folder = _copy(checkpoint, tmp_path / "bad")
    config = json.loads((folder / "config.json").read_text())
    del config["num_hidden_layers"]  # transformers then takes its default, 32
    (folder / "config.json").write_text(json.dumps(config))
    code, lines = _run_cli([folder, "-o", tmp_path / "out"], capsys)
    assert code == 2
    _assert_one_line_error(lines, "has 4 layers under 'model.layers', the config 32",
                           "config.json does not set num_hidden_layers")


def test_a_config_with_fewer_layers_than_the_checkpoint_says_so(checkpoint, tmp_path, capsys):
    folder = _copy(checkpoint, tmp_path / "bad")
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (folder / "config.json").write_text(json.dumps(config))
    code, lines = _run_cli([folder, "-o", tmp_path / "out"], capsys)
    assert code == 2
    _assert_one_line_error(lines, "has 4 layers under 'model.layers', the config 2")
    assert not (tmp_path / "out").exists() and _left_beside(tmp_path) == []


def test_a_corrupt_safetensors_index_is_refused(checkpoint, tmp_path, capsys):
    folder = _copy(checkpoint, tmp_path / "bad")
    (folder / "model.safetensors.index.json").write_text("{not json")
    code, lines = _run_cli([folder, "-o", tmp_path / "out"], capsys)
    assert code == 2
    _assert_one_line_error(lines, "model.safetensors.index.json' is not a safetensors index")
    assert not (tmp_path / "out").exists() and _left_beside(tmp_path) == []


def test_a_truncated_checkpoint_is_refused_and_debug_shows_the_cause(checkpoint, tmp_path, capsys):
    folder = _copy(checkpoint, tmp_path / "cut")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    code, lines = _run_cli([folder, "-o", tmp_path / "out"], capsys)
    assert code == 2
    _assert_one_line_error(lines, str(folder / "model.safetensors"), "not a readable safetensors file")
    with pytest.raises(Exception) as raised:
        main([str(folder), "-o", str(tmp_path / "out"), "--debug"])
    assert raised.value.__cause__ is not None, "--debug keeps the original error as the cause"
    assert not (tmp_path / "out").exists() and _left_beside(tmp_path) == []


# -- 2. check finds damage --------------------------------------------------------------------

def test_report_records_size_and_sha256_and_check_finds_a_cut_file(exported, tmp_path, capsys):
    damaged = shutil.copytree(exported, tmp_path / "damaged")
    data = damaged / "model.onnx.data"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    (files,) = [f for f in check_package(damaged, _cpu()) if f.check == "files"]
    assert not files.passed and files.detail.startswith("model.onnx.data is damaged:") and "when exported" in files.detail
    code, _ = _run_cli(["check", damaged], capsys)
    assert code == 1
    (damaged / "export_report.json").unlink()  # no record: the tensors' extents still show it
    (files,) = [f for f in check_package(damaged, _cpu()) if f.check == "files"]
    assert not files.passed and "its tensors reach" in files.detail


def test_check_names_a_cut_model_file(exported, tmp_path):
    damaged = shutil.copytree(exported, tmp_path / "cut_graph")
    graph = damaged / "model.onnx"
    graph.write_bytes(graph.read_bytes()[: graph.stat().st_size // 2])
    (files,) = [f for f in check_package(damaged, _cpu()) if f.check == "files"]
    assert not files.passed and files.detail.startswith("model.onnx is damaged:")


def test_check_finds_a_changed_byte(exported, tmp_path):
    damaged = shutil.copytree(exported, tmp_path / "changed")
    data = bytearray((damaged / "model.onnx.data").read_bytes())
    data[len(data) // 3] ^= 0xFF
    (damaged / "model.onnx.data").write_bytes(bytes(data))
    (files,) = [f for f in check_package(damaged, _cpu()) if f.check == "files"]
    assert not files.passed and files.detail == "model.onnx.data is damaged: its sha256 differs from the one recorded at export"
    (intact,) = [f for f in check_package(exported, _cpu()) if f.check == "files"]
    assert intact.passed and "2 graph and weights files match the size and sha256 recorded at export" in intact.detail


def test_an_edited_genai_config_is_no_damage(exported, tmp_path):
    """genai_config.json is meant to be tuned (search options): check names the edit and goes on."""
    edited = shutil.copytree(exported, tmp_path / "edited")
    config = json.loads((edited / "genai_config.json").read_text())
    config["search"]["max_length"] = 64
    (edited / "genai_config.json").write_text(json.dumps(config))
    findings = {f.check: f for f in check_package(edited, _cpu())}
    assert findings["files"].passed and findings["files"].detail.endswith("edited since the export: genai_config.json")
    assert findings["genai_config"].passed


def _cpu():
    from ep_profiles import get_profile

    return get_profile("cpu")


# -- 3. the destination is checked before any work --------------------------------------------

def _no_work(monkeypatch):
    def traced(*args, **kwargs):
        raise AssertionError("the export traced before checking its destination")

    monkeypatch.setattr(pipeline, "_export_session", traced)


def test_an_output_under_a_file_fails_up_front(checkpoint, tmp_path, capsys, monkeypatch):
    _no_work(monkeypatch)
    (tmp_path / "file").write_text("user data")
    code, lines = _run_cli([checkpoint, "-o", tmp_path / "file" / "out"], capsys)
    assert code == 2
    _assert_one_line_error(lines, "-o", str(tmp_path / "file"), "is a file")
    assert (tmp_path / "file").read_text() == "user data"


def test_an_unwritable_parent_fails_up_front(checkpoint, tmp_path, capsys, monkeypatch):
    # Tests run as root, for whom permission bits do not stop writes: the access check is mocked.
    _no_work(monkeypatch)
    real_access = os.access
    monkeypatch.setattr(destination.os, "access", lambda path, mode: False if Path(path) == tmp_path else real_access(path, mode))
    code, lines = _run_cli([checkpoint, "-o", tmp_path / "new" / "out"], capsys)
    assert code == 2
    _assert_one_line_error(lines, "-o", "is read-only or not ours to write in")
    assert list(tmp_path.iterdir()) == []


def test_too_little_space_fails_before_tracing(checkpoint, tmp_path, capsys, monkeypatch):
    _no_work(monkeypatch)
    monkeypatch.setattr(destination.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096))
    code, lines = _run_cli([checkpoint, "-o", tmp_path / "out"], capsys)
    assert code == 2
    _assert_one_line_error(lines, "-o", "needs about", "4.0 KiB free")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs, a real disk too small for any package (skipped where mounting is not allowed)."""
    mount_point = tmp_path / "small_disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_a_real_small_disk_fails_before_tracing(checkpoint, small_tmpfs, capsys, monkeypatch):
    _no_work(monkeypatch)
    code, lines = _run_cli([checkpoint, "-o", small_tmpfs / "out"], capsys)
    assert code == 2
    _assert_one_line_error(lines, "-o", "needs about", "KiB free")
    assert list(small_tmpfs.iterdir()) == []


def test_a_real_disk_that_fills_while_writing_is_said_as_such(checkpoint, small_tmpfs, capsys, monkeypatch):
    # Another process fills the disk after the check: the write itself meets ENOSPC.
    monkeypatch.setattr(pipeline.destination, "require_space", lambda *args: None)
    code, lines = _run_cli([checkpoint, "-o", small_tmpfs / "out"], capsys)
    assert code == 2
    message = _assert_one_line_error(lines, "the disk is full", "the package needs about", "free there")
    assert "please report" not in message
    assert list(small_tmpfs.iterdir()) == []


def test_an_immutable_package_fails_up_front(exported, checkpoint, tmp_path, capsys, monkeypatch):
    _no_work(monkeypatch)
    out = shutil.copytree(exported, tmp_path / "out")
    if subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not allowed here")
    try:
        code, lines = _run_cli([checkpoint, "-o", out, "--overwrite"], capsys)
    finally:
        subprocess.run(["chattr", "-i", str(out)], check=True)
    assert code == 2
    _assert_one_line_error(lines, "-o", "cannot be replaced", "choose another -o")
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in exported.iterdir())
    assert _left_beside(tmp_path) == []


# -- 4. a destination changed during the export is left as it is ------------------------------

def _during_write(monkeypatch, action):
    real = package.save_tokenizer

    def save_tokenizer(tokenizer, folder):
        action()
        return real(tokenizer, folder)

    monkeypatch.setattr(package, "save_tokenizer", save_tokenizer)


def test_a_file_created_in_an_absent_destination_is_kept(checkpoint, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    _during_write(monkeypatch, lambda: (out.mkdir(), (out / "mine.txt").write_text("user data")))
    code, lines = _run_cli([checkpoint, "-o", out], capsys)
    assert code == 2
    _assert_one_line_error(lines, "changed while the export ran", "nothing was written")
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"] and (out / "mine.txt").read_text() == "user data"
    assert _left_beside(tmp_path) == []


def test_a_file_created_in_a_package_being_overwritten_is_kept(exported, checkpoint, tmp_path, capsys, monkeypatch):
    out = shutil.copytree(exported, tmp_path / "out")
    before = sorted(p.name for p in out.iterdir())
    _during_write(monkeypatch, lambda: (out / "mine.txt").write_text("user data"))
    code, lines = _run_cli([checkpoint, "-o", out, "--overwrite"], capsys)
    assert code == 2
    _assert_one_line_error(lines, "changed while the export ran")
    assert sorted(p.name for p in out.iterdir()) == sorted([*before, "mine.txt"])
    assert _left_beside(tmp_path) == []


def test_a_file_written_deep_in_a_package_being_overwritten_is_kept(exported, checkpoint, tmp_path, capsys, monkeypatch):
    out = shutil.copytree(exported, tmp_path / "out")

    def edit():
        (out / "genai_config.json").write_text((out / "genai_config.json").read_text() + " ")
        (out / "sub").mkdir()
        (out / "sub" / "mine.txt").write_text("user data")

    _during_write(monkeypatch, edit)
    code, lines = _run_cli([checkpoint, "-o", out, "--overwrite"], capsys)
    assert code == 2
    _assert_one_line_error(lines, "changed while the export ran")
    assert (out / "sub" / "mine.txt").read_text() == "user data"
    assert (out / "genai_config.json").read_text().endswith(" ")
    assert _left_beside(tmp_path) == []


def test_a_linked_destination_replaces_the_package_it_points_to(exported, checkpoint, tmp_path, capsys):
    real = shutil.copytree(exported, tmp_path / "real")
    (real / "model.onnx.data").write_bytes(b"old")
    (tmp_path / "link").symlink_to(real)
    code, _ = _run_cli([checkpoint, "-o", tmp_path / "link", "--overwrite"], capsys)
    assert code == 0
    assert (tmp_path / "link").is_symlink()
    assert (real / "model.onnx.data").read_bytes() == (exported / "model.onnx.data").read_bytes()


def test_overwrite_replaces_an_unchanged_package(exported, checkpoint, tmp_path, capsys):
    out = shutil.copytree(exported, tmp_path / "out")
    (out / "model.onnx.data").write_bytes(b"old")
    code, _ = _run_cli([checkpoint, "-o", out, "--overwrite"], capsys)
    assert code == 0
    assert (out / "model.onnx.data").read_bytes() == (exported / "model.onnx.data").read_bytes()
    assert _left_beside(tmp_path) == []


# -- 5. SIGTERM, and staging folders left by killed exports -----------------------------------

_SLOW_WRITE = """
import sys, time
from pathlib import Path
from exporter.package import files as package
from exporter.cli import main
real = package.save_model
def save_model(*args, **kwargs):
    real(*args, **kwargs)
    Path(sys.argv[1]).write_text("writing")
    time.sleep(60)
package.save_model = save_model
sys.exit(main(sys.argv[2:]))
"""


def _sigterm_once_ready(script: str, checkpoint: Path, tmp_path: Path, while_ready=lambda: None):
    """Runs the export ``script`` (which writes tmp_path/ready when it reaches the point to stop
    at), calls ``while_ready``, sends SIGTERM; returns the exit code and stderr."""
    ready, out = tmp_path / "ready", tmp_path / "out"
    process = subprocess.Popen([sys.executable, "-c", script, str(ready), str(checkpoint), "-o", str(out)],
                               cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not ready.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ready.exists(), process.stderr.read() if process.poll() is not None else "the export never got there"
    while_ready()
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    return process.returncode, err


def test_sigterm_while_writing_leaves_nothing(checkpoint, tmp_path):
    def writes_to_staging():
        assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name], "writing goes to a staging folder"

    code, err = _sigterm_once_ready(_SLOW_WRITE, checkpoint, tmp_path, writes_to_staging)
    assert code == 143
    assert err.strip().splitlines()[-1] == "error: terminated; nothing was written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ready"]


_SLOW_TRACE = """
import sys, time
from pathlib import Path
from exporter import pipeline
from exporter.cli import main
real = pipeline.lower
def lower(*args, **kwargs):
    Path(sys.argv[1]).write_text("tracing")
    time.sleep(60)
    return real(*args, **kwargs)
pipeline.lower = lower
sys.exit(main(sys.argv[2:]))
"""


def test_sigterm_while_tracing_leaves_nothing(checkpoint, tmp_path):
    code, err = _sigterm_once_ready(_SLOW_TRACE, checkpoint, tmp_path)
    assert code == 143
    assert err.strip().splitlines()[-1] == "error: terminated; nothing was written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ready"]


def test_an_interrupted_swap_puts_the_old_package_back(exported, checkpoint, tmp_path, capsys, monkeypatch):
    out = shutil.copytree(exported, tmp_path / "out")
    (out / "model.onnx.data").write_bytes(b"old")
    real_rename = os.rename

    def rename(source, target):
        if Path(source).name == "package" and Path(target) == out:
            raise KeyboardInterrupt  # Ctrl-C (or SIGTERM) between moving -o aside and moving the new one in
        return real_rename(source, target)

    monkeypatch.setattr(destination.os, "rename", rename)
    code, _ = _run_cli([checkpoint, "-o", out, "--overwrite"], capsys)
    assert code == 130
    assert (out / "model.onnx.data").read_bytes() == b"old"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in exported.iterdir())
    assert _left_beside(tmp_path) == []


def test_ctrl_c_as_the_old_package_is_moved_aside_puts_it_back(exported, checkpoint, tmp_path, capsys, monkeypatch):
    out = shutil.copytree(exported, tmp_path / "out")
    (out / "model.onnx.data").write_bytes(b"old")
    real_rename = os.rename

    def rename(source, target):
        real_rename(source, target)
        if Path(source) == out and Path(target).name == "previous":
            raise KeyboardInterrupt  # lands just as the rename returns

    monkeypatch.setattr(destination.os, "rename", rename)
    code, _ = _run_cli([checkpoint, "-o", out, "--overwrite"], capsys)
    assert code == 130
    assert (out / "model.onnx.data").read_bytes() == b"old"
    assert _left_beside(tmp_path) == []


def test_a_package_left_aside_by_a_killed_swap_is_moved_back(exported, checkpoint, tmp_path, capsys):
    # What SIGKILL between the swap's two renames leaves: -o absent, the old package in previous/.
    stale = tmp_path / ".out.partial-killed_1"
    stale.mkdir()
    (stale / destination.LOCK_NAME).write_text("12345\n")
    shutil.copytree(exported, stale / "package")
    shutil.copytree(exported, stale / "previous")
    (stale / "previous" / "model.onnx.data").write_bytes(b"old")
    code, lines = _run_cli([checkpoint, "-o", tmp_path / "out"], capsys)
    assert code == 2
    _assert_one_line_error(lines, "exists", "--overwrite")
    assert (tmp_path / "out" / "model.onnx.data").read_bytes() == b"old"
    assert _left_beside(tmp_path) == []


def test_stale_staging_folders_are_removed_and_others_kept(checkpoint, tmp_path, capsys):
    stale = tmp_path / ".out.partial-stale_01"
    stale.mkdir()
    (stale / destination.LOCK_NAME).write_text("12345\n")
    (stale / "model.onnx.data").write_bytes(b"x" * 1000)
    foreign = tmp_path / ".out.partial-foreign1"  # no lock file: not made by the exporter
    foreign.mkdir()
    running = tmp_path / ".out.partial-running1"
    running.mkdir()
    with open(running / destination.LOCK_NAME, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # an export that still runs
        code, _ = _run_cli([checkpoint, "-o", tmp_path / "out"], capsys)
    assert code == 0
    assert _left_beside(tmp_path) == [".out.partial-foreign1", ".out.partial-running1"]
    assert (tmp_path / "out" / "genai_config.json").is_file()
    assert not (tmp_path / "out" / destination.LOCK_NAME).exists()


# -- 6. the environment's errors are said as such ---------------------------------------------

@pytest.mark.parametrize("number, words", [
    (errno.ENOSPC, "the disk is full"),
    (errno.EROFS, "the file system is read-only"),
    (errno.EACCES, "permission denied"),
    (errno.EEXIST, "it already exists"),
])
def test_environment_errors_while_writing_are_one_line_exit_2(checkpoint, tmp_path, capsys, monkeypatch, number, words):
    def failing_save(model, folder, filename=package.MODEL_FILENAME, on_tensor=None):
        raise OSError(number, os.strerror(number), str(Path(folder) / filename))

    monkeypatch.setattr(package, "save_model", failing_save)
    code, lines = _run_cli([checkpoint, "-o", tmp_path / "out"], capsys)
    assert code == 2
    message = _assert_one_line_error(lines, words, "model.onnx'")
    assert "please report" not in message
    if number == errno.ENOSPC:
        assert "the package needs about" in message and "free there" in message
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_without_a_path_names_the_destination(checkpoint, tmp_path, capsys, monkeypatch):
    def failing_save(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # what a short write raises

    monkeypatch.setattr(package, "save_model", failing_save)
    code, lines = _run_cli([checkpoint, "-o", tmp_path / "out"], capsys)
    assert code == 2
    _assert_one_line_error(lines, f"'{tmp_path / 'out'}': the disk is full", "free there")
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_the_tokenizer_writes_is_said_as_such(checkpoint, tmp_path, capsys, monkeypatch):
    import transformers

    def failing_save(self, *args, **kwargs):
        raise Exception("No space left on device (os error 28)")  # the Rust tokenizer's words

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "save_pretrained", failing_save)
    code, lines = _run_cli([checkpoint, "-o", tmp_path / "out"], capsys)
    assert code == 2
    _assert_one_line_error(lines, "the disk is full")
    assert list(tmp_path.iterdir()) == []


def test_a_real_bug_still_asks_for_a_report(checkpoint, tmp_path, capsys, monkeypatch):
    def failing_save(*args, **kwargs):
        raise ValueError("simulated bug")

    monkeypatch.setattr(package, "save_model", failing_save)
    code, lines = _run_cli([checkpoint, "-o", tmp_path / "out"], capsys)
    assert code == 1 and "please report it" in lines[-1]
    assert list(tmp_path.iterdir()) == []


# -- fuzz: many mutations of one checkpoint ---------------------------------------------------

def _mutations(checkpoint: Path, seed: int = 0):
    """(name, function(folder)) pairs, each damaging a copy of the checkpoint in its own way."""
    rng = np.random.default_rng(seed)
    path = checkpoint / "model.safetensors"
    raw = path.read_bytes()
    (header_length,) = struct.unpack("<Q", raw[:8])
    header, _ = _read_safetensors(path)
    names = sorted(k for k in header if k != "__metadata__")
    matrices = [k for k in names if len(header[k]["shape"]) == 2]

    def write(folder, data):
        (folder / "model.safetensors").write_bytes(data)

    def edit_header(folder, change):
        head, data = _read_safetensors(folder / "model.safetensors")
        change(head)
        _write_safetensors(folder / "model.safetensors", head, data)

    def drop_tensor(folder, key):
        head, data = _read_safetensors(folder / "model.safetensors")
        arrays = {k: v for k, v in head.items() if k not in (key, "__metadata__")}
        chunks, offset, kept = [], 0, {}
        for name, entry in sorted(arrays.items(), key=lambda item: item[1]["data_offsets"][0]):
            start, end = entry["data_offsets"]
            kept[name] = {**entry, "data_offsets": [offset, offset + end - start]}
            chunks.append(data[start:end])
            offset += end - start
        _write_safetensors(folder / "model.safetensors", kept, b"".join(chunks))

    for offset in [*sorted(rng.integers(1, len(raw) - 1, size=3)), *rng.integers(1, 8 + header_length, size=2)]:
        yield f"truncated at {offset}", lambda f, o=int(offset): write(f, raw[:o])
    for key in rng.choice(names, size=2, replace=False):  # a header that parses but lies
        yield f"{key} offsets shifted", lambda f, k=str(key): edit_header(
            f, lambda h: h[k].update(data_offsets=[h[k]["data_offsets"][0] + 4, h[k]["data_offsets"][1] + 4]))
    for _ in range(3):
        at = int(rng.integers(8, 8 + header_length))
        garbage = rng.integers(0, 256, size=8, dtype=np.uint8).tobytes()
        yield f"header garbage at {at}", lambda f, a=at, g=garbage: write(f, raw[:a] + g + raw[a + len(g):])
    yield "header length garbage", lambda f: write(f, struct.pack("<Q", header_length * 7) + raw[8:])
    for key in rng.choice(matrices, size=3, replace=False):
        yield f"{key} transposed shape", lambda f, k=str(key): edit_header(f, lambda h: h[k].update(shape=h[k]["shape"][::-1]) if h[k]["shape"][0] != h[k]["shape"][1] else h[k].update(shape=[h[k]["shape"][0] * h[k]["shape"][1]]))
        yield f"{key} flattened", lambda f, k=str(key): edit_header(f, lambda h: h[k].update(shape=[h[k]["shape"][0] * h[k]["shape"][1]]))
    for key in rng.choice(names, size=2, replace=False):
        yield f"{key} as I32", lambda f, k=str(key): edit_header(f, lambda h: h[k].update(dtype="I32"))
        yield f"{key} as F16", lambda f, k=str(key): edit_header(f, lambda h: h[k].update(dtype="F16"))
        yield f"{key} missing", lambda f, k=str(key): drop_tensor(f, k)
    yield "extra tensor", lambda f: _add_tensor(f, "extra.unused.weight", np.ones((3, 5), np.float32))
    yield "extra tensor under a model-like name", lambda f: _add_tensor(f, "model.norm.bias", np.ones((8,), np.float32))
    # A layer the config does not have: the config and checkpoint disagree, an error.
    yield "extra layer", lambda f: _add_tensor(f, "model.layers.9.mlp.up_proj.weight", np.ones((8, 8), np.float32))


def test_no_mutation_of_a_checkpoint_gives_a_different_package(checkpoint, exported, tmp_path, capsys):
    """Every mutation either exports the same graphs and weights as the intact checkpoint (extra
    keys) or fails with exit 2, one line, and leaves nothing behind."""
    outcomes = {}
    for number, (name, mutate) in enumerate(_mutations(checkpoint)):
        work = tmp_path / f"m{number}"
        work.mkdir()
        folder = _copy(checkpoint, work / "checkpoint")
        mutate(folder)
        code, lines = _run_cli([folder, "-o", work / "out"], capsys)
        outcomes[name] = code
        if code == 0:
            assert name in ("extra tensor", "extra tensor under a model-like name"), f"{name}: exported although damaged"
            notes = " ".join(json.loads((work / "out" / "export_report.json").read_text())["notes"])
            assert "not read" in notes and ("extra.unused.weight" in notes or "model.norm.bias" in notes), notes
            for file in ("model.onnx", "model.onnx.data", "genai_config.json"):
                assert (work / "out" / file).read_bytes() == (exported / file).read_bytes(), f"{name}: {file} differs"
        else:
            assert code == 2, f"{name}: exit {code}: {lines[-1:]}"
            _assert_one_line_error(lines)
            assert not (work / "out").exists() and _left_beside(work) == [], name
    assert sum(code == 0 for code in outcomes.values()) == 2, outcomes
    assert len(outcomes) >= 26


# -- 7. "empty" weights allocate nothing ------------------------------------------------------

def test_a_huge_vocabulary_allocates_nothing(tmp_path):
    """A 2**26-token x 1024 fp32 table is 256 GiB: building the model must not ask for it (before,
    accelerate's init_empty_weights ran torch.empty first). The address space is capped at 16 GiB
    so that a machine that overcommits memory fails the same way."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=2**26, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, architectures=["LlamaForCausalLM"])
    config.save_pretrained(tmp_path / "huge")
    build_preset("tiny-llama")[1].save_pretrained(tmp_path / "huge")
    capped = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30)); "
              "from exporter.cli import main; sys.exit(main(['plan', sys.argv[1]]))")
    done = subprocess.run([sys.executable, "-c", capped, str(tmp_path / "huge")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


# -- found in review: a second destination, long names, a re-created -o, extra files --------

def test_another_destinations_staging_folder_is_not_touched(exported, checkpoint, tmp_path, capsys):
    # `.out.partial-b.partial-XXXXXXXX` is the staging folder of `-o out.partial-b`, killed mid-swap.
    other = tmp_path / ".out.partial-b.partial-killed_2"
    other.mkdir()
    (other / destination.LOCK_NAME).write_text("12345\n")
    shutil.copytree(exported, other / "package")
    shutil.copytree(exported, other / "previous")
    code, _ = _run_cli([checkpoint, "-o", tmp_path / "out"], capsys)
    assert code == 0
    assert (other / "previous" / "genai_config.json").is_file()  # still there for `-o out.partial-b`
    code, _ = _run_cli([checkpoint, "-o", tmp_path / "out.partial-b"], capsys)
    assert code == 2  # its old package was moved back: -o exists now
    assert not other.exists() and (tmp_path / "out.partial-b" / "genai_config.json").is_file()


def test_a_name_too_long_for_the_staging_folder_fails_up_front(checkpoint, tmp_path, capsys, monkeypatch):
    _no_work(monkeypatch)
    out = tmp_path / ("n" * 245)  # fits in 255 bytes; .NAME.partial-XXXXXXXX does not
    code, lines = _run_cli([checkpoint, "-o", out], capsys)
    assert code == 2
    _assert_one_line_error(lines, "is too long for this file system", "choose a shorter -o")
    assert list(tmp_path.iterdir()) == []


def test_parent_folders_made_for_a_failed_export_are_removed(checkpoint, tmp_path, capsys, monkeypatch):
    def failing_save(*args, **kwargs):
        raise OSError(errno.EIO, os.strerror(errno.EIO), "somewhere")

    monkeypatch.setattr(package, "save_model", failing_save)
    code, lines = _run_cli([checkpoint, "-o", tmp_path / "new" / "deeper" / "out"], capsys)
    assert code == 2
    _assert_one_line_error(lines, "an input/output error", "check the disk or choose another -o")
    assert list(tmp_path.iterdir()) == []


def test_a_package_recreated_during_the_swap_keeps_the_old_one_aside(exported, checkpoint, tmp_path, capsys,
                                                                      monkeypatch):
    out = shutil.copytree(exported, tmp_path / "out")
    (out / "model.onnx.data").write_bytes(b"old")
    real_rename = os.rename

    def rename(source, target):
        if Path(source).name == "package" and Path(target) == out:
            out.mkdir()  # another process creates -o between the two renames
            (out / "theirs.txt").write_text("theirs")
        return real_rename(source, target)

    monkeypatch.setattr(destination.os, "rename", rename)
    code, lines = _run_cli([checkpoint, "-o", out, "--overwrite"], capsys)
    assert code == 2
    message = _assert_one_line_error(lines, "was created again", "the old package is kept in", "nothing was deleted")
    kept = Path(message.split("kept in '")[1].split("'")[0])
    assert (kept / "model.onnx.data").read_bytes() == b"old"
    assert sorted(p.name for p in out.iterdir()) == ["theirs.txt"]
    # The next export leaves both alone: -o is someone else's now, and the old package stays aside.
    monkeypatch.setattr(destination.os, "rename", real_rename)
    code, _ = _run_cli([checkpoint, "-o", tmp_path / "elsewhere"], capsys)
    assert code == 0 and (kept / "model.onnx.data").read_bytes() == b"old"


def test_overwrite_refuses_a_package_holding_files_its_export_did_not_write(exported, checkpoint, tmp_path, capsys,
                                                                            monkeypatch):
    _no_work(monkeypatch)
    out = shutil.copytree(exported, tmp_path / "out")
    (out / "my-notes").mkdir()
    code, lines = _run_cli([checkpoint, "-o", out, "--overwrite"], capsys)
    assert code == 2
    _assert_one_line_error(lines, "holds 'my-notes', which its export did not write", "move it out of -o")
    assert (out / "my-notes").is_dir()

