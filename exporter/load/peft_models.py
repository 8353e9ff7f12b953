"""A PEFT model (``PeftModel``: adapters such as LoRA on a base model) exported as the model it
computes: its active adapters merged by PEFT's own ``merge_and_unload`` into a copy. For a model on
the CPU the copy shares every tensor the adapters leave alone, so it costs only the adapted layers'
weights; a model on another device (training on a GPU) is copied to the CPU, where the export
traces. Either way the caller's model and adapters stay as they were (often mid-training)."""

from __future__ import annotations

import copy
import itertools
import sys
from typing import Any

import torch
import transformers

from exporter.errors import ExporterError


def is_peft_model(source: Any) -> bool:
    # peft is optional: a PeftModel can only exist where peft was imported.
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(source, peft.PeftModel)


def _on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    copied = tensor.detach().to("cpu", copy=True)
    return torch.nn.Parameter(copied, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) else copied


def merged_copy(model: Any) -> tuple[transformers.PreTrainedModel, str]:
    """The base model with the active adapters merged into a copy, and a report note saying so."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    names = list(model.active_adapters) if hasattr(model, "active_adapters") else [model.active_adapter]
    configs = [model.peft_config[name] for name in names]
    if any(config.is_prompt_learning for config in configs):
        kinds = sorted({config.peft_type.value for config in configs if config.is_prompt_learning})
        raise ExporterError(f"cannot export a PeftModel with {', '.join(kinds)} adapters: prompt-learning "
                            "adapters are not weights that merge into the model; export the base model instead")
    adapted = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not adapted:
        raise ExporterError("the PeftModel has no adapted layers to merge; export its base model "
                            "(model.get_base_model()) instead")
    # deepcopy's memo: a CPU tensor outside the adapted layers maps to itself (shared, not copied);
    # a tensor on another device (a model training on a GPU) to a CPU copy, since the export traces
    # on the CPU. Tied tensors stay one tensor either way.
    inside = {id(t) for m in adapted for t in itertools.chain(m.parameters(), m.buffers())}
    memo = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.device.type != "cpu":
            memo[id(tensor)] = _on_cpu(tensor)
        elif id(tensor) not in inside:
            memo[id(tensor)] = tensor
    try:
        merged = copy.deepcopy(model, memo).merge_and_unload(safe_merge=True)
    except (ValueError, AttributeError, NotImplementedError, TypeError) as error:
        kinds = sorted({config.peft_type.value for config in configs})
        raise ExporterError(f"PEFT could not merge the {', '.join(kinds)} adapters "
                            f"({str(error).strip().splitlines()[0]}); merge them yourself "
                            "(model.merge_and_unload()) and export the result") from error
    if not isinstance(merged, transformers.PreTrainedModel):
        raise ExporterError(f"merging the PeftModel gave a {type(merged).__name__}, not a transformers model; "
                            "export a PeftModel whose base model is a transformers causal LM")
    described = ", ".join(f"'{name}' ({config.peft_type.value.lower()})" for name, config in zip(names, configs,
                                                                                                 strict=True))
    note = (f"PEFT adapter {described} merged into a copy of the base model ({len(adapted)} adapted layers); "
            "the PeftModel passed in is unchanged")
    return merged, note
