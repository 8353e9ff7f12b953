"""A PeftModel (LoRA adapters) exports as the model it computes, and the caller's model and
adapters stay exactly as they were."""

from __future__ import annotations

import pytest
import torch

from exporter import export
from exporter.errors import ExporterError
from tests.helpers.checkpoints import build_preset, perturb_constant_tensors
from tests.helpers.parity import check_parity

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.l3


@pytest.fixture(scope="module")
def lora_model():
    base, tokenizer = build_preset("tiny-llama")
    perturb_constant_tensors(base, seed=1)
    # init_lora_weights=False: B is random rather than zero, so the adapters change every output
    # (a LoRA fresh from its default init is a no-op and would prove nothing).
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False)
    torch.manual_seed(3)
    return peft.get_peft_model(base, config).eval(), tokenizer


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_a_lora_model_exports_merged_and_stays_untouched(lora_model, tmp_path):
    model, tokenizer = lora_model
    before = _snapshot(model)
    ids = torch.tensor([[3, 17, 42, 5, 99, 7]])
    with torch.no_grad():
        logits_before = model(input_ids=ids).logits
        base_logits = model.get_base_model()(input_ids=ids).logits
        with model.disable_adapter():
            plain_logits = model(input_ids=ids).logits
    assert (logits_before - plain_logits).abs().max() > 1e-2, "the adapters must change the outputs"

    package = export(model, tokenizer, output_dir=tmp_path / "pkg")

    adapted = 3 * model.config.num_hidden_layers  # q_proj, v_proj and down_proj in every layer
    assert (f"PEFT adapter 'default' (lora) merged into a copy of the base model ({adapted} adapted layers); "
            "the PeftModel passed in is unchanged") in package.report.notes
    # ONNX Runtime's package against the unmerged adapted model (LoRA applied at run time).
    check_parity(package, model.get_base_model())
    # The caller's model: still a PeftModel with its adapters, every tensor bit for bit as before.
    assert isinstance(model, peft.PeftModel) and list(model.peft_config) == ["default"]
    after = _snapshot(model)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], before[name]) for name in before)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits_before)
    assert torch.equal(base_logits, logits_before)


def test_prompt_learning_adapters_are_refused(tmp_path):
    base, tokenizer = build_preset("tiny-llama")
    model = peft.get_peft_model(base, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ExporterError, match="prompt-learning adapters are not weights"):
        export(model, tokenizer, output_dir=tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists()


def test_the_merged_copy_shares_every_tensor_the_adapters_leave_alone(lora_model):
    from exporter.load.peft_models import merged_copy

    model, _ = lora_model
    merged, _ = merged_copy(model)
    base = model.get_base_model()
    assert merged.model.embed_tokens.weight is base.model.embed_tokens.weight
    assert merged.model.layers[0].mlp.up_proj.weight is base.model.layers[0].mlp.up_proj.weight
    merged_q = merged.model.layers[0].self_attn.q_proj.weight
    assert merged_q is not base.model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.equal(merged_q, base.model.layers[0].self_attn.q_proj.base_layer.weight)
