"""Quantized packages of real trained checkpoints (Gemma 3 270M, Qwen2.5-Coder 0.5B; see
``tests/helpers/real_checkpoints.py``) judged as ``check --against`` judges them: by their distribution
against transformers fp32 (mean KL, top-1 agreement, perplexity on real prose; the bounds of
``exporter.precisions``).

The default int4 and int8 packages pass. Packages broken the ways an exporter breaks them fail:
every MatMulNBits reading its scales one block off, a dropped scalar (Gemma's embedding scale of
sqrt(hidden size)), and transposed square weights (Qwen's attention output projections). The
slow part is building the checkpoint folders (about a minute each) and the exports.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
import torch
import transformers

from exporter import export
from exporter.verify.check_against import compare_with_source
from tests.helpers.real_checkpoints import gemma3_270m_folder, qwen25_coder_05b_folder

pytestmark = [pytest.mark.slow, pytest.mark.l4, pytest.mark.xdist_group("real_quantization")]

CHECKPOINTS = {"gemma-3-270m": gemma3_270m_folder, "qwen2.5-coder-0.5b": qwen25_coder_05b_folder}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def real(request, tmp_path_factory):
    """(name, checkpoint folder, default int4 package) on the cpu profile."""
    name = request.param
    folder = CHECKPOINTS[name](tmp_path_factory.mktemp("gguf"), tmp_path_factory.mktemp(name))
    package = export(str(folder), ep="cpu", precision="int4", output_dir=tmp_path_factory.mktemp("int4") / name)
    return name, folder, package.path


def _results(package: Path, folder: Path, precision: str) -> dict[str, tuple[bool, str]]:
    return {check: (passed, detail) for check, passed, detail in compare_with_source(package, folder, precision)}


def _edited(package: Path, out: Path, edit) -> Path:
    """A copy of ``package`` whose decoder graph ``edit(graph)`` changed (weights rewritten)."""
    shutil.copytree(package, out, ignore=shutil.ignore_patterns("model.onnx", "model.onnx.data"))
    model = ir.load(str(package / "model.onnx"))
    edit(model.graph)
    ir.save(model, str(out / "model.onnx"), external_data="model.onnx.data")
    return out


def test_default_int4_passes_check_against(real):
    name, folder, package = real
    results = _results(package, folder, "int4")
    print(name, results["source_distribution"][1])
    assert results["source_distribution"][0], results["source_distribution"][1]
    assert results["source_tokens"][0], results["source_tokens"][1]


def test_int8_is_near_lossless(real, tmp_path):
    name, folder, _ = real
    package = export(str(folder), ep="cpu", precision="int8", output_dir=tmp_path / "int8").path
    results = _results(package, folder, "int8")
    print(name, results["source_distribution"][1])
    assert results["source_distribution"][0], results["source_distribution"][1]


def _scales_one_block_off(graph: ir.Graph) -> None:
    for node in graph:
        if node.op_type == "MatMulNBits":
            scales = node.inputs[2]
            scales.const_value = ir.tensor(np.roll(scales.const_value.numpy(), 1, axis=1), name=scales.name)


def test_scales_one_block_off_fail_check_against(real, tmp_path):
    name, folder, package = real
    broken = _edited(package, tmp_path / "broken", _scales_one_block_off)
    results = _results(broken, folder, "int4")
    print(name, results["source_distribution"][1])
    assert not results["source_distribution"][0], results["source_distribution"][1]


@pytest.mark.parametrize("real", ["gemma-3-270m"], indirect=True)  # Qwen has no scalar constant
def test_a_dropped_scalar_fails_check_against(real, tmp_path):
    """Gemma multiplies its embeddings by sqrt(hidden size) (25.3 here), a constant of the graph."""
    name, folder, package = real

    def drop_embedding_scale(graph: ir.Graph) -> None:
        scale = next(v for n, v in graph.initializers.items() if n.endswith("embed_scale"))
        scale.const_value = ir.tensor(np.ones_like(scale.const_value.numpy()), name=scale.name)

    broken = _edited(package, tmp_path / "broken", drop_embedding_scale)
    results = _results(broken, folder, "int4")
    print(name, results["source_distribution"][1])
    assert not results["source_distribution"][0], results["source_distribution"][1]


@pytest.mark.parametrize("real", ["qwen2.5-coder-0.5b"], indirect=True)  # Gemma 3 270M has no square weight
def test_transposed_weights_fail_check_against(real, tmp_path):
    """Every attention output projection (896 x 896) read transposed, exported from memory."""
    name, folder, _ = real
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.copy_(layer.self_attn.o_proj.weight.T.clone())
    package = export(model, tokenizer, ep="cpu", precision="int4", output_dir=tmp_path / "transposed").path
    del model
    results = _results(package, folder, "int4")
    print(name, results["source_distribution"][1])
    assert not results["source_distribution"][0], results["source_distribution"][1]
