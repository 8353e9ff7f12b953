"""Replays: the command line re-exports a checkpoint folder whose every input but its weight values
is one it has exported before by copying that export's package with the new checkpoint's bytes. It
imports neither torch nor transformers, and traces, lowers and runs no pass: a training run's
checkpoints re-export in the time their weights take to copy.

After a command-line export of a folder, the package is recorded in the cache folder
(``exporter.cache.cache_folder``) as a replay, where no value was read before writing (so no value
decided the graph) and every weight the package holds is made from one checkpoint tensor by steps
a replay repeats (``weights.weight_origins``): copied file to file as stored (same dtype, whole or
whole rows), or cut, converted between float types, reshaped, transposed and cast
(``weights.DerivedWeight``, made with numpy by ``exporter.weights.derived_weights`` and checked against
the package when recording). The record keeps every package file but the weight data and the
report, and says where each byte range of the data files comes from: a checkpoint tensor (by key,
so that the next checkpoint's own offsets are used), copied or derived, or bytes that depend on no
weight (rotary tables, constants), kept in the record. Weights small enough to sit inside a model
file are patched in place at positions found when recording.

The key (``fingerprint``) is a sha256 of: the replay format; the exporter's own files; the Python
and library versions and the CPU architecture; the export's options; and every file of the folder
the export can read, by content, but the safetensors files (hidden ones too: the loader opens
them), by their header less its byte offsets and metadata (names, dtypes, shapes). Left out: files
no export of a folder with safetensors reads (``trainer_state.json``, rewritten by a Trainer at
every save; weights in other formats; other hidden files). Not seen, where the graph cache's key
sees it: the code of transformers' registered attention and mask functions edited in place at the
same version. A replay also checks that the files defining the model's classes (the graph cache's
``model_files``) still have the recorded digests, that the entry and its record are whole, that
safetensors reads the new checkpoint as valid, and that every piece lies inside its tensor there.

Only the console command replays (``cli.run``), and only what it recorded: it starts a fresh process,
where nothing can have patched the model's classes or hooked its modules. A library caller's process
may have (Liger and Unsloth patch transformers' classes), which only the graph cache's key, built
from the model itself, sees; ``export()`` uses that cache and never replays. The replayed package
is byte-identical to an export without any cache but for its report, which says it was replayed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exporter.cache import fingerprints
from exporter.cache.cache_folder import KEY_FILENAME
from exporter.package import destination
from exporter.package.files import REPORT_FILENAME, REPORT_MARKDOWN_FILENAME, save_report
from exporter.package.report import ExportReport
from exporter.stages import StageLog
from exporter.weights.safetensors_header import read_header

FORMAT = 1
RECORD_FILENAME = "replay.json"
LITERALS_FILENAME = "literals.bin"
FILES_FOLDER = "files"
# What a replayed package depends on beyond the folder and the options: the graph (torch,
# transformers, onnx*), the tokenizer files (transformers, tokenizers) and the model files'
# serialization (protobuf); and the conversions a replay makes (numpy's, ml-dtypes' for bf16).
_LIBRARIES = (*fingerprints.GRAPH_LIBRARIES, "tokenizers", "sentencepiece", "protobuf", "safetensors", "ml-dtypes")
# Files no export of a folder with safetensors reads: the Trainer's state, rewritten at each save,
# and weights in other formats (pickled optimizer and RNG states among them; GGUF, ONNX, ...),
# which could take seconds to hash.
_NOT_READ_NAMES = frozenset({"trainer_state.json"})
_NOT_READ_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".gguf", ".onnx", ".data", ".msgpack", ".h5",
                                ".npz"})
_COPY_CHUNK = 1 << 30
# Where a report names the checkpoint's folder: its source (``exporter.load.sources``: ``folder PATH``)
# and the weights' description (``SafetensorsWeights``: ``the checkpoint in PATH``), PATH ending
# the text or followed by a space or a path separator.
_NAMING_THE_FOLDER = r"(^folder |the checkpoint in ){}(?=$|[\s/])"


def fingerprint(folder: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Everything a replay of ``folder`` exported with ``options`` depends on, as JSON values."""
    return {
        "format": FORMAT,
        "exporter": fingerprints.project_digest(),
        "python": fingerprints.python_version(),
        "machine": fingerprints.machine(),
        "libraries": fingerprints.versions(_LIBRARIES),
        "options": options,
        "folder": _folder_digests(folder),
    }


