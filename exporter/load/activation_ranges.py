"""How large a model's activations get, measured in float32 on a few fixed prompts at export time.

A half-precision package overflows where an activation passes fp16's largest value (65504). The
one that grows is the residual stream: every layer adds to it and only the norms that read it are
scale-free. A real Gemma 3 270M reaches 104,000 on an ordinary prompt, and its fp16 package was
NaN from the first step. So before a package with fp16 activations is built, the decoder runs the
prompts below in float32 and records each decoder layer's largest |output| (the residual after
it), and the largest |output| of every other module; ``onnx_passes.scale_residual_stream`` then
scales the stream by a power of two chosen from those peaks.

The run never holds the model's weights whole: parameters and saved buffers are made float32 one
decoder layer at a time (read from the checkpoint, or converted from the model's own tensors) and
dropped after it; embedding tables give only the rows of the prompts' tokens (a per-layer table of
9.4 GB costs a few rows). A caller's model is put back as it was.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

# Ordinary text of several kinds; short, so the run costs a few forward passes of a few tokens.
CALIBRATION_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    return",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Q: What is 17 times 23?\nA: Let's compute step by step.",
)
FP16_MAX = 65504.0
# The stream's measured peak is kept this many times below fp16's largest value: other prompts
# and longer contexts reach further than four short prompts (on Gemma 3 270M the peak moved by
# 1.2x between these prompts).
HEADROOM = 8.0


@dataclass
class ActivationRanges:
    """Peaks of |activation| in float32 over the calibration prompts."""

    layer_peaks: list[float]  # per decoder layer: its output, the residual after it
    embedding_peak: float  # the first layer's input: the residual before any layer
    # The largest output of a module that is neither a decoder layer nor holds one (norms,
    # projections, activations, attention), and which module gave it.
    other_peak: float
    other_module: str
    prompts: int
    seconds: float = 0.0

    @property
    def residual_peak(self) -> float:
        return max([self.embedding_peak, *self.layer_peaks])

    @property
    def residual_exponent(self) -> int:
        """k in the stream's scale 2**-k: the least k that keeps the peak HEADROOM below fp16's limit."""
        peak = self.residual_peak
        if not math.isfinite(peak):
            raise ValueError("a calibration peak is not finite")
        return max(0, math.ceil(math.log2(peak * HEADROOM / FP16_MAX))) if peak > 0 else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompts": self.prompts,
            "residual_peak": round(self.residual_peak, 3),
            "peak_layer": max(range(len(self.layer_peaks)), key=self.layer_peaks.__getitem__, default=None),
            "layer_peaks": [round(p, 3) for p in self.layer_peaks],
            "embedding_peak": round(self.embedding_peak, 3),
            "other_peak": round(self.other_peak, 3),
            "other_module": self.other_module,
            "residual_exponent": self.residual_exponent,
            "headroom": HEADROOM,
            "seconds": round(self.seconds, 3),
        }


def calibrate(loaded) -> ActivationRanges | str:
    """The loaded model's decoder measured (``measure``), or why it could not be: the package is
    then built unscaled, and the export's finite-logits check still guards it."""
    from exporter.load.layout import causal_lm_view

    start = time.perf_counter()
    try:
        decoder = causal_lm_view(loaded.model) if loaded.multimodal else loaded.model
        ranges = measure(loaded.model, decoder, loaded.tokenizer, loaded.weights)
        ranges.seconds = time.perf_counter() - start
        return ranges
    except Exception as error:  # a model this run cannot drive: say so in the report, export on
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return f"running the decoder in float32 on the calibration prompts raised {type(error).__name__}: {first}"


def exponent_of(ranges: ActivationRanges | str | None) -> int:
    return ranges.residual_exponent if isinstance(ranges, ActivationRanges) else 0


def report_of(ranges: ActivationRanges | str) -> dict[str, Any]:
    return ranges.to_dict() if isinstance(ranges, ActivationRanges) else {"skipped": ranges}


