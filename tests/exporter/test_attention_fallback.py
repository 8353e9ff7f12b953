"""A model whose attention the GroupQueryAttention matcher does not recognise exports with
transformers' attention in every layer and a report note, and generates what transformers does.

The stand-in is tiny-llama (constants moved) running a custom attention function registered with
transformers' ``AttentionInterface``, as a user's research model would: its scores pass through
``s - 0.5 * |s|`` before the mask, which no GroupQueryAttention attribute expresses."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers import AttentionInterface
from transformers.models.llama.modeling_llama import repeat_kv

from exporter import export
from exporter.load.presets import build_preset
from tests.helpers.checkpoints import perturb_constant_tensors
from tests.helpers.generation import LONG_PROMPT, SHORT_PROMPT, genai_greedy, transformers_greedy

ATTENTION = "genai_exporter_test_damped"


def damped_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    scores = scores - 0.5 * scores.abs()
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


@pytest.fixture(scope="module")
def damped_model():
    AttentionInterface.register(ATTENTION, damped_attention)
    transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, transformers.masking_utils.eager_mask)
    model, tokenizer = build_preset("tiny-llama")
    perturb_constant_tensors(model, seed=0)
    model.set_attn_implementation(ATTENTION)
    return model.eval(), tokenizer


@pytest.mark.l4
def test_unrecognised_attention_stays_plain_and_generates_as_transformers(damped_model, tmp_path):
    model, tokenizer = damped_model
    package = export(model, tokenizer, output_dir=tmp_path / "package", cache=False)
    record = next(r for r in package.report.fx_passes if r["name"] == "substitute_group_query_attention")
    assert sorted(int(layer) for layer in record["changes"]["plain_layers"]) == [0, 1, 2, 3]
    assert all("its attention was not recognised" in why for why in record["changes"]["plain_layers"].values())
    assert any("4 of 4 layers keep transformers' attention" in note for note in package.report.notes)
    assert "com.microsoft.GroupQueryAttention" not in package.report.op_counts
    config = json.loads((package.path / "genai_config.json").read_text())
    assert config["search"]["past_present_share_buffer"] is False  # plain layers: separate past and present
    prompts = [LONG_PROMPT, SHORT_PROMPT]
    expected = transformers_greedy(model, prompts, no_early_end=True)
    assert all(len(set(row)) > 2 for row in expected)
    assert genai_greedy(package.path, prompts, no_early_end=True) == expected