def key_of(ingredients: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(ingredients, sort_keys=True).encode()).hexdigest()[:32]


def _folder_digests(folder: Path) -> dict[str, str]:
    digests = {}
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if not path.is_file():
            continue
        if path.suffix == ".safetensors":  # hidden ones too: the loader's glob opens them
            digests[relative.as_posix()] = _header_digest(_safetensors_header(path)[1])
        elif not (any(part.startswith(".") for part in relative.parts) or path.name in _NOT_READ_NAMES
                  or path.suffix in _NOT_READ_SUFFIXES):
            with open(path, "rb") as file:
                digests[relative.as_posix()] = hashlib.file_digest(file, "sha256").hexdigest()
    return digests


def _header_digest(header: dict[str, Any]) -> str:
    """A safetensors header less its byte offsets: the names, dtypes and shapes."""
    entries = {key: {k: v for k, v in entry.items() if k != "data_offsets"} for key, entry in header.items()}
    return "header " + _sha256(json.dumps(entries, sort_keys=True).encode())


def _safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """Where the data starts and the header (less ``__metadata__``: tensors only), of a file that
    safetensors itself reads (it checks that the tensors tile the data exactly, as an export's
    reader does); raises where it does not."""
    from safetensors import safe_open

    safe_open(str(path), framework="numpy")
    data_start, header = read_header(path)
    header.pop("__metadata__", None)
    return data_start, header


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclasses.dataclass(frozen=True)
class Replayed:
    path: Path
    report: ExportReport


def replay(root: Path, ingredients: dict[str, Any], folder: Path, output_dir: Path, overwrite: bool) -> Replayed | None:
    """The package of ``folder`` written into ``output_dir`` from its recorded replay; None where
    the cache holds none for these ingredients (or one that is torn, altered, made with model code
    that has changed since, or that does not fit the checkpoint), and the caller exports."""
    stages = StageLog()
    entry = root / key_of(ingredients)
    with contextlib.ExitStack() as opened:
        with stages.stage("replay"):
            # Every file of the entry is opened (and checked) before anything is written: a
            # prune of the cache meanwhile cannot take them away.
            found = _open_entry(entry, opened)
            if found is None:
                return None
            record, entry_files = found
            try:
                checkpoint = {name: (opened.enter_context(open(folder / name, "rb")), _safetensors_header(folder / name))
                              for name in record["checkpoint_files"]}
            except Exception:  # unreadable or not safetensors: the export says what is wrong
                return None
            keyed = ingredients["folder"]
            if any(keyed.get(name) != _header_digest(header) for name, (_, (_, header)) in checkpoint.items()):
                return None  # the folder changed since its fingerprint
            if not _fits(record, checkpoint):
                return None
            target = destination.check_destination(output_dir, overwrite)
            destination.require_space(target, record["package_bytes"])
        try:
            with destination.staging_folder(target) as staging:
                with stages.stage("package"):
                    _write(record, entry_files, checkpoint, staging)
                report = _report(record, folder, root, entry)
                save_report(report, stages, staging)
        except _NotRepeatable as error:  # the export makes it, and says why it is not recorded
            print(f"  not replayed: weight {error}", file=sys.stderr)
            return None
    with contextlib.suppress(OSError):  # a read-only cache still serves
        os.utime(entry)  # recently used: pruned last
    return Replayed(output_dir, report)


