"""Cast a model to the export's compute dtype the way ``from_pretrained(dtype=...)`` builds it.

``model.to(torch.float16)`` casts every floating buffer, but transformers builds some
non-persistent buffers in float32 whatever the model's dtype: rotary ``inv_freq`` tables, whose
rounding to fp16 or bf16 shifts every rotary angle by position x error (0.77 in cos at position 511
in bf16 for Gemma 4 E2B's config). So the dtype of each non-persistent buffer is taken from the same
architecture built in the target dtype (parameters on meta, so it costs no weights), and those it
keeps wider are restored from the model's own values after the cast.
"""

from __future__ import annotations

import torch
import transformers

from exporter.weights.meta_model import build_on_meta


def cast_like_from_pretrained(model: transformers.PreTrainedModel, dtype: torch.dtype) -> None:
    """Cast ``model`` in place: parameters and saved buffers to ``dtype``, computed buffers to the
    dtype ``from_pretrained(dtype=dtype)`` gives them."""
    if all(t.dtype == dtype for t in model.state_dict().values() if t.is_floating_point()):
        return  # already built in it (as from_pretrained builds): computed buffers are as they should be
    wanted = _computed_buffer_dtypes(model, dtype)
    saved = model.state_dict(keep_vars=True)
    kept = {
        name: buffer.detach().clone()
        for name, buffer in model.named_buffers()
        if name not in saved and buffer.is_floating_point() and wanted.get(name, dtype) != dtype
    }
    model.to(dtype)
    for name, values in kept.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = values.to(wanted[name])


def _computed_buffer_dtypes(model: transformers.PreTrainedModel, dtype: torch.dtype) -> dict[str, torch.dtype]:
    built = build_on_meta(lambda: type(model)._from_config(model.config, dtype=dtype))
    return {name: buffer.dtype for name, buffer in built.named_buffers()}
