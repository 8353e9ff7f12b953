"""A GGUF file (llama.cpp's format) as a source: found from a path, described by its tensors'
formats, and loaded by transformers' own GGUF loader (``gguf_file=``, with the ``gguf`` package),
which maps the architecture, config and tokenizer and dequantizes every tensor to float32.

Unlike a safetensors folder, whose tensors stream one at a time, the dequantized model is whole in
memory (4 bytes per parameter), and the package's precision quantizes the dequantized weights
again: the file's own integers are not repacked."""

from __future__ import annotations

import collections
from pathlib import Path

import torch
import transformers

from exporter.errors import ExporterError

SUFFIX = ".gguf"


def gguf_file(path: Path) -> Path | None:
    """The GGUF file ``path`` names: itself, or the one ``*.gguf`` in a folder without a
    config.json; None where ``path`` is not such a source."""
    if path.is_file():
        return path if path.suffix == SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob(f"*{SUFFIX}"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files[:4]) + (" ..." if len(files) > 4 else "")
        raise ExporterError(f"'{path}' holds {len(files)} GGUF files ({names}); pass the path of the one to export")
    return files[0] if files else None


def _gguf_module():
    try:
        import gguf
    except ImportError as error:
        raise ExporterError("reading a GGUF file needs the gguf package: pip install 'genai-exporter[gguf]'") from error
    return gguf


def tensor_formats(path: Path) -> dict[str, int]:
    """How many of the file's tensors are stored in each format (Q4_K, Q6_K, F32, ...), read from
    its header through the gguf package's memory-mapped reader."""
    reader = _gguf_module().GGUFReader(str(path))
    return dict(sorted(collections.Counter(t.tensor_type.name for t in reader.tensors).items()))


def load_gguf(path: Path, trust_remote_code: bool = False) -> tuple[transformers.PreTrainedModel, object, str]:
    """(transformers' float32 model of the file, its tokenizer, what the report says of it)."""
    formats = _read(path, lambda: tensor_formats(path))
    kwargs = {"gguf_file": path.name, "trust_remote_code": trust_remote_code}
    model = _read(path, lambda: transformers.AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32,
                                                                                  **kwargs))
    tokenizer = _read(path, lambda: transformers.AutoTokenizer.from_pretrained(path.parent, **kwargs))
    model.hf_quantizer = None  # the weights are plain float32 tensors now
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    parameters = sum(p.numel() for p in model.parameters())
    listed = ", ".join(f"{name} {count}" for name, count in formats.items())
    note = (f"GGUF file {path.name}: {sum(formats.values())} tensors ({listed}), dequantized to float32 by "
            f"transformers' GGUF loader ({parameters * 4 / 2**30:.1f} GiB in memory) and exported from there at the "
            "package's precision (the file's quantized blocks are not repacked)")
    return model.eval(), tokenizer, note


def _read(path: Path, step):
    try:
        return step()
    except ExporterError:
        raise
    except Exception as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ExporterError(f"cannot read the GGUF file '{path}': {first}") from error