def _fits(record: dict[str, Any], checkpoint: dict[str, tuple]) -> bool:
    """Whether every piece the record takes from the checkpoint lies inside its tensor there, and
    each data file's pieces tile it."""
    try:
        pieces = [p for patches in record["inline_weights"].values() for p in patches]
        for data in record["data_files"].values():
            at = 0
            for piece in data["pieces"]:
                if piece["offset"] != at or piece["length"] < 0:
                    return False
                at += piece["length"]
                pieces.append(piece)
            if at != data["bytes"]:
                return False
        for piece in pieces:
            if "literal" in piece:
                continue
            entry = checkpoint[piece["file"]][1][1][piece["key"]]
            if "derive" in piece:
                from exporter.weights.derived_weights import derived_length

                if derived_length(entry, piece["derive"]) != piece["length"]:
                    return False
                continue
            begin, end = entry["data_offsets"]
            if not (0 <= piece["at"] and piece["at"] + piece["length"] <= end - begin):
                return False
    except (KeyError, TypeError, ValueError, IndexError):
        return False
    return True


def _open_entry(entry: Path, opened: contextlib.ExitStack) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The entry's record and its files, open and checked against the record's digests."""
    try:
        record = json.loads((entry / RECORD_FILENAME).read_text())
        if record["format"] != FORMAT or record["sha256"] != _record_digest(record):
            return None
        files = {}
        for name, digest in record["entry_files"].items():
            files[name] = file = opened.enter_context(open(entry / name, "rb"))
            if hashlib.file_digest(file, "sha256").hexdigest() != digest:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing, torn or altered: the export runs, and records anew
    if not all(_inside(name) for name in (*record["package_files"], *record["data_files"], *record["inline_weights"],
                                          *record["checkpoint_files"])):
        return None  # a record naming files outside the package or the folder was not written by record()
    if any(_model_file_digest(path) != digest for path, digest in record["model_files"].items()):
        return None  # transformers' (or the checkpoint's) model code changed without a version change
    return record, files


def _record_digest(record: dict[str, Any]) -> str:
    return _sha256(json.dumps({k: v for k, v in record.items() if k != "sha256"}, sort_keys=True).encode())


def _inside(name: str) -> bool:
    path = Path(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts


def _model_file_digest(relative: str) -> str | None:
    """The sha256 of a model source file the graph cache keyed, found below a sys.path entry as
    the graph cache names it (None where no entry holds it)."""
    for base in sys.path:
        path = Path(base or ".") / relative
        if path.is_file():
            return _sha256(path.read_bytes())
    return None


class _NotRepeatable(Exception):
    """A derived weight of this checkpoint that numpy would not make as torch does."""


def _write(record: dict[str, Any], entry_files: dict[str, Any], checkpoint: dict[str, tuple], staging: Path) -> None:
    literals = entry_files[LITERALS_FILENAME]

    def source_of(piece: dict[str, Any]) -> tuple[Any, int]:
        if "literal" in piece:
            return literals, piece["literal"]
        file, (data_start, header) = checkpoint[piece["file"]]
        return file, data_start + header[piece["key"]]["data_offsets"][0] + piece["at"]

    for name in record["package_files"]:
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        source = entry_files[f"{FILES_FOLDER}/{name}"]
        with open(staging / name, "wb") as file:
            _copy_range(source, 0, file, 0, os.fstat(source.fileno()).st_size)
    for name, patches in record["inline_weights"].items():
        with open(staging / name, "r+b") as model_file:
            for patch in patches:
                if "derive" in patch:
                    _write_derived(patch, checkpoint, model_file, patch["at_in_model"])
                    continue
                file, offset = source_of(patch)
                os.pwrite(model_file.fileno(), os.pread(file.fileno(), patch["length"], offset), patch["at_in_model"])
    for name, data in record["data_files"].items():
        with open(staging / name, "wb") as data_file:
            for piece in data["pieces"]:
                if "derive" in piece:
                    _write_derived(piece, checkpoint, data_file, piece["offset"])
                    continue
                file, offset = source_of(piece)
                _copy_range(file, offset, data_file, piece["offset"], piece["length"])
            data_file.truncate(data["bytes"])


def _write_derived(piece: dict[str, Any], checkpoint: dict[str, tuple], target, at: int) -> None:
    """A derived weight (``exporter.weights.derived_weights``), made from the new checkpoint's tensor."""
    from exporter.weights.derived_weights import NotRepeatable, derived_chunks

    file, (data_start, header) = checkpoint[piece["file"]]
    written = 0
    try:
        for chunk in derived_chunks(file, data_start, header[piece["key"]], piece["derive"]):
            written += _write_all(target, chunk, at + written)
    except NotRepeatable as error:
        raise _NotRepeatable(f"{piece['key']}: {error}") from error
    if written != piece["length"]:
        raise OSError(f"{piece['key']} made {written} bytes where the record has {piece['length']}")


