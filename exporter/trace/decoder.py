"""Trace a HF decoder with ONNX Runtime GenAI's I/O into one ``torch.export`` program.

Inputs: input_ids [batch, seq], attention_mask [batch, past + seq], position_ids [batch, seq],
past_key_values.%d.key/value [batch, kv_heads, past, head_dim] for KV-owning layers only.
Outputs: logits [batch, seq, vocab], present.%d.key/value [batch, kv_heads, past + seq, head_dim].
One graph serves prefill (past = 0) and decode (seq = 1).
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import sys
import threading
from collections.abc import Iterator

import torch
from torch.export import Dim, ExportedProgram
from torch.overrides import TorchFunctionMode
from transformers import DynamicCache, PreTrainedModel, masking_utils
from transformers.cache_utils import DynamicLayer

from exporter.load.experts import traceable_experts
from exporter.load.layout import DecoderLayout, eval_mode
from exporter.trace import layer_replicas

# torch.export specialises a dimension whose sample size is 0 or 1, so every dynamic dimension of
# the sample inputs must be >= 2; the graph traced at these sizes still serves past=0 and seq=1.
SAMPLE_BATCH, SAMPLE_SEQ, SAMPLE_PAST = 2, 3, 5


def input_names(layout: DecoderLayout, embeds: bool = False) -> list[str]:
    """``embeds``: a multimodal package's decoder, which reads the embedding session's outputs."""
    names = ["inputs_embeds", "per_layer_inputs"] if embeds else ["input_ids"]
    names += ["attention_mask", "position_ids"]
    for index in layout.kv_layer_indices:
        names += [f"past_key_values.{index}.key", f"past_key_values.{index}.value"]
    return names


def output_names(layout: DecoderLayout) -> list[str]:
    names = ["logits"]
    for index in layout.kv_layer_indices:
        names += [f"present.{index}.key", f"present.{index}.value"]
    return names


class GenAIDecoder(torch.nn.Module):
    """Calls the HF model the way ONNX Runtime GenAI calls the exported graph.

    The cache is a plain ``DynamicCache`` seeded layer by layer: one built from the config would
    bake in the sliding-window cut, and ``cache.update`` on an empty layer would trace a stray
    concat with an empty tensor. Sliding windows are applied by the mask, so present KV keeps the
    full sequence as ONNX Runtime GenAI expects.

    Sliding windows count tokens, not cache slots: ONNX Runtime GenAI pads a batch on the right
    and appends new tokens after the padding, so a short row's cache has a masked hole in the
    middle. transformers measures the window in cache slots (right for its own left padding, where
    the padding is never inside a window), which would let the hole use up window slots.
    """

    def __init__(self, model: PreTrainedModel, layout: DecoderLayout, logits_to_keep: int = 0):
        super().__init__()
        self.model = model
        self.kv_layer_indices = layout.kv_layer_indices
        self.padded_value_dims = tuple(layer.padded_value_dims for layer in layout.kv_layers)
        self.logits_to_keep = logits_to_keep  # transformers' own truncation; tests use it as an oracle

    def forward(self, input_ids, attention_mask, position_ids, past_key_values):
        return self._decode(attention_mask, position_ids, past_key_values, input_ids=input_ids)

    def cache_entry(self, layer_index: int) -> DynamicLayer | None:
        """The running call's cache entry of a layer (None for a layer that owns none)."""
        layers = self._cache.layers
        return layers[layer_index] if layer_index < len(layers) and layers[layer_index].is_initialized else None

    def _decode(self, attention_mask, position_ids, past_key_values, **model_inputs):
        cache = self._cache = DynamicCache()
        for slot, layer_index in enumerate(self.kv_layer_indices):
            while len(cache.layers) <= layer_index:
                cache.layers.append(DynamicLayer())
            keys, values = past_key_values[2 * slot], past_key_values[2 * slot + 1]
            if padding := self.padded_value_dims[slot]:
                values = values[..., : values.shape[-1] - padding]
            layer = cache.layers[layer_index]
            layer.keys, layer.values = keys, values
            layer.dtype, layer.device = keys.dtype, keys.device
            layer.is_initialized = True
        with _windows_over_token_positions(attention_mask):
            outputs = self.model(
                **model_inputs,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                logits_to_keep=self.logits_to_keep,
            )
        presents = []
        for layer_index, padding in zip(self.kv_layer_indices, self.padded_value_dims, strict=True):
            values = cache.layers[layer_index].values
            if padding:
                values = torch.nn.functional.pad(values, (0, padding))
            presents += [cache.layers[layer_index].keys, values]
        return (outputs.logits, *presents)


