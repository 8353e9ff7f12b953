"""gpt-oss: a family the GroupQueryAttention pass was not built for exports with transformers'
attention in every layer (the fallback), and matches transformers.

gpt-oss's eager attention appends a learned sink logit per head to the scores before the softmax,
a form the attention-core matcher does not recognise: the pass leaves every layer plain and the
report says why, instead of failing the export. The checkpoint is the ``tiny-gpt-oss`` preset with
its constants moved (``move_constant_tensors``) and, as trained weights have them, sinks of order 1
and expert and attention biases far from zero (init leaves them near zero, where dropping them
would go unseen), saved by ``save_pretrained``; packages are exported from the folder (streamed)
and from transformers' load of it in memory.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from exporter import ExporterError, export
from exporter.load.presets import build_preset
from tests.helpers.checkpoints import perturb_constant_tensors, save_checkpoint
from tests.helpers.generation import (
    LONG_PROMPT,
    PROMPT_LONGER_THAN_WINDOW,
    SHORT_PROMPT,
    genai_greedy,
    transformers_greedy,
)
from tests.helpers.parity import TOLERANCE, check_parity

PRESET = "tiny-gpt-oss"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, transformers' load of it, its tokenizer)."""
    model, tokenizer = build_preset(PRESET)
    perturb_constant_tensors(model, seed=3)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("sinks"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 2.0)
            elif "bias" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    folder = save_checkpoint(model, tokenizer, tmp_path_factory.mktemp("gpt_oss") / "checkpoint")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, reloaded, tokenizer


@pytest.fixture(scope="module")
def packages(checkpoint, tmp_path_factory):
    folder, model, tokenizer = checkpoint
    root = tmp_path_factory.mktemp("gpt_oss_packages")
    return {"folder": export(str(folder), output_dir=root / "folder", strict=True, cache=False),
            "in memory": export(model, tokenizer, output_dir=root / "memory", cache=False)}


@pytest.mark.l1
def test_sinks_and_biases_decide_the_logits(checkpoint):
    """The reference would show a dropped sink: zeroing the sinks moves its logits by far more than
    the parity tolerance (1e-4) that the L3 test holds the package to."""
    model = checkpoint[1]
    ids = torch.tensor([LONG_PROMPT])
    with torch.no_grad():
        want = model(ids).logits
        sinks = {n: p.clone() for n, p in model.named_parameters() if n.endswith("sinks")}
        for name, parameter in model.named_parameters():
            if name in sinks:
                parameter.zero_()
        without = model(ids).logits
        for name, parameter in model.named_parameters():
            if name in sinks:
                parameter.copy_(sinks[name])
    assert torch.isfinite(want).all() and torch.isfinite(without).all()
    assert float((want - without).abs().max()) > 100 * TOLERANCE


@pytest.mark.l1
@pytest.mark.parametrize("source", ["folder", "in memory"])
def test_every_layer_falls_back_to_plain_attention_with_a_reason(packages, source):
    package = packages[source]
    record = next(r for r in package.report.fx_passes if r["name"] == "substitute_group_query_attention")
    plain = record["changes"]["plain_layers"]
    assert sorted(int(layer) for layer in plain) == [0, 1, 2, 3]
    assert all("its attention was not recognised" in why for why in plain.values())
    assert any("4 of 4 layers keep transformers' attention" in note for note in package.report.notes)
    config = json.loads((package.path / "genai_config.json").read_text())
    assert config["search"]["past_present_share_buffer"] is False  # plain layers: separate past and present
    assert "GroupQueryAttention" not in " ".join(package.report.op_counts)


@pytest.mark.l3
@pytest.mark.parametrize("source", ["folder", "in memory"])
def test_logits_and_presents_match_transformers(packages, checkpoint, source):
    check_parity(packages[source], checkpoint[1])  # logits and every present within 1e-4, NaN failing


@pytest.mark.l4
@pytest.mark.parametrize("source", ["folder", "in memory"])
@pytest.mark.parametrize("prompts", [[PROMPT_LONGER_THAN_WINDOW], [LONG_PROMPT, SHORT_PROMPT]],
                         ids=["past-the-window", "uneven-batch"])
def test_genai_greedy_matches_transformers(packages, checkpoint, source, prompts):
    """The 8-token sliding layers: the prompt and the 32 new tokens go past the window."""
    expected = transformers_greedy(checkpoint[1], prompts, no_early_end=True)
    assert all(len(row) > 1 for row in expected)
    assert genai_greedy(packages[source].path, prompts, no_early_end=True) == expected


@pytest.mark.l1
def test_a_captured_export_is_refused_in_one_line(checkpoint, tmp_path):
    """Plain layers keep separate past and present buffers, which GenAI cannot capture."""
    with pytest.raises(ExporterError, match=r"captures the decoder's graph, which needs GroupQueryAttention in every "
                                            r"layer, and 4 cannot have it .*--no-graph-capture"):
        export(str(checkpoint[0]), ep="webgpu", output_dir=tmp_path / "out", cache=False)
    assert not (tmp_path / "out").exists()