def risk_notes(ranges: ActivationRanges | str | None, scaling: dict[str, int], num_layers: int) -> list[str]:
    """What the report says where an fp16 package may still overflow: calibration did not run, or
    the pass scaled the stream only in part (``scaling``: its record). The largest activation
    outside the stream is reported but gives no note: the outputs written into the stream (a
    post-norm, an output projection) are the largest and shrink with its scale, and the run cannot
    tell them from the rest."""
    if ranges is None:
        return []
    if isinstance(ranges, str):
        return [f"fp16 range not measured ({ranges}): the residual stream is not scaled, and the package may "
                "overflow fp16 on other prompts than the sample prefill's"]
    notes = []
    partial = scaling.get("norms_rescaled", 0) < num_layers + 1 or scaling.get("unscaled_half_reads", 0)
    if ranges.residual_exponent and partial:
        notes.append(f"fp16 range: the residual stream (peak {ranges.residual_peak:.0f}) was scaled only in part "
                     f"({scaling.get('norms_rescaled', 0)} norms for {num_layers} layers, "
                     f"{scaling.get('unscaled_half_reads', 0)} half-precision reads left unscaled): the package may "
                     "overflow fp16; export at --precision fp32 if its outputs are not finite")
    return notes


def measure(model: torch.nn.Module, decoder: torch.nn.Module, tokenizer: Any, weights: Any | None) -> ActivationRanges:
    """Run ``decoder`` (``model``'s causal LM, or ``model`` itself) in float32 on the calibration
    prompts and record its peaks. ``weights``: where the values of ``model``'s empty (meta)
    parameters are, by ``model``'s state_dict names; None where the model holds them."""
    base = decoder.base_model
    layers = decoder_layers(base)
    layer_ids = {id(layer) for layer in layers}
    layer_peaks = [0.0] * len(layers)
    embedding_peak, other = [0.0], [0.0, ""]
    hooks = []

    def record_layer(index):
        def hook(module, args, kwargs, output):
            layer_peaks[index] = max(layer_peaks[index], _peak(output))
            if index == 0:
                first = args[0] if args else next(iter(kwargs.values()))
                embedding_peak[0] = max(embedding_peak[0], _peak(first))
        return hook

    def record_other(name):
        def hook(module, args, output):
            peak = _peak(output)
            if peak > other[0]:
                other[0], other[1] = peak, name
        return hook

    inside_layers = _modules_under(layers)
    for index, layer in enumerate(layers):
        hooks.append(layer.register_forward_hook(record_layer(index), with_kwargs=True))
    for name, module in base.named_modules():
        holds_layer = any(id(m) in layer_ids for m in module.modules())
        if name and not holds_layer:
            hooks.append(module.register_forward_hook(record_other(name)))
    try:
        with float32_module_by_module(base, layers, inside_layers, model, weights), torch.no_grad():
            device = device_of(base)
            for prompt in CALIBRATION_PROMPTS:
                ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
                base(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return ActivationRanges(layer_peaks, embedding_peak[0], other[0], other[1], len(CALIBRATION_PROMPTS))


def _peak(output) -> float:
    tensor = output[0] if isinstance(output, (tuple, list)) else getattr(output, "last_hidden_state", output)
    if not torch.is_tensor(tensor) or not tensor.is_floating_point() or tensor.numel() == 0:
        return 0.0
    return float(tensor.detach().abs().max())


def decoder_layers(base: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's layer list: its longest ``ModuleList``."""
    lists = [m for m in base.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(base).__name__} has no list of decoder layers")
    return max(lists, key=len)


def _modules_under(layers: torch.nn.ModuleList) -> set[int]:
    return {id(m) for layer in layers for m in layer.modules()}


def device_of(module: torch.nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


@contextlib.contextmanager
def float32_module_by_module(base, layers, inside_layers: set[int], model, weights):
    """Give ``base`` float32 values for the run: outside the decoder layers once (embedding tables
    as the rows their input reads), inside each layer for its forward only; everything put back
    after."""
    names = {id(m): name for name, m in model.named_modules()}
    originals: list[tuple[torch.nn.Module, str, str, Any]] = []  # (module, "_parameters"/"_buffers", key, value)

    def swap_in(module):
        prefix = names[id(module)]
        for kind, tensors in (("_parameters", module._parameters), ("_buffers", _saved_buffers(module))):
            for key, tensor in list(tensors.items()):
                if tensor is None or not tensor.is_floating_point():
                    continue  # integer buffers (ids, counters) are read as they are
                full_name = f"{prefix}.{key}" if prefix else key
                values = _float32_values(tensor, full_name, weights)
                originals.append((module, kind, key, tensor))
                getattr(module, kind)[key] = values

    def restore(count):
        while len(originals) > count:
            module, kind, key, tensor = originals.pop()
            getattr(module, kind)[key] = tensor

    hooks = []
    tables: dict[int, torch.nn.Parameter] = {}
    padding: dict[int, int | None] = {}  # each table's padding index, while its rows are swapped in
    outside = [m for m in base.modules() if id(m) not in inside_layers and not isinstance(m, torch.nn.Embedding)]
    modes = {module: module.training for module in base.modules()}
    base.eval()
    try:
        for module in outside:
            swap_in(module)
        for module in base.modules():
            if isinstance(module, torch.nn.Embedding) and id(module) not in inside_layers:
                hooks.append(module.register_forward_pre_hook(_rows_only(module, names[id(module)], weights, tables,
                                                                            padding)))
                hooks.append(module.register_forward_hook(_rows_dropped(tables, padding)))
        for layer in layers:
            marks: list[int] = []

            def load(module, args, layer=layer, marks=marks):
                marks.append(len(originals))
                for inner in layer.modules():
                    swap_in(inner)

            def drop(module, args, output, marks=marks):
                restore(marks.pop())

            hooks.append(layer.register_forward_pre_hook(load))
            hooks.append(layer.register_forward_hook(drop))
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for module in base.modules():
            if id(module) in tables:  # a forward that raised between the two hooks
                module._parameters["weight"] = tables.pop(id(module))
            if id(module) in padding:
                module.padding_idx = padding.pop(id(module))
        restore(0)
        for module, training in modes.items():
            module.training = training


def _saved_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in module._buffers.items() if v is not None and k not in module._non_persistent_buffers_set}


def _float32_values(tensor: torch.Tensor, name: str, weights) -> torch.Tensor:
    if tensor.device.type == "meta" or (weights is not None and getattr(weights, "provides_buffers", False)
                                        and not isinstance(tensor, torch.nn.Parameter)):
        values = weights.tensor(name, None, torch.float32)
    else:
        values = tensor.detach().to(torch.float32)
    return torch.nn.Parameter(values, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) else values


def _rows_only(embedding: torch.nn.Embedding, name: str, weights, tables: dict[int, torch.nn.Parameter],
               padding: dict[int, int | None]):
    """A pre-hook giving ``embedding`` a table of just the rows its input reads, in float32, and
    the input renumbered into it (the lookup's values are the same); ``tables`` keeps the table to
    put back."""
    def hook(module, args):
        ids = args[0]
        rows, renumbered = torch.unique(ids, return_inverse=True)
        table = module.weight
        if table.device.type == "meta":
            values = torch.cat([weights.tensor(f"{name}.weight", (slice(int(r), int(r) + 1),), torch.float32)
                                for r in rows.tolist()])
        else:
            values = table.detach()[rows].to(torch.float32)
        tables[id(module)] = table
        module._parameters["weight"] = torch.nn.Parameter(values, requires_grad=False)
        # The padding row's index may be past the few rows kept (torch asserts it is within the
        # table); it only stops gradients, so the lookup's values are the same without it.
        padding[id(module)] = module.padding_idx
        module.padding_idx = None
        return (renumbered.to(ids.device), *args[1:])
    return hook


def _rows_dropped(tables: dict[int, torch.nn.Parameter], padding: dict[int, int | None]):
    def hook(module, args, output):
        module._parameters["weight"] = tables.pop(id(module))
        module.padding_idx = padding.pop(id(module))
    return hook