class GenAIEmbedsDecoder(GenAIDecoder):
    """The decoder of a Gemma 4 multimodal package: it reads the embedding session's outputs,
    ``inputs_embeds`` and the per-layer token embeddings flattened to ``[batch, seq, layers * width]``
    (ONNX Runtime GenAI sizes that buffer from its last, static, dimension)."""

    def forward(self, inputs_embeds, per_layer_inputs, attention_mask, position_ids, past_key_values):
        config = self.model.config
        per_layer_inputs = per_layer_inputs.reshape(
            *per_layer_inputs.shape[:2], config.num_hidden_layers, config.hidden_size_per_layer_input)
        return self._decode(attention_mask, position_ids, past_key_values,
                            inputs_embeds=inputs_embeds, per_layer_inputs=per_layer_inputs)


@contextlib.contextmanager
def _windows_over_token_positions(attention_mask: torch.Tensor) -> Iterator[None]:
    """Make transformers' sliding-window and chunked masks compare token positions instead of
    cache slots.

    A token's position is the number of real tokens before it in its row (``cumsum(mask) - 1``).
    Within each row, real tokens' positions rise with their cache slots, so the causal part stays
    slot-based; padding stays excluded by transformers' own padding mask. Without holes (one
    prompt, or left padding) this is the same mask transformers builds (its chunks start after a
    row's left padding too).
    """
    token_positions = attention_mask.long().cumsum(-1) - 1
    originals = (masking_utils.sliding_window_causal_mask_function, masking_utils.chunked_causal_mask_function)

    def sliding_window_over_positions(sliding_window: int):
        def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
            in_window = token_positions[batch_idx, kv_idx] > token_positions[batch_idx, q_idx] - sliding_window
            return in_window & masking_utils.causal_mask_function(batch_idx, head_idx, q_idx, kv_idx)

        return inner_mask

    def chunks_over_positions(chunk_size: int, left_padding: torch.Tensor):
        def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
            same_chunk = (token_positions[batch_idx, kv_idx] // chunk_size
                          == token_positions[batch_idx, q_idx] // chunk_size)
            return same_chunk & masking_utils.causal_mask_function(batch_idx, head_idx, q_idx, kv_idx)

        return inner_mask

    masking_utils.sliding_window_causal_mask_function = sliding_window_over_positions
    masking_utils.chunked_causal_mask_function = chunks_over_positions
    try:
        yield
    finally:
        masking_utils.sliding_window_causal_mask_function, masking_utils.chunked_causal_mask_function = originals


def make_inputs(
    layout: DecoderLayout,
    batch: int,
    seq: int,
    past: int,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
    left_padding: tuple[int, ...] | None = None,
    past_right_padding: tuple[int, ...] | None = None,
    right_padding: tuple[int, ...] | None = None,
) -> tuple:
    """Random inputs in the graph's order.

    ``left_padding[b]`` masks that many leading positions of row b (transformers' batching);
    ``past_right_padding[b]`` masks that many trailing positions of row b's past, the hole that
    ONNX Runtime GenAI's right-padded batches leave between a short prompt and its new tokens;
    ``right_padding[b]`` masks that many trailing positions (GenAI's batched prefill).
    """
    input_ids = torch.randint(0, layout.vocab_size, (batch, seq), generator=generator)
    attention_mask = torch.ones((batch, past + seq), dtype=torch.long)
    if left_padding:
        for row, pad in enumerate(left_padding):
            attention_mask[row, :pad] = 0
    if past_right_padding:
        for row, pad in enumerate(past_right_padding):
            attention_mask[row, past - pad : past] = 0
    if right_padding:
        for row, pad in enumerate(right_padding):
            attention_mask[row, past + seq - pad :] = 0
    # Positions: the count of real tokens before each one (GenAI's numbering, except that GenAI
    # numbers right padding 0 where this repeats the last real position).
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    position_ids = positions[:, past:].contiguous()
    past_kv = []
    for layer in layout.kv_layers:
        shape = (batch, layer.num_kv_heads, past, layer.head_dim)
        past_kv += [torch.randn(shape, generator=generator, dtype=dtype) for _ in range(2)]
    return input_ids, attention_mask, position_ids, tuple(past_kv)


def embeds_inputs(model: PreTrainedModel, sample: tuple, generator: torch.Generator) -> tuple:
    """A multimodal decoder's inputs from ``make_inputs``'s: ``input_ids`` become random
    ``inputs_embeds`` and flattened per-layer inputs of the same batch and length."""
    input_ids, *rest = sample
    config = model.config
    dtype = next(model.parameters()).dtype
    batch, seq = input_ids.shape
    inputs_embeds = torch.randn((batch, seq, config.hidden_size), generator=generator).to(dtype)
    width = config.num_hidden_layers * config.hidden_size_per_layer_input
    per_layer_inputs = torch.randn((batch, seq, width), generator=generator).to(dtype)
    return (inputs_embeds, per_layer_inputs, *rest)


def trace(model: PreTrainedModel, layout: DecoderLayout, embeds: bool = False) -> tuple[ExportedProgram, tuple]:
    """Returns the program and the sample inputs it was traced with (lowering needs them).
    ``embeds``: trace a multimodal package's decoder (``GenAIEmbedsDecoder``)."""
    dtype = next(model.parameters()).dtype
    generator = torch.Generator().manual_seed(0)
    sample = make_inputs(layout, SAMPLE_BATCH, SAMPLE_SEQ, SAMPLE_PAST, dtype=dtype, generator=generator)
    dynamic = Dim.DYNAMIC
    dynamic_shapes = (
        {0: dynamic, 1: dynamic},
        {0: dynamic, 1: dynamic},
        {0: dynamic, 1: dynamic},
        tuple({0: dynamic, 2: dynamic} for _ in sample[3]),
    )
    wrapper = GenAIDecoder(model, layout)
    if embeds:
        sample = embeds_inputs(model, sample, generator)
        dynamic_shapes = ({0: dynamic, 1: dynamic}, *dynamic_shapes)
        wrapper = GenAIEmbedsDecoder(model, layout)
    with (torch.no_grad(), eval_mode(model), ordered_string_sets(model), traceable_experts(model),
          _without_stack_traces(), NoopsUntraced()):
        program, replicated = _export_with_replicas(wrapper, sample, dynamic_shapes)
    program.graph_module.meta[REPLICATED_LAYERS] = replicated
    return program, sample


REPLICATED_LAYERS = "exporter.replicated_layers"  # program meta: how many layers were copied, or why none


def _export_with_replicas(wrapper: GenAIDecoder, sample: tuple, dynamic_shapes) -> tuple[ExportedProgram, int | str]:
    """Trace with each repeated decoder layer a stand-in, filled in by copying (``layer_replicas``);
    where that cannot be done, trace every layer. Also returns how many layers were copied, or why
    none were."""
    try:
        with layer_replicas.stand_ins(wrapper, wrapper.cache_entry) as replicas:
            program = torch.export.export(wrapper, sample, dynamic_shapes=dynamic_shapes, strict=False)
        if replicas is None or isinstance(replicas, str):  # nothing to copy, or why not: traced whole
            return program, replicas or 0
        reason = layer_replicas.expand(program, replicas)
    except layer_replicas.NotReplicable as error:
        reason = str(error)
    if reason is None:
        return program, replicas.stand_ins
    program = torch.export.export(wrapper, sample, dynamic_shapes=dynamic_shapes, strict=False)
    return program, reason


class NoopsUntraced(TorchFunctionMode):
    """What eager mode answers with the tensor itself, given without a node: non-strict export
    records each, and later passes erase them (``drop_noop_casts``; tidy collapses full slices).

    - ``x.float()``, ``x.to(dtype)`` and ``x.type_as(y)`` where ``x`` already has that dtype:
      Hugging Face models upcast and cast back around every norm, which export records as ``to``
      (with an ``_assert_tensor_metadata``) or ``type_as``;
    - full slices in an index of full slices and ``None`` (``x[:, :, None, :, :]`` in
      ``repeat_kv``): the ``None`` s become ``unsqueeze``, as eager indexing makes them, and the
      full slices nothing.

    In an fp32 35-layer Gemma 4 that is 1338 of 4554 traced op nodes and about 2 s of the trace.
    Anything with another argument (a device, ``copy``, a memory format), or a ``type_as`` of a
    tensor on another device, is traced as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(source := args[0], torch.Tensor):
            if func in _CASTS and not kwargs:
                if func is torch.Tensor.float and len(args) == 1 and source.dtype == torch.float32:
                    return source
                if len(args) == 2 and _dtype_of(func, source, args[1]) == source.dtype:
                    return source
            elif func is torch.Tensor.to and set(kwargs) == {"dtype"} and len(args) == 1:
                if kwargs["dtype"] == source.dtype:
                    return source
            elif func is torch.Tensor.__getitem__ and len(args) == 2 and _only_full_slices_and_none(args[1], source):
                for position, item in enumerate(args[1]):
                    if item is None:
                        source = source.unsqueeze(position)
                return source
        return func(*args, **kwargs)


_CASTS = (torch.Tensor.float, torch.Tensor.to, torch.Tensor.type_as)
_FULL = slice(None)


def _only_full_slices_and_none(index, tensor: torch.Tensor) -> bool:
    return (isinstance(index, tuple) and any(item is None for item in index)
            and all(item is None or (isinstance(item, slice) and item == _FULL) for item in index)
            and sum(item is not None for item in index) <= tensor.dim())


def _dtype_of(func, source: torch.Tensor, argument) -> torch.dtype | None:
    """The dtype ``source.to(argument)`` or ``source.type_as(argument)`` converts to, on its own
    device; None for any other call."""
    if func is torch.Tensor.to and isinstance(argument, torch.dtype):
        return argument
    if func is torch.Tensor.type_as and isinstance(argument, torch.Tensor) and argument.device == source.device:
        return argument.dtype  # type_as also moves to the other's device
    return None


@contextlib.contextmanager
def _without_stack_traces() -> Iterator[None]:
    """No Python stack trace per traced node (about 1 s of a 35-layer trace): the package keeps
    none (its files are the same bytes either way)."""
    emitting = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = emitting


@contextlib.contextmanager
def ordered_string_sets(model: torch.nn.Module) -> Iterator[None]:
    """Iterate sets of strings in sorted order while tracing.

    Some models loop over a set (Gemma 4: ``unique_layer_types``, one rotary table per layer type;
    Llama 4: ``for layer_type in set(self.config.layer_types)``, one mask per layer type), and
    string hashing is randomised per process, so the traced node order, and with it the ONNX file,
    would differ from run to run. A module attribute that is a set of strings becomes a sorted list
    (it iterates and answers ``in`` the same way); a set the forward builds with ``set(...)`` in the
    module that defines one of the model's classes is a ``_SortedStringSet``, which iterates
    strings in sorted order.
    """
    replaced = []
    for module in model.modules():
        for attribute, value in list(vars(module).items()):
            if isinstance(value, (set, frozenset)) and value and all(isinstance(v, str) for v in value):
                replaced.append((module, attribute, value))
                setattr(module, attribute, sorted(value))
    # The modules defining the model's classes and their bases (an inherited forward runs in its
    # own module's globals), not torch's.
    names = sorted({cls.__module__ for m in model.modules() for cls in type(m).__mro__} - {None, "builtins"})
    namespaces = [vars(sys.modules[name]) for name in names if name in sys.modules and name.split(".")[0] != "torch"]
    injected = []
    with _SORTED_SETS_LOCK:
        for namespace in namespaces:
            if namespace.get("set", _SortedStringSet) is _SortedStringSet:  # a module's own set stays
                namespace["set"] = _SortedStringSet
                _SORTED_SETS_USERS[id(namespace)] += 1
                injected.append(namespace)
    try:
        yield
    finally:
        for module, attribute, value in replaced:
            setattr(module, attribute, value)
        with _SORTED_SETS_LOCK:  # another thread's trace may still be in a module: the last one out restores
            for namespace in injected:
                _SORTED_SETS_USERS[id(namespace)] -= 1
                if _SORTED_SETS_USERS[id(namespace)] == 0 and namespace.get("set") is _SortedStringSet:
                    del namespace["set"]


_SORTED_SETS_LOCK = threading.Lock()
_SORTED_SETS_USERS: collections.Counter[int] = collections.Counter()  # module namespace -> traces using it


class _AnySet(type):
    """``isinstance(x, set)`` in a module whose ``set`` is ``_SortedStringSet`` still means any set."""

    def __instancecheck__(cls, instance) -> bool:
        return isinstance(instance, builtins.set)

    def __subclasscheck__(cls, subclass) -> bool:
        return issubclass(subclass, builtins.set)


class _SortedStringSet(builtins.set, metaclass=_AnySet):
    """A set whose iteration is sorted where it holds strings only (else the set's own order)."""

    def __iter__(self):
        items = list(builtins.set.__iter__(self))
        if all(isinstance(item, str) for item in items):
            items.sort()
        return iter(items)