def _write_all(target, data, at: int) -> int:
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(target.fileno(), view[done:], at + done)
    return done


def _copy_range(source, source_offset: int, target, target_offset: int, length: int) -> None:
    """``length`` bytes, file to file: in the kernel where the OS and filesystems can
    (``copy_file_range``), else through a buffer."""
    copied = 0
    copy_file_range = getattr(os, "copy_file_range", None)
    if copy_file_range is not None:
        with contextlib.suppress(OSError):  # another filesystem, or an OS that refuses: the buffer below
            while copied < length:
                done = copy_file_range(source.fileno(), target.fileno(), min(_COPY_CHUNK, length - copied),
                                       source_offset + copied, target_offset + copied)
                if done == 0:
                    break
                copied += done
    while copied < length:
        chunk = os.pread(source.fileno(), min(64 << 20, length - copied), source_offset + copied)
        if not chunk:
            raise OSError(f"{source.name} ends before the {length} bytes its header gives at {source_offset}")
        copied += _write_all(target, chunk, target_offset + copied)


def _report(record: dict[str, Any], folder: Path, root: Path, entry: Path) -> ExportReport:
    """The recorded export's report, for this folder: its source and the notes that name the
    folder say this one; the graph cache says the package was replayed."""
    report = ExportReport.from_dict(record["report"])
    recorded = re.compile(_NAMING_THE_FOLDER.format(re.escape(record["folder_text"])))
    report.source = recorded.sub(lambda match: match[1] + str(folder), report.source)
    report.notes = [recorded.sub(lambda match: match[1] + str(folder), note) for note in report.notes]
    report.graph_cache = {"folder": str(root), "key": record["graph_key"], "replay": entry.name,
                          "sessions": dict.fromkeys(report.sessions, "replayed")}
    report.stages, report.files = [], {}
    return report


# Recording (after a command-line export; imports onnx, which the export has imported already).

