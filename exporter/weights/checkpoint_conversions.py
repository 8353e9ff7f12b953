"""transformers' own checkpoint conversions, applied one tensor at a time.

``from_pretrained`` does not load every checkpoint key as it is named: a model's conversion mapping
(``transformers.conversion_mapping.get_model_conversion_mapping``) renames keys (Mixtral's
``block_sparse_moe`` -> ``mlp``), and its converters build one model tensor out of several saved
ones (per-expert ``gate_proj``/``up_proj`` stacked and concatenated into ``experts.gate_up_proj``) or
split one into several (a fused ``qkv``). ``save_pretrained`` writes the saved form back, so a
user's folder holds it.

``plan_conversions`` runs transformers' own key renaming (``rename_source_key``, what
``from_pretrained`` calls) over the checkpoint's keys and groups the keys each converter consumes.
Each converted group is run once on meta tensors, so every target's shape is known before anything
is read; ``ConvertedTensors.read`` runs transformers' converter on the real tensors when the package
writer asks for one of its targets, so only one group's tensors (one layer's experts) are ever in
memory together.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from exporter.errors import ExporterError


@dataclass
class _Group:
    """The checkpoint keys one converter turns into one or more model tensors."""

    converter: object  # transformers' WeightConverter, never run itself: each conversion runs a copy
    first_target: str  # the model tensor transformers files the group under
    sources: list[tuple[str, str]] = field(default_factory=list)  # (source pattern, checkpoint key), in load order
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # model tensor -> converted shape
    # Runs a pre-quantized checkpoint's dequantizing op (on every tensor, for some formats: FP8's
    # passes a float tensor without its scale through).
    dequantizing_op: bool = False

    @property
    def keys(self) -> list[str]:
        return [key for _, key in self.sources]

    @property
    def dequantizes(self) -> bool:
        """Reads quantized values with their scales (MXFP4's blocks and scales, FP8's weight and
        inverse scale)."""
        return self.dequantizing_op and len(self.sources) > 1


@dataclass
class ConvertedTensors:
    """Model tensor name -> the checkpoint key(s) it comes from, by transformers' conversions."""

    renamed: dict[str, str]  # model tensor -> the one checkpoint key it is, under another name
    groups: dict[str, _Group]  # model tensor -> the converted group that makes it
    _model: torch.nn.Module | None = None
    quantization_method: str | None = None  # a pre-quantized checkpoint's, whose weights are dequantized
    _last: tuple[int, dict[str, torch.Tensor]] | None = None  # the last group converted, for its siblings

    def keys_of(self, name: str) -> list[str]:
        if name in self.renamed:
            return [self.renamed[name]]
        return self.groups[name].keys

    def read(self, name: str, read_key: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """Model tensor ``name``, converted from its checkpoint tensors by transformers' converter.
        The sibling targets of one conversion (q, k and v of a fused qkv) are kept until the next
        group is read, as the writer takes them one after another."""
        group = self.groups[name]
        if self._last is None or self._last[0] != id(group):
            self._last = None  # free the previous group's tensors before reading this one's
            self._last = (id(group), _convert(group, self._model, lambda key: read_key(key)))
        return self._last[1][name]


def plan_conversions(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> ConvertedTensors:
    """Which checkpoint keys (``shapes``: key -> stored shape) make which of ``model``'s saved
    tensors under transformers' conversion mapping for it; keys it leaves as they are, and keys
    that match no tensor of the model, are not listed."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

    quantizer = dequantizing_quantizer(getattr(model, "config", None))
    mapping = get_model_conversion_mapping(model, hf_quantizer=quantizer)
    dequantize = quantizer.get_load_operations()["dequantize"] if quantizer is not None else None
    renamings = [entry for entry in mapping if not isinstance(entry, WeightConverter)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    wanted = model.state_dict(keep_vars=True)
    prefix = getattr(model, "base_model_prefix", None)

    renamed: dict[str, str] = {}
    first_targets: dict[str, _Group] = {}
    for key in sorted(shapes, key=dot_natural_key):  # transformers' own order: experts 0, 1, ... 10
        target, pattern = rename_source_key(key, renamings, converters, prefix, wanted)
        if target not in wanted:
            continue
        if pattern is None:
            if target != key:
                renamed[target] = key
            continue
        converter = by_pattern[pattern]
        group = first_targets.setdefault(target, _Group(
            copy.deepcopy(converter), target,
            dequantizing_op=dequantize is not None and any(isinstance(op, dequantize) for op in converter.operations)))
        group.sources.append((pattern, key))

    groups: dict[str, _Group] = {}
    for group in first_targets.values():
        # On meta tensors: the targets' names and shapes, with nothing read.
        meta = _convert(group, model, lambda key: torch.empty(shapes[key], device="meta"))
        group.shapes = {name: tuple(tensor.shape) for name, tensor in meta.items()}
        for name in group.shapes:
            if name in wanted:
                groups[name] = group
    method = quantization_method(model.config) if quantizer is not None else None
    return ConvertedTensors(renamed, groups, model, quantization_method=method)


# The pre-quantized formats read here, each through transformers' own dequantizing converter (and
# tested: gpt-oss's MXFP4 experts, fine-grained FP8). Others transformers could dequantize
# (compressed-tensors, ...) are untested, so refused like those it cannot.
DEQUANTIZED_FORMATS = ("mxfp4", "fp8")


def quantization_method(config) -> str | None:
    """The ``quant_method`` of a checkpoint's ``quantization_config`` (None for a float one)."""
    settings = getattr(config, "quantization_config", None)
    if settings is None:
        return None
    method = settings.get("quant_method") if isinstance(settings, dict) else getattr(settings, "quant_method", None)
    return str(getattr(method, "value", method))  # an enum in transformers


def refused_format(config) -> str:
    """The one line for a checkpoint whose weights are stored in a format not read here."""
    return (f"the checkpoint is pre-quantized ({quantization_method(config)}), a format this exporter does not read "
            f"(it dequantizes {' and '.join(DEQUANTIZED_FORMATS)} through transformers); export a float checkpoint "
            "of it (the exporter quantizes with --precision int4)")


def dequantizing_quantizer(config):
    """transformers' quantizer for a pre-quantized checkpoint in one of ``DEQUANTIZED_FORMATS``, set
    to dequantize on load as ``from_pretrained`` does where no kernel runs the format (gpt-oss's
    MXFP4 experts on a CPU): its converters then turn each weight's stored blocks and scales into
    the float tensor the model holds, one group at a time. None otherwise: a float checkpoint, or
    one whose config names another format (a float checkpoint may keep a stale
    ``quantization_config``; if its tensors are not float, matching fails with ``refused_format``)."""
    method = quantization_method(config)
    if method not in DEQUANTIZED_FORMATS:
        return None
    from transformers.quantizers import AutoHfQuantizer

    try:
        quantizer = AutoHfQuantizer.from_config(config.quantization_config, pre_quantized=True)
    except Exception as error:  # noqa: BLE001 - a malformed config or a missing package: one line
        raise ExporterError(f"the checkpoint is pre-quantized ({method}), and transformers cannot read its "
                            f"quantization_config here ({str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}); "
                            "export a float checkpoint of it") from error
    quantizer.quantization_config.dequantize = True
    return quantizer


def _convert(group: _Group, model, read_key: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    converter = copy.deepcopy(group.converter)
    for pattern, key in group.sources:
        # transformers' converters take a callable per source tensor (its synchronous loading).
        converter.add_tensor(group.first_target, key, pattern, lambda key=key: read_key(key))
    try:
        converted = converter.convert(group.first_target, model=model, config=getattr(model, "config", None))
    except Exception as error:
        raise ExporterError(
            f"transformers' conversion of checkpoint tensors {group.keys[:3]}{' ...' if len(group.keys) > 3 else ''} "
            f"into '{group.first_target}' failed ({str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}); "
            "is it the checkpoint of this config?"
        ) from error
    # detach: a dequantizing op returns a Parameter (MXFP4's)
    return {name: (value[0] if isinstance(value, list) else value).detach() for name, value in converted.items()}
