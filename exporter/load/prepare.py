"""Make a loaded model ready to trace: cast it to the export's compute dtype (a copy for a caller's
in-memory model), read its KV layout from one run, and swap tensors whose values come at write time
(empty parameters, a checkpoint's persistent buffers) for fake ones."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import transformers

from exporter.errors import ExporterError
from exporter.int4_options import Int4Options
from exporter.load.activation_aware_scales import ActivationAwareScales, measure_scales
from exporter.load.activation_ranges import ActivationRanges, calibrate
from exporter.load.compute_dtype import cast_like_from_pretrained
from exporter.load.layout import DecoderLayout, causal_lm_view, derive_layout, non_kv_state_layers, text_config
from exporter.load.sources import LoadedModel
from exporter.weights.meta_model import fake_weights
from exporter.weights.stores import ModelWeights, WeightStore


@dataclass
class PreparedModel:
    model: transformers.PreTrainedModel  # the whole model: a multimodal one's towers too
    decoder: transformers.PreTrainedModel  # its causal LM (``model`` itself, or a view of its parts)
    layout: DecoderLayout
    # Every saved tensor's shape, for matching initializers to tensors.
    saved_shapes: dict[str, tuple[int, ...]]
    # Where the package's weights are read when it is written: the loaded source's, or the model's
    # own tensors where the model holds them (then traced with their values: ``weights_in_model``).
    weight_store: WeightStore
    # fp16 activations: the decoder's float32 peaks on the calibration prompts, or why they were
    # not measured (``exporter.load.activation_ranges``); None at other precisions.
    activation_ranges: ActivationRanges | str | None = None
    # --int4-method awq: each decoder linear layer's AWQ input scale, measured on the same prompts
    # (``exporter.load.activation_aware_scales``); None otherwise.
    activation_aware_scales: ActivationAwareScales | None = None

    @property
    def weights_in_model(self) -> bool:
        return isinstance(self.weight_store, ModelWeights)


def prepare(loaded: LoadedModel, dtype: torch.dtype, int4: Int4Options | None = None) -> PreparedModel:
    """``int4``: the options of a 4-bit export, whose AWQ method is measured here."""
    _refuse_non_kv_state(loaded.model.config)  # from the config: before any weight is read or measured
    # Measured first, in float32 on the model as loaded: the cast and the fake weights come after.
    ranges = calibrate(loaded) if dtype == torch.float16 else None
    scales = measure_scales(loaded, int4) if int4 is not None and int4.method == "awq" else None
    model = loaded.model
    if loaded.weights is not None:
        cast_like_from_pretrained(model, dtype)  # empty parameters, built for this export: no copy
        model.tie_weights()  # converting meta parameters replaces them, untying a tied LM head
    elif any(p.dtype != dtype for p in model.parameters()):
        # A copy: an in-memory model belongs to the caller (often mid-training) and keeps its dtype.
        model = copy.deepcopy(model)
        cast_like_from_pretrained(model, dtype)
        loaded.notes.append(f"weights converted to {str(dtype).removeprefix('torch.')} for tracing "
                            "(a copy; the model is unchanged)")
    decoder = causal_lm_view(model) if loaded.multimodal else model
    try:
        layout = derive_layout(decoder)
    except ExporterError:
        raise  # a model the exporter refuses, said as such
    except Exception as error:
        # The exporter's own step failed, whatever the cause: say which step, and what it raised.
        raise ExporterError(
            f"the exporter's layout probe failed: running {type(decoder).__name__} on 2 tokens with a "
            f"transformers DynamicCache, to read which layers keep a KV cache, raised "
            f"{type(error).__name__}: {_first_line(error)}; if the model runs in transformers, this is the "
            "exporter's limit: please report it with the model's config (--debug shows the traceback)"
        ) from error
    saved_shapes = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    if loaded.weights is None:
        return PreparedModel(model, decoder, layout, saved_shapes, ModelWeights(model), ranges, scales)
    fake_weights(model, buffers=loaded.weights.provides_buffers)
    return PreparedModel(model, decoder, layout, saved_shapes, loaded.weights, ranges, scales)


def _refuse_non_kv_state(config) -> None:
    if stateful := non_kv_state_layers(config):
        kinds = ", ".join(sorted(set(stateful.values())))
        layers = ", ".join(map(str, list(stateful)[:8])) + (", ..." if len(stateful) > 8 else "")
        raise ExporterError(
            f"{text_config(config).model_type} keeps a state that is not a key/value cache ({kinds}: a convolution, "
            f"recurrent or indexer state) in {len(stateful)} of its layers ({layers}): ONNX Runtime GenAI's decoder "
            "carries key/value caches only, so this exporter refuses the model")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