def record(root: Path, ingredients: dict[str, Any], folder: Path, package: Path,
           origins: dict[str, dict[str, Any]], report: dict[str, Any]) -> str | None:
    """Record ``package``, exported from ``folder`` with ``ingredients``, as a replay; returns why
    not where it cannot be. ``origins``: each model file -> its weight initializers -> where each
    one's bytes come from, a ``FileRange`` or a ``DerivedWeight`` (``ExportedPackage.weight_origins``).
    ``report``: the package's report as written."""
    graph_cache = report.get("graph_cache", {})
    if "key" not in graph_cache:
        return f"the graph cache did not key the model ({graph_cache.get('off', 'no key')})"
    try:
        model_files = json.loads((root / graph_cache["key"] / KEY_FILENAME).read_text())["model_files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "the graph cache holds no key record for this model"
    checkpoint = _CheckpointRanges(folder)
    entry = root / key_of(ingredients)
    scratch = Path(tempfile.mkdtemp(dir=root, prefix=f".{entry.name}."))
    try:
        inline, pieces_of, data_files = {}, {}, {}
        for name, weights in origins.items():
            located = _locate_initializers(package, name, weights, checkpoint)
            if isinstance(located, str):
                return located
            inline[name], external = located
            for data_name, pieces in external.items():  # a data file several model files share: all theirs
                pieces_of.setdefault(data_name, []).extend(pieces)
        with open(scratch / LITERALS_FILENAME, "wb") as literals:
            for data_name, pieces in pieces_of.items():
                data_files[data_name] = _data_file_record(package, data_name, pieces, literals)
        files = [p.relative_to(package).as_posix() for p in sorted(package.rglob("*")) if p.is_file()]
        package_files = [f for f in files if f not in data_files and f not in (REPORT_FILENAME, REPORT_MARKDOWN_FILENAME)]
        for name in package_files:
            (scratch / FILES_FOLDER / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(package / name, scratch / FILES_FOLDER / name)
        entry_files = [LITERALS_FILENAME, *(f"{FILES_FOLDER}/{name}" for name in package_files)]
        values = {
            "format": FORMAT,
            "graph_key": graph_cache["key"],
            "model_files": model_files,
            "folder_text": str(folder),
            "checkpoint_files": sorted(checkpoint.files),
            "package_files": package_files,
            "package_bytes": sum((package / f).stat().st_size for f in files),
            "inline_weights": inline,
            "data_files": data_files,
            "report": report,
            "entry_files": {name: _sha256((scratch / name).read_bytes()) for name in entry_files},
        }
        values["sha256"] = _record_digest(values)
        (scratch / KEY_FILENAME).write_text(json.dumps(ingredients, indent=1, sort_keys=True))
        (scratch / RECORD_FILENAME).write_text(json.dumps(values))
        shutil.rmtree(entry, ignore_errors=True)  # a torn or stale record of the same key
        os.replace(scratch, entry)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return None


class _CheckpointRanges:
    """Which checkpoint key, and where in its bytes or how from its values, a weight's bytes come:
    a ``FileRange`` found by the name of the file the export opened (``FileRange.file_name``), or
    a ``DerivedWeight``'s tensor."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.files: dict[str, tuple[int, dict[str, Any]]] = {}

    def _header(self, name: str) -> tuple[int, dict[str, Any]] | None:
        if not name or not _inside(name) or not (self.folder / name).is_file():
            return None
        if name not in self.files:
            self.files[name] = _safetensors_header(self.folder / name)
        return self.files[name]

    def piece(self, origin) -> dict[str, Any] | None:
        from exporter.weights.origins import DerivedWeight

        if isinstance(origin, DerivedWeight):
            return self._derived_piece(origin)
        name = origin.file_name
        if (found := self._header(name)) is None:
            return None
        data_start, header = found
        for key, entry in header.items():
            begin, end = (data_start + offset for offset in entry["data_offsets"])
            if begin <= origin.offset and origin.offset + origin.length <= end and (begin < end):
                return {"file": name, "key": key, "at": origin.offset - begin, "length": origin.length}
        return None

    def _derived_piece(self, derived) -> dict[str, Any] | None:
        from exporter.weights.derived_weights import derived_length

        stored = derived.stored
        if (found := self._header(stored.file_name)) is None:
            return None
        entry = found[1].get(stored.key)
        if entry is None or (entry["dtype"], tuple(entry["shape"])) != (stored.dtype, stored.shape):
            return None
        derive = {"index": None if derived.index is None else [list(cut) for cut in derived.index],
                  "to": derived.dtype, "steps": [[step, argument if step == "cast" else list(argument)]
                            for step, argument in derived.steps]}
        return {"file": stored.file_name, "key": stored.key, "derive": derive, "length": derived_length(entry, derive)}

    def derived_differs(self, piece: dict[str, Any], expected: Callable[[int, int], bytes]) -> str | None:
        """None where numpy makes ``piece`` from this checkpoint as the export did (the bytes
        ``expected(at, length)`` gives); else how it differs."""
        from exporter.weights.derived_weights import NotRepeatable, derived_chunks

        data_start, header = self.files[piece["file"]]
        at = 0
        with open(self.folder / piece["file"], "rb") as file:
            try:
                for chunk in derived_chunks(file, data_start, header[piece["key"]], piece["derive"]):
                    if expected(at, chunk.size) != chunk.tobytes():
                        return "numpy does not make its bytes as torch did"
                    at += chunk.size
            except NotRepeatable as error:
                return str(error)
        return None if at == piece["length"] else "numpy makes another length than the export wrote"


def _locate_initializers(package: Path, name: str, weights: dict[str, Any], checkpoint: _CheckpointRanges):
    """For one model file: the positions in it of the weights stored inside it (to patch), and for
    each data file (by its path in the package) its pieces (offset, length, a checkpoint piece or
    None); a string where the file cannot be replayed."""
    import numpy as np
    import onnx

    model_path = package / name
    proto_bytes = model_path.read_bytes()
    proto = onnx.load_model_from_string(proto_bytes)
    if proto.SerializeToString() != proto_bytes:
        return f"{model_path.name} does not read back byte for byte, so its inline weights cannot be patched"
    pieces_of, inline = {}, []
    for tensor in proto.graph.initializer:
        piece = checkpoint.piece(weights[tensor.name]) if tensor.name in weights else None
        if tensor.name in weights and piece is None:
            return f"weight {tensor.name} is made from a file outside the checkpoint's safetensors"
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            where = {entry.key: entry.value for entry in tensor.external_data}
            data_name = (Path(name).parent / where["location"]).as_posix()
            offset, length = int(where.get("offset", 0)), int(where["length"])
            pieces_of.setdefault(data_name, []).append((offset, length, piece))
            if piece is not None and "derive" in piece:
                differs = ("numpy makes another length than the export wrote" if length != piece["length"] else
                           checkpoint.derived_differs(piece, functools.partial(_read_at, package / data_name, offset)))
                if differs:
                    return f"weight {tensor.name}: {differs}"
        elif piece is not None:
            if len(tensor.raw_data) != piece["length"]:
                return f"weight {tensor.name} is stored inside {model_path.name} in a form other than its bytes"
            if "derive" in piece and (differs := checkpoint.derived_differs(
                    piece, lambda at, length, raw=tensor.raw_data: raw[at:at + length])):
                return f"weight {tensor.name}: {differs}"
            inline.append((tensor, piece))
    # Where each inline weight's bytes sit: the model serialized with them all zeros and all ones
    # differs in exactly those bytes, one run per weight, in the file's order.
    positions = []
    if inline:
        originals = [tensor.raw_data for tensor, _ in inline]
        serialized = []
        for fill in (0x00, 0xFF):
            for tensor, piece in inline:
                tensor.raw_data = bytes([fill]) * piece["length"]
            serialized.append(np.frombuffer(proto.SerializeToString(), np.uint8))
        for (tensor, _), original in zip(inline, originals, strict=True):
            tensor.raw_data = original
        differ = np.flatnonzero(serialized[0] != serialized[1])
        starts = differ[np.concatenate(([True], np.diff(differ) > 1))] if differ.size else differ
        lengths = [piece["length"] for _, piece in inline]
        if len(starts) != len(inline) or sum(lengths) != differ.size:
            return f"the inline weights of {model_path.name} could not be located"
        for start, (_, piece), original in zip(starts.tolist(), inline, originals, strict=True):
            if proto_bytes[start:start + piece["length"]] != original:
                return f"the inline weights of {model_path.name} could not be located"
            positions.append({**piece, "at_in_model": start})
    return positions, pieces_of


def _read_at(path: Path, offset: int, at: int, length: int) -> bytes:
    with open(path, "rb") as file:
        return os.pread(file.fileno(), length, offset + at)


def _data_file_record(package: Path, data_name: str, pieces: list, literals) -> dict[str, Any]:
    """A data file as pieces in order: checkpoint pieces, and every other byte range (constants,
    padding) copied into the record's literals."""
    path = package / data_name
    size = path.stat().st_size
    ordered, at = [], 0
    with open(path, "rb") as data:
        def literal(begin: int, end: int) -> None:
            ordered.append({"offset": begin, "length": end - begin, "literal": literals.tell()})
            for start in range(begin, end, 64 << 20):
                literals.write(os.pread(data.fileno(), min(64 << 20, end - start), start))

        for offset, length, piece in sorted(pieces, key=lambda p: p[0]):
            if piece is None:
                continue
            if offset > at:
                literal(at, offset)
            ordered.append({"offset": offset, "length": length,
                            **{k: piece[k] for k in ("file", "key", "at", "derive") if k in piece}})
            at = offset + length
        if size > at:
            literal(at, size)
    return {"bytes": size, "pieces": ordered}
