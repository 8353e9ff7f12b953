"""AWQ's input-channel scales (activation-aware weight quantization, Lin et al., 2023), measured at
export time for ``--int4-method awq``.

Rounding error in a weight column costs in proportion to the activation that multiplies it. So for
each linear layer of the decoder, the export stores ``W * s`` (s: one factor per input channel)
quantized, and feeds the layer ``x / s``: the product is unchanged in exact arithmetic, but the
columns that meet large activations are rounded on a finer grid. AWQ's search picks ``s = m**a``
(``m``: the mean |x| of each channel, normalized) with ``a`` on a grid in [0, 1) that minimizes
the layer's output error on calibration tokens, the rounding done by the same round-to-nearest
quantizer the package is written with (``exporter.weights.block_rounding``). ``a = 0`` is
plain round-to-nearest, so on the calibration tokens (and the rows searched: every
``out // SEARCH_ROWS``-th of a layer's) no group of layers sharing an s (below) is worse than
without AWQ, taken together.

The linear layers that read one input (an attention block's query, key and value projections; an
MLP's gate and up projections) share one s, as in AWQ's own code, searched on their rows stacked
(AWQ's own code measures the error at the attention block's or MLP's output instead): the graph
then divides that input once, and where a norm's weight (or, for a down projection, the up
projection's block scales) makes it, the division is folded into that weight and the package has
no extra op (``exporter.onnx_passes.fold_awq_divisions``).

An attention block's linear layers are scaled only where they read the block's own input (query,
key and value projections), not its output projection, which reads the heads' mixed values: on
the real Gemma 3 270M, scaling it too left mean KL where it was (0.536 against round-to-nearest's
0.543 for that projection alone) and made perplexity 1.2x worse (docs/measurements.md). AWQ's own
code scales it only through the value projection, and not under grouped-query attention.

The tokens are ``activation_ranges.CALIBRATION_PROMPTS`` run through the decoder in float32, one
decoder layer's weights in memory at a time, as for the fp16 range (``activation_ranges``). In the
last prompt's forward each linear layer keeps the rows of its weight the search rounds, and its
group is searched when its decoder layer's forward ends.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from exporter.errors import ExporterError
from exporter.int4_options import Int4Options
from exporter.load import activation_ranges
from exporter.weights.block_rounding import round_trip

# Exponents tried: a = 0, 1/GRID, ..., (GRID - 1)/GRID, AWQ's own grid.
GRID = 20
# Output rows the search rounds, evenly spread: blocks run along a row, so each row rounds alone and
# a spread subset estimates the layer's error at a fraction of the cost (a 6144-row projection
# searched on 512 rows: 12x fewer roundings).
SEARCH_ROWS = 512
# The quietest channel's mean |x| the search counts, relative to the loudest's, as AWQ's own code
# floors its scales: s then spans at most QUIETEST**-0.95, about 6300x.
QUIETEST = 1e-4


@dataclass
class ActivationAwareScales:
    # Checkpoint name of a linear layer's weight -> s, float32 [in_features]: stored W * s, fed x / s.
    scales: dict[str, np.ndarray] = field(repr=False)
    exponents: dict[str, float] = field(repr=False)
    tokens: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        chosen = list(self.exponents.values())
        return {"weights": len(self.scales), "tokens": self.tokens,
                "unscaled": sum(1 for a in chosen if a == 0),
                "mean_exponent": round(float(np.mean(chosen)), 3) if chosen else None,
                "seconds": round(self.seconds, 3)}


def measure_scales(loaded, options: Int4Options) -> ActivationAwareScales:
    """Each decoder linear layer's AWQ scale, or an error saying why the decoder could not be run."""
    from exporter.load.layout import causal_lm_view

    rounded = functools.partial(round_trip, bits=4, block_size=options.block_size, symmetric=options.symmetric)
    start = time.perf_counter()
    model = loaded.model
    try:
        decoder = causal_lm_view(model) if loaded.multimodal else model
        base = decoder.base_model
        layers = activation_ranges.decoder_layers(base)
    except Exception as error:
        raise _cannot_run(error) from error
    names = {id(m): name for name, m in model.named_modules()}
    linears = [m for layer in layers for m in layer.modules()
               if isinstance(m, torch.nn.Linear) and m.in_features >= options.block_size]
    rows: dict[int, list[torch.Tensor]] = {id(m): [] for m in linears}
    found = ActivationAwareScales({}, {})
    prompts = activation_ranges.CALIBRATION_PROMPTS
    last = [False]
    # Each attention block's linear layers -> the input its current forward was given.
    attention_of = {id(inner): attention for layer in layers for attention in layer.modules()
                    if _is_attention(attention) for inner in attention.modules() if isinstance(inner, torch.nn.Linear)}
    attention_inputs: dict[int, torch.Tensor] = {}

    def remember_input(module, args, kwargs):
        attention_inputs[id(module)] = args[0] if args else kwargs.get("hidden_states")

    # The last prompt's inputs -> the linear layers that read each (a group), searched together
    # when their decoder layer's forward ends.
    # Each member: (checkpoint name, its weight's rows searched, its input rows).
    groups: dict[int, tuple[torch.Tensor, list[tuple[str, torch.Tensor, list[torch.Tensor]]]]] = {}
    queued: set[str] = set()

    def hook(module, args, output):
        name = f"{names[id(module)]}.weight"
        if name in found.scales or name in queued:
            return  # a layer called twice in a forward: searched at its first call
        attention = attention_of.get(id(module))
        if attention is not None and args[0] is not attention_inputs.get(id(attention)):
            return  # an attention block's output projection: not scaled (module docstring)
        rows[id(module)].append(args[0].detach().reshape(-1, module.in_features).to(torch.float32))
        if last[0]:
            # Only the rows the search rounds are kept (the layer's weights leave with its forward).
            weight = module.weight.detach()[:: max(1, module.out_features // SEARCH_ROWS)].to(torch.float32, copy=True)
            groups.setdefault(id(args[0]), (args[0], []))[1].append((name, weight, rows.pop(id(module))))
            queued.add(name)

    def search_groups(*_):
        for _, members in groups.values():
            # Each member's rows count alike, however many output rows they stand for: weighting
            # them by their stride (a query projection's rows twice its key's) made the real
            # Gemma 3 270M's KL and perplexity worse (0.418 -> 0.435, 1.18x -> 1.27x fp32's).
            s, exponent = search(torch.cat(members[0][2]), torch.cat([weight for _, weight, _ in members]), rounded)
            for name, _, _ in members:
                found.scales[name], found.exponents[name] = s, exponent
        groups.clear()

    hooks = [m.register_forward_hook(hook) for m in linears]
    hooks += [layer.register_forward_hook(search_groups) for layer in layers]
    hooks += [m.register_forward_pre_hook(remember_input, with_kwargs=True)
              for m in {id(a): a for a in attention_of.values()}.values()]
    try:
        inside = {id(m) for layer in layers for m in layer.modules()}
        with activation_ranges.float32_module_by_module(base, layers, inside, model, loaded.weights), torch.no_grad():
            device = activation_ranges.device_of(base)
            for index, prompt in enumerate(prompts):
                last[0] = index == len(prompts) - 1
                ids = loaded.tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
                found.tokens += ids.shape[-1]
                base(input_ids=ids, use_cache=False)
        search_groups()  # layers a decoder layer's own forward did not run (none in transformers' models)
    except ExporterError:
        raise
    except Exception as error:
        raise _cannot_run(error) from error
    finally:
        for h in hooks:
            h.remove()
    if not found.scales:
        raise ExporterError("--int4-method awq found no linear layer in the decoder's layers to scale; "
                            "use --int4-method rtn")
    found.seconds = time.perf_counter() - start
    return found


def _cannot_run(error: Exception) -> ExporterError:
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return ExporterError(f"--int4-method awq measures the decoder's activations in float32, and running it raised "
                         f"{type(error).__name__}: {first}; use --int4-method rtn")


def _is_attention(module: torch.nn.Module) -> bool:
    """transformers' attention blocks: their classes end in "Attention" (LlamaAttention,
    Gemma3Attention, GptOssAttention...)."""
    return type(module).__name__.endswith("Attention")


def search(x: torch.Tensor, weight: torch.Tensor,
           rounded: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, float]:
    """AWQ's grid search for the linear layers reading one input: x [tokens, in], weight [out, in]
    (their rows searched, stacked) -> (s, its exponent a), the s = m**a (normalized to geometric
    mean 1 over its range) whose ``rounded(weight * s)`` (the package's blocks, decoded), fed
    ``x / s``, gives outputs nearest the float layers' on those rows."""
    reference = x @ weight.T
    # Channels quieter than QUIETEST of the loudest (none at all on the prompts, too) count as that
    # quiet: their factor stays within QUIETEST**-a of the others'.
    magnitude = x.abs().mean(0)
    best = (float("inf"), np.ones(weight.shape[1], np.float32), 0.0)
    if not x.shape[0] or magnitude.max() <= 0:  # no token reached the layer (an expert none was routed to)
        return best[1], best[2]
    magnitude = magnitude.clamp(min=float(magnitude.max()) * QUIETEST)
    peaks = x.abs().amax(0)
    for step in range(GRID):
        a = step / GRID
        s = magnitude.pow(a)
        s = s / (s.max() * s.min()).sqrt()
        # x / s may not reach past x's own peak on the prompts: a quiet channel is multiplied,
        # and in an fp16 package a larger product could overflow where x does not.
        if a and (peaks / s).max() > peaks.max():
            continue
        stored = torch.from_numpy(rounded((weight * s).numpy())) / s
        error = (x @ stored.T - reference).pow(2).mean().item()
        if error < best[0]:
            best = (error, s.numpy().astype(np.float32), a)
    if not np.isfinite(best[1]).all() or not (best[1] > 0).all():
        raise ExporterError(f"AWQ's search gave a scale that is not finite and positive (exponent {best[2]})")
    return best[1], best[2]
